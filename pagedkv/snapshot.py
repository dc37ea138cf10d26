"""Opening a store for inspection without writing a byte, or beside a live writer with bounded space.

Both cases go through ``pagedkv.open(path, readonly=True)``:

* with no writer, LMDB is opened with ``lock=False``: nothing under the store is
  written, not even ``spill/lock.mdb``;
* beside a live writer (one holds ``LOCK``), the reader registers in LMDB's
  reader table, a slot in ``spill/lock.mdb`` (a lock file, not data). While it
  holds its read transaction the writer reuses none of the pages of the commit
  it sees, so that snapshot stays whole however long the inspection takes, and
  nothing is copied: temporary space is nil and memory does not grow with the
  size of ``data.mdb``. The writer's file may grow meanwhile by what it commits
  (pages the snapshot pins are not reused), and the slot is freed at close.

A writer that starts while an unregistered open is under way would leave that
reader unprotected, so the lock is looked at again once the store is open, and
such an open is redone as a registered one.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import PagedKVError, StoreCorrupt, StoreLocked
from .storage.lockfile import lock_holder
from .opening import open_store
from .store import KVStore

POOL_FILE, SPILL_DIR, LOCK_FILE, DATA_FILE, LMDB_LOCK = "pool.bin", "spill", "LOCK", "data.mdb", "lock.mdb"
# lock.mdb layout of LMDB 0.9 on 64-bit Linux (MDB_txninfo): magic at 0, the reader
# high-water mark at 56, then 64-byte reader slots from offset 128 (pid at +8).
_LOCK_MAGIC, _NUMREADERS_AT, _READERS_AT, _READER_NBYTES = 0xBEEFC0DE, 56, 128, 64
_OPEN_TRIES = 3  # opens redone because a writer appeared while an unregistered one ran


class SnapshotUnavailable(StoreLocked):
    """Beside a live writer, no consistent view of the store could be taken.

    A ``StoreLocked``: the store is busy, not damaged; trying again later may succeed.
    """


class NotAStore(PagedKVError):
    """The path is not a pagedkv store directory (missing, a file, empty, another directory, a link)."""


class AlreadyOpenHere(PagedKVError):
    """This process already holds the store's LMDB environment open (LMDB allows one handle)."""


@dataclass
class Snapshot:
    """A read-only store handle plus what the inspector learned while opening it."""

    path: str
    store: KVStore
    writer_pid: int | None  # pid of a live writer holding LOCK (-1: held, pid unknown)
    registered: bool  # True when the read holds a reader slot in spill/lock.mdb
    notes: list[str] = field(default_factory=list)

    def readers(self) -> dict[str, Any]:
        """``lmdb_readers`` of the store, leaving this process's own slot out.

        A registered handle asks its own environment: opening and closing another
        descriptor of lock.mdb would drop the POSIX locks LMDB holds on it here,
        and with them the liveness mark of this reader's slot.
        """
        if not self.registered:
            return lmdb_readers(self.path, exclude=os.getpid())
        table = self.store.spill_info().reader_pids
        if table is None:  # a figure for display: unknown is an answer
            return {"readers": None, "stale": None, "pids": []}
        pids = [pid for pid in table if pid != os.getpid()]
        stale = [pid for pid in pids if not _alive(pid)]
        return {"readers": len(pids) - len(stale), "stale": len(stale), "pids": sorted(set(pids))}

    def close(self) -> None:
        """Close the store, freeing its reader slot if it held one."""
        self.store.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def require_store_dir(path: str) -> None:
    """Raise a one-line ``NotAStore`` (or ``StoreCorrupt``) unless ``path`` looks like a pagedkv store directory."""
    if not os.path.lexists(path):
        raise NotAStore(f"{path}: no such file or directory")
    if os.path.islink(path):
        raise NotAStore(f"{path} is a symbolic link; refused")
    if not os.path.isdir(path):
        raise NotAStore(f"{path} is not a directory (a pagedkv store is a directory)")
    try:
        names = set(os.listdir(path))
    except OSError as exc:
        raise NotAStore(f"{path}: cannot list directory ({exc.strerror})") from None
    if not names:
        raise NotAStore(f"{path} is an empty directory, not a pagedkv store")
    if POOL_FILE not in names:
        what = "an LMDB environment" if DATA_FILE in names else "a directory"
        raise NotAStore(f"{path} is {what} but not a pagedkv store (no {POOL_FILE})")
    if SPILL_DIR not in names or not os.path.lexists(os.path.join(path, SPILL_DIR, DATA_FILE)):
        raise StoreCorrupt(f"{path}: {SPILL_DIR}/{DATA_FILE} is missing")
    if os.path.islink(os.path.join(path, SPILL_DIR)):
        raise NotAStore(f"{os.path.join(path, SPILL_DIR)} is a symbolic link; refused")
    # Regular files only: a symlink could point anywhere, and opening a FIFO would hang.
    for name, required in ((POOL_FILE, True), (os.path.join(SPILL_DIR, DATA_FILE), True),
                           (LOCK_FILE, False), (os.path.join(SPILL_DIR, LMDB_LOCK), False)):
        full = os.path.join(path, name)
        try:
            mode = os.lstat(full).st_mode
        except FileNotFoundError:
            if required:
                raise StoreCorrupt(f"{full} is missing") from None
            continue
        except OSError as exc:
            raise NotAStore(f"{full}: {exc.strerror}") from None
        if stat.S_ISLNK(mode):
            raise NotAStore(f"{full} is a symbolic link; refused")
        if not stat.S_ISREG(mode):
            raise StoreCorrupt(f"{full} is not a regular file")


