"""The state of an open store, below every module that works on it.

``StoreCore`` holds what one store handle owns (the block manager, the loaded
sequences, the lock, the commit state, the handle's health) and the checks each
operation starts with. The data paths (datapath, step, check) take a
``StoreCore``; the background threads get its ``background_host``, the small
surface of background/host.py that ``CoreHost`` implements here; ``KVStore``
(store.py) builds the public API on it. Nothing here imports those modules (only
the host's interface), so the store level has no import cycle.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import weakref
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, TypeVar

import lmdb
import numpy as np

from .background.host import BackgroundHost
from .errors import (ReadOnlyStore, SequenceBusy, StoreClosed, StoreCorrupt, StoreFull,
                     StoreIOError)
from .geometry import Geometry
from .options import StoreOptions
from .pages import persist
from .pages.manager import BlockManager
from .pages.prefix import make_salt
from .pages.sequence import SeqId, Sequence
from .sequences import Sequences
from .counters import Stats
from .storage.codec import FORMAT_VERSION
from .storage.pool import PagePool
from .storage.lmdberrors import lmdb_error
from .storage.spill import SpillStore

__all__ = ["CoreHost", "StoreCore", "_op"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

log = logging.getLogger("pagedkv.store")

_forks = 0  # forks this process descends from: a handle is usable only in the process that opened it


def _count_fork() -> None:
    global _forks
    _forks += 1


# Counted at the fork rather than asking os.getpid() per operation: that system call
# was a tenth of a one-page read.
os.register_at_fork(after_in_child=_count_fork)


def _op(write: bool, keeps_pins: bool = False) -> Callable[[F], F]:
    """Serialise a public operation on the store lock and check the handle is usable.

    Pins a batch's last step kept for its next step are given back first, except
    by a step (``keeps_pins``), which takes them over if it is that next step.
    """

    def wrap(fn: F) -> F:
        def inner(self: StoreCore, *args: Any, **kwargs: Any) -> Any:
            # acquire/release rather than a with block: its __enter__/__exit__ lookups and
            # exit call cost twice the lock itself, a tenth of a resident one-page read.
            lock = self._lock
            lock.acquire()
            try:
                self._usable(write)
                if not keeps_pins and self._mgr.kept_for is not None:
                    self._mgr.release_kept()
                try:
                    return fn(self, *args, **kwargs)
                except lmdb.Error as exc:
                    error = lmdb_error(exc, fn.__name__)
                    self._poison(str(error))
                    raise error from None
                except (StoreIOError, StoreFull) as exc:
                    # Reads evict and restore too: any failed I/O leaves memory ahead of
                    # (or behind) disk, so the handle stops; the last commit is intact.
                    if not getattr(exc, "recoverable", False):
                        self._poison(str(exc))
                    raise
            finally:
                lock.release()

        inner.__name__, inner.__doc__, inner.__wrapped__ = fn.__name__, fn.__doc__, fn  # type: ignore
        return inner  # type: ignore[return-value]

    return wrap


class StoreCore:
    """The state of one open store handle, and the checks every operation starts with."""

    def __init__(self, path: str, pool: PagePool, spill: SpillStore, superblock: dict[str, Any],
                 options: StoreOptions, lock: Any) -> None:
        self.path = path
        self.geometry: Geometry = pool.geom
        self.pool_pages = pool.pool_pages
        self.durability = options.durability
        self.readonly = readonly = options.readonly
        self.uuid = pool.uuid.hex()
        self.superblock = superblock
        self._pool_file, self._spill, self._writer_lock = pool, spill, lock
        self._lock = threading.RLock()
        self._no_steps = threading.Condition(self._lock)
        self._active_steps: dict[int, int] = {}  # thread id -> steps it has open
        self._step_waiters = 0  # threads in _wait_no_steps: only they need waking when steps end
        self._stats = Stats()
        self._options = options
        self._mgr = self._new_manager()
        self.model: str | None = superblock.get("model")
        self.spill_limit_bytes = options.spill_limit
        self.spill_codec = options.spill_codec
        self._closed = False
        self._poisoned: str | None = None  # why an I/O failure stopped this handle's writes
        self._pid = os.getpid()
        self._fork = _forks
        tables, self._state, self._damage = self._load(writer=not readonly)
        self._seqs = Sequences(tables.values())  # the sequences, their pending changes, active steps
        self.background_host: BackgroundHost = CoreHost(self)  # what the background threads get

    def _load(self, writer: bool) -> tuple[dict[bytes, Sequence], dict[str, Any], list[str]]:
        """The committed state; a writer brings an older store to the current format first."""
        sealed = self.superblock["format"] >= persist.SEALED_FORMAT
        try:
            loaded = persist.load(self._mgr, writer=writer, sealed=sealed)
            if writer:
                self._log_recovery()
            if writer and not sealed:
                persist.upgrade(self._mgr, self.superblock)
                log.info("%s: upgraded from format 1: its metadata was rewritten sealed (format %d), "
                         "in one transaction", self.path, self.superblock["format"])
            elif writer and self.superblock["format"] < FORMAT_VERSION:
                was = persist.upgrade_superblock(self._mgr, self.superblock)
                log.info("%s: upgraded from format %d to %d: its superblock was rewritten, in one "
                         "transaction", self.path, was, self.superblock["format"])
            return loaded
        except lmdb.Error as exc:
            raise lmdb_error(exc, f"cannot load {self.path}") from None
        except (struct.error, ValueError, OverflowError) as exc:  # hostile bytes in metadata
            raise StoreCorrupt(f"{self.path}: metadata is malformed ({exc})") from None

    def _log_recovery(self) -> None:
        """Say what a writer's open found left over by an interrupted writer (collected from now on)."""
        mgr = self._mgr
        if mgr.doomed:
            log.info("%s: %d stray spill records (%d bytes), left by a writer that stopped before "
                     "committing, are deleted by the next write", self.path, len(mgr.doomed),
                     sum(nbytes for _, nbytes in mgr.doomed))
        if mgr.zombies:
            log.info("%s: %d committed pages no sequence references are collected at the next commit",
                     self.path, len(mgr.zombies))

    def _new_manager(self) -> BlockManager:
        pool, options, superblock = self._pool_file, self._options, self.superblock
        return BlockManager(pool.geom, pool, self._spill, int.from_bytes(pool.uuid[:8], "little"),
                            options.durability == "durable", options.evict_batch, self._stats,
                            make_salt(superblock.get("salt", b""), superblock.get("model")),
                            options.spill_limit, options.spill_codec)

    def _refresh(self) -> None:
        """Read-only: take a new snapshot of the store (a live writer has moved on)."""
        self._spill.refresh()
        self._mgr = self._new_manager()
        tables, self._state, self._damage = self._load(writer=False)
        self._seqs = Sequences(tables.values())

    def _in_opening_process(self) -> bool:
        """Whether this is the process that opened the handle (not a forked child of it)."""
        return _forks == self._fork

    def _usable(self, write: bool) -> None:
        if self._closed:
            raise StoreClosed(f"{self.path}: the store is closed")
        if _forks != self._fork:
            raise StoreClosed(f"{self.path}: opened in process {self._pid}; reopen it in this one")
        if self._poisoned and write:
            raise StoreClosed(f"{self.path}: an earlier I/O failure poisoned this handle "
                              f"({self._poisoned}); reopen the store")
        if write and self.readonly:
            raise ReadOnlyStore(f"{self.path}: opened read-only")

    def _poison(self, reason: str) -> None:
        """Stop this handle's writes after an I/O failure: memory may be ahead of disk since the last commit.

        The one place a handle is poisoned (foreground operations and background
        threads alike); a read-only handle writes nothing, so there is nothing to stop.
        """
        if not self.readonly:
            self._poisoned = reason

    def _wait_no_steps(self, what: str) -> None:
        """Wait (holding the lock) until no thread has a step open; ``SequenceBusy`` inside one's own.

        A decode step that ended during the wait may have kept its pins for its
        batch's next step: they are given back here, as ``_op`` gives them back
        before any other operation, since the caller (a commit, a close) goes on
        to look at the pool.
        """
        if self._active_steps.get(threading.get_ident()):
            raise SequenceBusy(f"{what} inside an active step of this thread")
        self._step_waiters += 1
        try:
            while self._active_steps:
                self._no_steps.wait()
        finally:
            self._step_waiters -= 1
        self._mgr.release_kept()


