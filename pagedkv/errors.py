"""The one exception tree of pagedkv: every public error is a ``PagedKVError``."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises."""


class SequenceNotFound(PagedKVError, KeyError):
    """The sequence id is not in the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable
        return str(self.args[0]) if self.args else "sequence not found"


class SequenceExists(PagedKVError):
    """A sequence with this id already exists."""


class SequenceBusy(PagedKVError):
    """The sequence is part of an active step and cannot be changed now."""


class PoolExhausted(PagedKVError):
    """Every pool slot is pinned: the request cannot be made resident at once."""


class StoreLocked(PagedKVError):
    """Another writer holds the store's lock."""


class StoreCorrupt(PagedKVError):
    """Store-level damage: header page, superblock or metadata fail validation."""


class PageCorrupt(PagedKVError):
    """One page failed its checksum or record validation; the rest of the store is usable."""

    def __init__(self, message: str, uid: int | None = None) -> None:
        super().__init__(message)
        self.uid = uid


class GeometryMismatch(PagedKVError):
    """The geometry (or pool size) asked for differs from the one on disk."""


class ModelMismatch(PagedKVError):
    """The store holds KV of another model (its fingerprint differs)."""


class StoreFull(PagedKVError):
    """The disk, the file-size limit or the spill cap is exhausted."""


class StoreIOError(PagedKVError):
    """An I/O operation failed; the handle is poisoned until reopen."""


class StoreClosed(PagedKVError):
    """The store handle is closed (or poisoned by an earlier I/O failure)."""


class ReadOnlyStore(PagedKVError):
    """A write was attempted on a store opened read-only."""


class FormatVersionError(PagedKVError):
    """The store was written by a newer format version than this reader knows."""


class MissingDependency(PagedKVError, ImportError):
    """An optional feature needs a package that is not installed (the message says which extra)."""
