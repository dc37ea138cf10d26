"""Opening a store for inspection without writing a byte, even beside a live writer.

``pagedkv.open(path, readonly=True)`` opens LMDB with ``lock=False``: it never
writes, but it is only safe while nobody changes ``data.mdb``. When a writer
holds the store's lock we therefore copy ``data.mdb`` into a private temporary
directory and open the copy; LMDB is copy-on-write, so a copy taken while no
commit lands is a consistent snapshot, and we retry when one did land.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any

from .errors import PagedKVError, StoreCorrupt, StoreLocked
from .lockfile import lock_holder
from .manager import BlockManager
from .pool import PagePool
from .spill import SpillStore
from .opening import assemble
from .store import KVStore, StoreOptions

POOL_FILE, SPILL_DIR, LOCK_FILE, DATA_FILE, LMDB_LOCK = "pool.bin", "spill", "LOCK", "data.mdb", "lock.mdb"
_COPY_TRIES = 5
# lock.mdb layout of LMDB 0.9 on 64-bit Linux (MDB_txninfo): magic at 0, the reader
# high-water mark at 56, then 64-byte reader slots from offset 128 (pid at +8).
_LOCK_MAGIC, _NUMREADERS_AT, _READERS_AT, _READER_NBYTES = 0xBEEFC0DE, 56, 128, 64


@dataclass
class Snapshot:
    """A read-only store handle plus what the inspector learned while opening it."""

    path: str
    store: KVStore
    writer_pid: int | None  # pid of a live writer holding LOCK (-1: held, pid unknown)
    copied: bool  # True when data.mdb was read from a private copy
    notes: list[str] = field(default_factory=list)
    _tempdir: str | None = None

    @property
    def mgr(self) -> BlockManager:
        """The block manager of the read-only store (directory columns)."""
        return self.store._mgr

    def close(self) -> None:
        """Close the store and remove the private copy, if any."""
        try:
            self.store.close()
        finally:
            if self._tempdir:
                shutil.rmtree(self._tempdir, ignore_errors=True)
                self._tempdir = None

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def require_store_dir(path: str) -> None:
    """Raise a one-line ``PagedKVError`` unless ``path`` looks like a pagedkv store directory."""
    if not os.path.lexists(path):
        raise PagedKVError(f"{path}: no such file or directory")
    if os.path.islink(path):
        raise PagedKVError(f"{path} is a symbolic link; refused")
    if not os.path.isdir(path):
        raise PagedKVError(f"{path} is not a directory (a pagedkv store is a directory)")
    try:
        names = set(os.listdir(path))
    except OSError as exc:
        raise PagedKVError(f"{path}: cannot list directory ({exc.strerror})") from None
    if not names:
        raise PagedKVError(f"{path} is an empty directory, not a pagedkv store")
    if POOL_FILE not in names:
        what = "an LMDB environment" if DATA_FILE in names else "a directory"
        raise PagedKVError(f"{path} is {what} but not a pagedkv store (no {POOL_FILE})")
    if SPILL_DIR not in names or not os.path.lexists(os.path.join(path, SPILL_DIR, DATA_FILE)):
        raise StoreCorrupt(f"{path}: {SPILL_DIR}/{DATA_FILE} is missing")
    if os.path.islink(os.path.join(path, SPILL_DIR)):
        raise PagedKVError(f"{os.path.join(path, SPILL_DIR)} is a symbolic link; refused")
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
            raise PagedKVError(f"{full}: {exc.strerror}") from None
        if stat.S_ISLNK(mode):
            raise PagedKVError(f"{full} is a symbolic link; refused")
        if not stat.S_ISREG(mode):
            raise StoreCorrupt(f"{full} is not a regular file")


def open_snapshot(path: str, live: bool = True) -> Snapshot:
    """Open the store at ``path`` read-only; never writes a byte under ``path``.

    Params:
        live: when a writer holds the lock, inspect a private copy of ``data.mdb``
            (True) or raise ``StoreLocked`` (False).
    Raises:
        PagedKVError (and subclasses) for anything that is not a readable store.
    """
    require_store_dir(path)
    holder = lock_holder(os.path.join(path, LOCK_FILE))
    if holder is not None and not live:
        who = f"pid {holder}" if holder > 0 else "another process"
        raise StoreLocked(f"{path} is in use by a writer ({who})")
    pool = PagePool.open(os.path.join(path, POOL_FILE), writable=False)
    tempdir = None
    try:
        store, notes = None, []
        if holder is None:
            try:
                store = _make_store(path, pool, _open_spill(os.path.join(path, SPILL_DIR)))
            except PagedKVError as exc:
                # py-lmdb refuses a second handle on one environment in a process (a
                # read-only store already open here); a private copy sidesteps that.
                if "already open in this process" not in str(exc):
                    raise
        if store is None:
            tempdir = tempfile.mkdtemp(prefix="pagedkv-inspect-")
            store, notes = _open_copy(path, pool, tempdir, live=holder is not None)
    except BaseException:
        pool.close()
        if tempdir:
            shutil.rmtree(tempdir, ignore_errors=True)
        raise
    return Snapshot(path, store, holder, tempdir is not None, notes, tempdir)


def _open_spill(spill_path: str) -> SpillStore:
    # map_size only bounds the address space of a read-only mapping; the file decides.
    # Never registers as an LMDB reader: inspect writes no byte, lock.mdb included.
    return SpillStore(spill_path, readonly=True, create=False, sync=False, register_reader=False)


def _make_store(path: str, pool: PagePool, spill: SpillStore) -> KVStore:
    """A read-only handle over ``pool`` and a given spill environment (closed on failure)."""
    return assemble(path, pool, spill, StoreOptions(readonly=True), None)


def _file_state(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _open_copy(path: str, pool: PagePool, tempdir: str, live: bool) -> tuple[KVStore, list[str]]:
    """Copy data.mdb privately until a copy is both unchanged during the copy and loadable."""
    source = os.path.join(path, SPILL_DIR, DATA_FILE)
    target_dir = os.path.join(tempdir, SPILL_DIR)
    os.mkdir(target_dir, 0o700)
    target = os.path.join(target_dir, DATA_FILE)
    last_error: Exception | None = None
    for attempt in range(_COPY_TRIES):
        try:
            before = _file_state(source)
            shutil.copyfile(source, target)
            stable = _file_state(source) == before
        except OSError as exc:
            raise PagedKVError(f"{source}: cannot copy for a live snapshot ({exc.strerror})") from None
        if not stable and attempt < _COPY_TRIES - 1:
            continue  # a commit landed mid-copy; the copy may be torn
        try:
            store = _make_store(path, pool, _open_spill(target_dir))
        except PagedKVError as exc:
            if stable:
                raise  # an untorn copy that fails to load is real damage
            last_error = exc
            continue
        notes = ["the writer is live: metadata is a private snapshot of data.mdb; pool pages "
                 "the writer rewrote after it may fail their checksum (reported unverified)"] if live else []
        if not stable:
            notes.append("data.mdb kept changing while it was copied; the snapshot loaded cleanly")
        return store, notes
    raise PagedKVError(f"{path}: no consistent snapshot of a busy writer's data.mdb after "
                       f"{_COPY_TRIES} tries ({last_error})")


def lmdb_readers(path: str) -> dict[str, Any]:
    """Reader slots of ``spill/lock.mdb``, read without locking or writing.

    Returns {"readers": live slots, "stale": slots whose pid is gone, "pids": [...]},
    with None values when the lock file is absent or its layout is not recognised.
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
    pids = [pid for pid in pids if pid]
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