class CoreHost(BackgroundHost):
    """``BackgroundHost`` on a ``StoreCore``: a view that owns nothing and holds the handle weakly.

    Every answer is read from the handle when asked (a read-only handle replaces
    its manager and sequences on refresh). The weak reference keeps the handle
    free of a cycle through its own host, so a dropped handle is freed at once;
    once it is gone the host reads as closed.
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = weakref.ref(core)
        self._path = core.path
        self._lock = core._lock  # never replaced: the threads may hold it while the handle goes

    def _live(self) -> StoreCore:
        core = self._core()
        if core is None:
            raise StoreClosed(f"{self._path}: the store is closed")
        return core

    @property
    def path(self) -> str:
        """The store's directory, for log lines."""
        return self._path

    @property
    def lock(self) -> threading.RLock:
        """The store lock every foreground operation holds."""
        return self._lock

    @property
    def manager(self) -> BlockManager:
        """The handle's block manager as of now; under the lock."""
        return self._live()._mgr

    @property
    def readonly(self) -> bool:
        """Whether the handle was opened read-only."""
        return self._live().readonly

    @property
    def closed(self) -> bool:
        """Whether the handle is closed or was dropped."""
        core = self._core()
        return core is None or core._closed

    @property
    def poisoned(self) -> bool:
        """Whether an I/O failure stopped the handle's writes."""
        return bool(self._live()._poisoned)

    def poison(self, reason: str) -> None:
        """Poison the handle through ``StoreCore._poison``, under the store lock."""
        with self._lock:
            self._live()._poison(reason)

    def tables(self, seq_ids: Iterable[SeqId]) -> list[np.ndarray]:
        """The block tables of those of ``seq_ids`` that still exist (views; under the lock)."""
        seqs = self._live()._seqs
        return [seq.table for seq in (seqs.get(sid) for sid in seq_ids) if seq is not None]

    def place(self, pid: int, slot: int) -> None:
        """Record a page restored into ``slot`` in the page table; under the lock."""
        self._live()._mgr.place(pid, slot)

    def read_transaction(self) -> AbstractContextManager[Any]:
        """A counted spill read transaction (``SpillStore.background_read``)."""
        return self._live()._spill.background_read()

    def write_transaction(self, body: Callable[[Any], T], what: str) -> T:
        """One spill write transaction (``SpillStore.write``)."""
        return self._live()._spill.write(body, what)
