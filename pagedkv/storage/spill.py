"""The spill store: one LMDB environment holding metadata and spilled pages.

Named databases: ``meta`` (superblock, commit state, LRU stamps), ``seqs``
(block tables by sequence id), ``dir`` (page directory by uid), ``pages``
(spilled page records by uid) and ``tokens`` (token ids of pages, by uid). Keys are fixed-width big-endian so that byte
order is numeric order.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, TypeVar

import lmdb

from .. import faults
from ..errors import StoreCorrupt, StoreFull, StoreIOError
from .files import (DIR_MODE, FILE_MODE, fd_path, file_id, io_error, lookup, make_private_dir, open_dir,
                    open_file, opened_problem, refuse_untrusted, tighten_opened, watch_opens)
from .lmdbcheck import check_data_file, probe_in_child
from .lmdberrors import lmdb_error

T = TypeVar("T")
DB_NAMES = (b"meta", b"seqs", b"dir", b"pages", b"tokens")
_UID = struct.Struct(">Q")
DEFAULT_MAP_SIZE = 1 << 30
_MAP_CEILING = 1 << 44  # the map doubles until a transaction fits, up to 16 TiB of address space


def uid_key(uid: int) -> bytes:
    """The LMDB key of a page uid."""
    return _UID.pack(uid)


# Transaction.stat returns a dict whose keys CPython interns. Names that nothing
# else holds would be interned and released again on every call, and that churn
# makes the interpreter rebuild its table of interned strings (about 1 MB in a
# process with numpy loaded) every few hundred write transactions: held here, the
# interning finds them.
_STAT_FIELDS = tuple(sys.intern(name) for name in
                     ("psize", "depth", "branch_pages", "leaf_pages", "overflow_pages", "entries"))


def entry_count(txn: lmdb.Transaction, db: Any) -> int:
    """The number of records in ``db`` as of ``txn`` (LMDB's own count)."""
    count: int = txn.stat(db)["entries"]
    return count


def key_uid(key: bytes) -> int:
    """Inverse of ``uid_key``; a key of another length is damage."""
    if len(key) != _UID.size:
        raise StoreCorrupt(f"a page key of {len(key)} bytes is not a uid")
    uid: int = _UID.unpack(key)[0]
    return uid


COMPACT_PREFIX = "data.mdb.compact-"  # a compaction's copy of data.mdb, until its rename


def remove_compaction_copies(spill_dir: str) -> int:
    """Delete the copies interrupted compactions left in ``spill_dir``; how many there were.

    Call it only while holding the store's writer lock: a compaction holds that
    lock from before its copy exists until after the rename, so under it every
    copy is abandoned.
    """
    try:
        names = os.listdir(spill_dir)
    except OSError:
        return 0  # opening the store reports what is wrong with the directory
    removed = 0
    for name in names:
        if name.startswith(COMPACT_PREFIX):
            try:
                os.unlink(os.path.join(spill_dir, name))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise io_error(exc, f"cannot remove the abandoned copy {os.path.join(spill_dir, name)}") from None
    return removed


_LOCK_FILE_BYTES = 128 + 126 * 64  # LMDB's lock file: its header and max_readers slots


def _reserve_lock_file(lock_path: str, dir_fd: int) -> None:
    """Create lock.mdb with its blocks allocated (``StoreFull`` when the disk has no room)."""
    try:
        fd = os.open("lock.mdb", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        return  # another opener made it: LMDB sizes it, and it is checked like any other
    except OSError as exc:
        raise io_error(exc, f"cannot create {lock_path}") from None
    try:
        os.posix_fallocate(fd, 0, _LOCK_FILE_BYTES)
    except OSError as exc:
        os.close(fd)
        os.unlink("lock.mdb", dir_fd=dir_fd)
        raise io_error(exc, f"cannot allocate {lock_path}") from None
    os.close(fd)


class _Borrowed:
    """A context manager lending a long-lived transaction without ending it."""

    def __init__(self, txn: lmdb.Transaction) -> None:
        self.txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self.txn

    def __exit__(self, *exc: Any) -> None:
        return None


class _ReadersGate(threading.Condition):
    """What map growth waits on until no read transaction is open; it knows whether anyone waits.

    The last reader to leave wakes the waiters only when there are some: a
    notify per read transaction was a fifth of a one-page read.
    """

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.waiting = 0  # threads inside wait(); changed under the lock

    def wait(self, timeout: float | None = None) -> bool:
        """``Condition.wait``, counted in ``waiting``."""
        self.waiting += 1
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


class _Reading(AbstractContextManager[Any]):
    """``SpillStore.background_read``: a counted read transaction, for one ``with``.

    A class rather than a generator, and the count taken through the
    condition's own lock methods: a one-page read opens one per call, and the
    generator's machinery cost more than LMDB's begin and end.
    """

    __slots__ = ("spill", "txn")

    def __init__(self, spill: SpillStore) -> None:
        self.spill = spill
        self.txn: lmdb.Transaction | None = None

    def __enter__(self) -> lmdb.Transaction:
        spill = self.spill
        readers = spill._readers
        readers.acquire()
        spill._reading += 1
        readers.release()
        try:
            try:
                txn = spill.env.begin(buffers=True)
            except lmdb.ReadersFullError:
                spill.env.reader_check()  # slots of killed readers
                txn = spill.env.begin(buffers=True)
        except BaseException:
            self._done()
            raise
        self.txn = txn
        return txn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        txn, self.txn = self.txn, None
        try:
            if txn is not None:
                txn.__exit__(exc_type, exc, tb)
        finally:
            self._done()

    def _done(self) -> None:
        spill = self.spill
        readers = spill._readers
        readers.acquire()
        try:
            spill._reading -= 1
            if not spill._reading and readers.waiting:  # what map growth waits for
                readers.notify_all()
        finally:
            readers.release()


class SpillStore:
    """A thin, typed wrapper over the LMDB environment of one store."""

    def __init__(self, path: str, *, readonly: bool, create: bool, sync: bool,
                 map_size: int | None = None, register_reader: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._snapshot: lmdb.Transaction | None = None
        self._readers = _ReadersGate()  # guards _reading against map growth
        self._reading = 0
        self._writing = threading.Lock()  # one write transaction at a time across threads
        self._shared_writes = False  # whether a thread other than the lock holder's writes (share_writes)
        # Called inside every write transaction before it commits (the writer's record counts).
        self.on_write: Callable[[lmdb.Transaction], None] | None = None
        if create:
            make_private_dir(path)
        elif lookup(path) is None:
            raise StoreCorrupt(f"{path} is missing")
        # Beside a live writer a reader registers in LMDB's lock table, so the writer
        # never reuses the pages its snapshot sees. Without one it writes nothing.
        locking = not readonly or register_reader
        data_path, lock_path = os.path.join(path, "data.mdb"), os.path.join(path, "lock.mdb")
        # LMDB opens data.mdb and lock.mdb itself, by name, following links and blocking
        # on a FIFO. So both are checked first (the directory and data.mdb through
        # descriptors held until LMDB is open), and afterwards the files LMDB holds
        # must be the checked ones: a name swapped in between is refused.
        dir_fd = open_dir(path)
        data_fd = None
        try:
            if not create and lookup(data_path, dir_fd, "data.mdb") is None:
                raise StoreCorrupt(f"{data_path} is missing")
            data_fd = open_file(data_path, writable=not readonly, create=create, dir_fd=dir_fd,
                                name="data.mdb")
            checked = {"data.mdb": os.fstat(data_fd)}
            # lock.mdb is looked at, never opened here: closing any descriptor of it
            # drops the POSIX locks LMDB holds on it in this process.
            lock_seen = lookup(lock_path, dir_fd, "lock.mdb")
            if lock_seen is not None:
                refuse_untrusted(lock_path, lock_seen, writable=locking)
            if not create:
                pinned = fd_path(data_fd) or data_path  # reaches the checked file, not the name
                try:
                    check_data_file(pinned)
                except StoreCorrupt as exc:
                    raise StoreCorrupt(str(exc).replace(pinned, data_path)) from None
                probe_in_child(path, DB_NAMES, lock=readonly and register_reader)
            if locking and lock_seen is None:
                # LMDB sizes a new lock file sparsely and maps it: on a full disk its first
                # touch of a page is SIGBUS. Its blocks are reserved here instead.
                _reserve_lock_file(lock_path, dir_fd)
                lock_seen = lookup(lock_path, dir_fd, "lock.mdb")
            tries = 3  # extra open files may be another thread's: look again before refusing
            for attempt in range(tries):
                try:
                    env, opened = watch_opens(lambda: lmdb.open(
                        path, map_size=map_size or DEFAULT_MAP_SIZE, subdir=True, readonly=readonly,
                        lock=locking, sync=sync, metasync=sync, writemap=False, readahead=False,
                        max_dbs=len(DB_NAMES), max_readers=126, mode=0o600, create=create,
                        max_spare_txns=0,
                    ))
                except lmdb.Error as exc:
                    raise lmdb_error(exc, f"cannot open spill store {path}", path) from None
                try:
                    if locking:
                        lock_now = lookup(lock_path, dir_fd, "lock.mdb")
                        if lock_now is None or (lock_seen is not None and file_id(lock_now) != file_id(lock_seen)):
                            raise StoreCorrupt(f"{lock_path} was replaced while it was being opened; refused")
                        refuse_untrusted(lock_path, lock_now, writable=True)
                        checked["lock.mdb"] = lock_now
                    problem, certain = opened_problem(path, dir_fd, checked, opened)
                except BaseException:
                    env.close()
                    raise
                if problem is None:
                    break
                env.close()
                if certain or attempt == tries - 1:
                    raise StoreCorrupt(problem)
            self.env = env
            try:
                if readonly:
                    self.dbs = {name: self.env.open_db(name, create=False) for name in DB_NAMES}
                    # One snapshot for the handle's life: directory and records always agree.
                    self._snapshot = self.env.begin(buffers=True)
                else:
                    self.dbs = self._create_dbs()
                    self.stale_readers = self.env.reader_check()
                    try:
                        os.fchmod(dir_fd, DIR_MODE)
                        os.fchmod(data_fd, FILE_MODE)
                    except OSError as exc:
                        raise io_error(exc, f"cannot set the modes of {path}") from None
                    tighten_opened(dir_fd, "lock.mdb", file_id(checked["lock.mdb"]), opened)
            except lmdb.NotFoundError:
                self.env.close()
                raise StoreCorrupt(f"{path}: not a pagedkv spill store (named databases missing)") from None
            except lmdb.Error as exc:
                self.env.close()
                raise lmdb_error(exc, f"cannot open spill store {path}", path) from None
            except BaseException:
                self.env.close()
                raise
        finally:
            if data_fd is not None:
                os.close(data_fd)
            os.close(dir_fd)
        self.meta, self.seqs, self.dir, self.pages, self.tokens = (self.dbs[name] for name in DB_NAMES)

    def _create_dbs(self) -> dict[bytes, Any]:
        """Open (creating) the named databases, growing the map while it is too small for them."""
        while True:
            try:
                return {name: self.env.open_db(name, create=True) for name in DB_NAMES}
            except lmdb.MapFullError:
                with self._writing:
                    self._grow("create the named databases")

    def write(self, body: Callable[[lmdb.Transaction], T], what: str = "commit") -> T:
        """Run ``body`` in one write transaction and commit it; grow the map when full.

        ``body`` may run more than once (after a map growth), so it must only
        issue puts and deletes computed beforehand. The map doubles as often as
        the transaction needs: one value or one batch may be any multiple of it.
        """
        while True:
            try:
                with self._writing, self.env.begin(write=True) as txn:
                    result = body(txn)
                    if self.on_write is not None:
                        self.on_write(txn)
                    faults.io("commit")
                    faults.crashpoint("lmdb.before_commit")
                return result
            except lmdb.MapFullError:
                with self._writing:
                    self._grow(what)
            except lmdb.Error as exc:
                raise lmdb_error(exc, what, self.path) from None
            except OSError as exc:  # raised by an injected fault inside the transaction
                raise io_error(exc, what) from None

    def _grow(self, what: str) -> None:
        """Double the map (the caller holds ``_writing``); ``StoreFull`` once it cannot grow."""
        size = self.env.info()["map_size"]
        if size >= _MAP_CEILING:
            raise StoreFull(f"{what}: the spill map is at its ceiling of {size} bytes and still too small")
        try:
            faults.io("set_mapsize")
            with self._readers:  # no other thread may hold a read txn over the old mapping
                self._readers.wait_for(lambda: not self._reading)
                self.env.set_mapsize(min(2 * size, _MAP_CEILING))
        except lmdb.Error as exc:
            raise lmdb_error(exc, "cannot grow the spill map", self.path) from None
        except OSError as exc:
            raise io_error(exc, "cannot grow the spill map") from None
        if self.env.info()["map_size"] <= size:  # a map that did not grow would loop forever
            raise StoreFull(f"{what}: the spill map did not grow past {size} bytes")

    def put(self, txn: lmdb.Transaction, db: Any, key: bytes, value: bytes | bytearray) -> None:
        """Put one value (an I/O seam for fault tests)."""
        faults.io("put")
        txn.put(key, value, db=db)

    def begin_read(self) -> Any:
        """A read transaction whose values are zero-copy buffers; use it in a ``with``.

        A read-only store reads every time from the snapshot it took at open.
        """
        if self._snapshot is not None:
            return _Borrowed(self._snapshot)
        return self.background_read()

    def share_writes(self) -> None:
        """Say that from now on a background thread writes (and may grow the map) beside the caller.

        Until then every write comes from the thread holding the store's lock, so
        ``locked_read`` can skip the reader count; afterwards it counts too.
        """
        self._shared_writes = True

    def locked_read(self) -> Any:
        """``begin_read`` for a caller holding the store's lock: counted only once writes are shared.

        Without a background writer, map growth happens only inside a write of the
        lock holder, which cannot overlap this transaction. Uncounted, a one-page
        restore's transaction costs LMDB's begin and end alone: the count's lock
        round trips were a tenth of that read.
        """
        if self._snapshot is not None:
            return _Borrowed(self._snapshot)
        if self._shared_writes:
            return _Reading(self)
        try:
            return self.env.begin(buffers=True)
        except lmdb.ReadersFullError:
            self.env.reader_check()  # slots of killed readers
            return self.env.begin(buffers=True)

    def background_read(self) -> _Reading:
        """A read transaction, counted so that map growth waits until none is open.

        Resizing remaps the file under every open transaction of this process, and
        background threads (prefetch, write-behind) read and write beside each other.
        """
        return _Reading(self)

    def iterate(self, txn: lmdb.Transaction, db: Any, keys_only: bool = False) -> Iterator[Any]:
        """All (key, value) pairs of ``db`` in key order (or keys only)."""
        cursor = txn.cursor(db=db)
        if keys_only:
            return cursor.iternext(keys=True, values=False)
        return cursor.iternext(keys=True, values=True)

    def sync(self) -> None:
        """Force the environment to stable storage."""
        try:
            faults.io("flush")
            self.env.sync(True)
        except lmdb.Error as exc:
            raise lmdb_error(exc, "cannot sync the spill store") from None
        except OSError as exc:
            raise StoreIOError(f"cannot sync the spill store: {exc}") from None

    def info(self) -> dict[str, Any]:
        """Map use, readers and entry counts, for stats and inspect."""
        info = self.env.info()
        with self.begin_read() as txn:
            counts = {name.decode(): entry_count(txn, db) for name, db in self.dbs.items()}
        return {
            "map_size": info["map_size"],
            "map_used": (info["last_pgno"] + 1) * self.env.stat()["psize"],
            "readers": info["num_readers"],
            "last_txnid": info["last_txnid"],
            "entries": counts,
        }

    def refresh(self) -> None:
        """A read-only store takes a new snapshot (to see a live writer's later commits)."""
        if self._snapshot is not None:
            self._snapshot.abort()
            self._snapshot = self.env.begin(buffers=True)

    def close(self) -> None:
        """Close the environment (idempotent)."""
        if self._snapshot is not None:
            self._snapshot.abort()
            self._snapshot = None
        if self.env is not None:
            self.env.close()
            self.env = None  # type: ignore[assignment]