def open_snapshot(path: str, live: bool = True) -> Snapshot:
    """Open the store at ``path`` read-only: with no writer, writing nothing at all.

    Params:
        live: when a writer holds the lock, read the snapshot of its last commit
            through a reader slot in ``spill/lock.mdb`` (True) or raise
            ``StoreLocked`` (False).
    Raises:
        PagedKVError (and subclasses) for anything that is not a readable store;
        ``AlreadyOpenHere`` when this process already has the store open.
    """
    require_store_dir(path)
    lock_path = os.path.join(path, LOCK_FILE)
    for _ in range(_OPEN_TRIES):
        holder = lock_holder(lock_path)
        if holder is not None and not live:
            who = f"pid {holder}" if holder > 0 else "another process"
            raise StoreLocked(f"{path} is in use by a writer ({who})")
        store = _open_readonly(path)
        registered = store.spill_info().locking
        now = lock_holder(lock_path)
        if registered or now is None:
            break
        store.close()  # a writer started during an unregistered open: its snapshot is not pinned
    writer = now if now is not None else holder
    notes = ["the writer is live: metadata is the snapshot of its last commit, held by a reader slot "
             "in spill/lock.mdb; pool pages the writer rewrote since may fail their checksum "
             "(reported unverified)"] if writer is not None else []
    return Snapshot(path, store, writer, registered, notes)


def _open_readonly(path: str) -> KVStore:
    try:
        # Inspection may look at a store on a network filesystem (a copy someone shared);
        # only a writer's LMDB locking would be unsafe there.
        return open_store(path, readonly=True, allow_remote=True)
    except PagedKVError as exc:
        if "already open in this process" in str(exc):
            raise AlreadyOpenHere(f"{path} is already open in this process (pid {os.getpid()}); LMDB allows "
                                  "one handle per process: read it through that handle, or run pagedkv "
                                  "in another process") from None
        raise


def lmdb_readers(path: str, exclude: int | None = None) -> dict[str, Any]:
    """Reader slots of ``spill/lock.mdb``, read without locking or writing.

    Returns {"readers": live slots, "stale": slots whose pid is gone, "pids": [...]},
    with None values when the lock file is absent or its layout is not recognised;
    slots of pid ``exclude`` (the caller's own, say) are not counted.
    """
    unknown: dict[str, Any] = {"readers": None, "stale": None, "pids": []}
    lock_path = os.path.join(path, SPILL_DIR, LMDB_LOCK)
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return unknown
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return unknown
        head = os.pread(fd, _READERS_AT, 0)
        if len(head) < _READERS_AT or struct.unpack_from("<I", head, 0)[0] != _LOCK_MAGIC:
            return unknown
        count = struct.unpack_from("<I", head, _NUMREADERS_AT)[0]
        if count > 1 << 16:
            return unknown
        table = os.pread(fd, count * _READER_NBYTES, _READERS_AT)
    except OSError:
        return unknown
    finally:
        os.close(fd)
    if len(table) < count * _READER_NBYTES:
        return unknown
    pids = [struct.unpack_from("<I", table, i * _READER_NBYTES + 8)[0] for i in range(count)]
    pids = [pid for pid in pids if pid and pid != exclude]
    stale = [pid for pid in pids if not _alive(pid)]
    return {"readers": len(pids) - len(stale), "stale": len(stale), "pids": sorted(set(pids))}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def lmdb_meta(path: str) -> dict[str, int] | None:
    """The newer of data.mdb's two meta pages: the writer's map size, last page and txn id."""
    try:
        with open(os.path.join(path, SPILL_DIR, DATA_FILE), "rb") as fh:
            raw = fh.read(2 * 4096)
    except OSError:
        return None
    best = None
    for base in (0, 4096):
        if len(raw) < base + 152 or struct.unpack_from("<I", raw, base + 16)[0] != 0xBEEFC0DE:
            continue
        (map_size,) = struct.unpack_from("<Q", raw, base + 32)
        last_pgno, txnid = struct.unpack_from("<QQ", raw, base + 136)
        if best is None or txnid > best["txnid"]:
            best = {"map_size": map_size, "last_pgno": last_pgno, "txnid": txnid}
    return best
