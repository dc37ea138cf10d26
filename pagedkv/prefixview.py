"""A read-only view of which chained page hashes a store holds, kept outside its writer.

An engine's scheduler decides how much of a prompt a store can serve before any
K/V moves, often in another process than the one that holds the store's writer
handle. It needs no page bytes for that, only the set of chained page hashes
(``pagedkv.pages.prefix``): take a snapshot of them once (``PrefixView.of_store`` on a
read-only handle, or on the writer's own handle in the same process), then keep
it current incrementally with ``add`` (pages the engine has asked the writer to
save) and ``discard`` (pages the writer reported missing). A page believed present
that is gone by the time it is read is the reader's miss to handle (recompute);
the view never serves bytes, so a stale entry can cost time, never correctness.

The hash of page ``i`` of a prompt is ``xxh3_128(hash of page i-1 | salt | token
ids of page i)`` with the salt of the store and its model fingerprint, exactly as
the store computes it, so ``chain`` here and ``KVStore.lookup`` agree.

This is the one module that reads store internals for the prefix (the salt and
the index of hashed pages); everything else goes through the public API.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np

from .errors import PagedKVError
from .pages.prefix import ROOT, chain_hash, make_salt
from .pages.tokens import TOKEN_DTYPE
from .store import KVStore
from .opening import open_store

__all__ = ["PrefixView", "ROOT", "store_salt"]


def store_salt(store: KVStore) -> bytes:
    """The salt an open store mixes into every page hash (its own salt and its model)."""
    return make_salt(store.superblock.get("salt", b""), store.superblock.get("model"))


def _indexed_digests(store: KVStore) -> set[bytes]:
    """Every chained hash in the store's prefix index, read under its lock."""
    with store._lock:  # the writer's threads change the index; read it whole at one point
        store._usable(False)
        mgr = store._mgr
        pids = mgr.prefix.pages()
        if not len(pids):
            return set()
        rows = np.ascontiguousarray(mgr.hash[np.asarray(pids, np.int64)])
    return {bytes(row) for row in rows}


class PrefixView:
    """The set of chained page hashes a store holds, and the chain arithmetic to probe it.

    Params:
        salt: the store's hash salt (``store_salt``).
        page_size: tokens per page.
        digests: the hashes present to start with.
        model: the store's model fingerprint, for the caller to compare with its own.
    """

    def __init__(self, salt: bytes, page_size: int, digests: Iterable[bytes] = (),
                 model: str | None = None) -> None:
        self.salt = salt
        self.page_size = page_size
        self.model = model
        self._present: set[bytes] = set(digests)

    @classmethod
    def of_store(cls, store: KVStore) -> PrefixView:
        """A snapshot of an open handle (read-only or the writer itself)."""
        return cls(store_salt(store), store.geometry.page_size, _indexed_digests(store), store.model)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> PrefixView:
        """A snapshot of the store at ``path`` through a short-lived read-only handle.

        Raises the errors of ``pagedkv.open(path, readonly=True)``; ``StoreLocked``
        if this very process holds the writer (take ``of_store`` of that handle).
        """
        store = open_store(path, readonly=True)
        try:
            return cls.of_store(store)
        finally:
            store.close()

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, digest: object) -> bool:
        return digest in self._present

    def chain(self, token_ids: Any, parent: bytes = ROOT, start_page: int = 0,
              max_pages: int | None = None) -> list[bytes]:
        """Chained hashes of the full pages of ``token_ids`` from page ``start_page`` on.

        ``parent`` is the hash of page ``start_page - 1`` (``ROOT`` before the first
        page). A trailing partial page has no hash.
        """
        ids = np.ascontiguousarray(token_ids, TOKEN_DTYPE)
        if ids.ndim != 1:
            raise PagedKVError("token ids must be 1-D")
        size = self.page_size
        stop = len(ids) // size
        if max_pages is not None:
            stop = min(stop, start_page + max_pages)
        out: list[bytes] = []
        for page in range(start_page, stop):
            parent = chain_hash(parent, self.salt, ids[page * size:(page + 1) * size])
            out.append(parent)
        return out

    def leading(self, digests: Iterable[bytes]) -> int:
        """How many of ``digests``, from the first on, are present."""
        count = 0
        present = self._present
        for digest in digests:
            if digest not in present:
                break
            count += 1
        return count

    def add(self, digests: Iterable[bytes]) -> None:
        """Record pages as present (the writer was asked to save them)."""
        self._present.update(digests)

    def discard(self, digests: Iterable[bytes]) -> None:
        """Forget pages (the writer reported them missing or unreadable)."""
        self._present.difference_update(digests)
