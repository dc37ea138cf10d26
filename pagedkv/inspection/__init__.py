"""Offline reports on a store on disk: what `pagedkv inspect` and `verify` print, through the store's read API."""
