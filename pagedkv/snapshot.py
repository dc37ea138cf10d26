"""Opening a store for inspection without writing a byte, even beside a live writer.

``pagedkv.open(path, readonly=True)`` opens LMDB with ``lock=False``: it never
writes, but it is only safe while nobody changes ``data.mdb``. When a writer
holds the store's lock we therefore copy ``data.mdb`` into a private temporary
directory and open the copy.

A copy is trusted only when no commit landed while it was taken: LMDB is
copy-on-write, but an unregistered reader does not hold back page reuse, so a
commit may overwrite pages of the snapshot being copied even when the file's
size, inode and mtime (coarse, a clock tick) look unchanged. Every commit ends
by rewriting one of the two meta pages with a higher txn id, so the copy's meta
pages are compared with the source's read after the copy ends: equal, and the
snapshot they name was never touched while it was read. Otherwise the copy is
retried (see ``_COPY_TRIES``), and when every copy was torn the open raises
``SnapshotUnavailable`` rather than trusting one.
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
# Torn copies are retried: up to 32 times for a small data.mdb, at least 4 times for any,
# and no more once 256 MiB have been copied in all.
_COPY_TRIES, _MIN_COPY_TRIES, _COPY_BUDGET = 32, 4, 256 << 20
# lock.mdb layout of LMDB 0.9 on 64-bit Linux (MDB_txninfo): magic at 0, the reader
# high-water mark at 56, then 64-byte reader slots from offset 128 (pid at +8).
_LOCK_MAGIC, _NUMREADERS_AT, _READERS_AT, _READER_NBYTES = 0xBEEFC0DE, 56, 128, 64


class SnapshotUnavailable(StoreLocked):
    """A live writer committed during every copy of data.mdb: no consistent snapshot was taken.

    A ``StoreLocked``: the store is busy, not damaged; trying again later may succeed.
    """


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


def _meta_pages(fd: int) -> bytes:
    """The two meta pages at the head of an LMDB data file (its page size read from the first)."""
    head = os.pread(fd, 4096, 0)
    psize = struct.unpack_from("<I", head, 40)[0] if len(head) >= 44 else 0
    if psize not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        return head  # not a data file LMDB wrote; loading the copy says what is wrong
    return os.pread(fd, 2 * psize, 0)


def _copy_once(source: str, target: str) -> bool:
    """Copy ``source`` to ``target``; whether no commit landed from the copy's start to its end.

    The copy reads the meta pages first, so they name the newest snapshot whose
    pages were all written by then. If the source's meta pages read after the
    copy are the same bytes, no commit ended meanwhile, so no page of that
    snapshot was freed and reused while the rest of the file was read: the
    copy holds it whole. (A commit still in flight writes only pages that
    snapshot does not use: LMDB reuses a page only two commits after it was freed.)
    """
    shutil.copyfile(source, target)  # front to back: the meta pages are read first
    with open(source, "rb") as src:
        after = _meta_pages(src.fileno())
    with open(target, "rb") as copied:
        return _meta_pages(copied.fileno()) == after


def _open_copy(path: str, pool: PagePool, tempdir: str, live: bool) -> tuple[KVStore, list[str]]:
    """Copy data.mdb privately until a copy is consistent, then open it.

    A consistent copy that fails to load is real damage and raises; when every
    copy was torn by a commit, ``SnapshotUnavailable``.
    """
    source = os.path.join(path, SPILL_DIR, DATA_FILE)
    target_dir = os.path.join(tempdir, SPILL_DIR)
    os.mkdir(target_dir, 0o700)
    target = os.path.join(target_dir, DATA_FILE)
    tries = copied = 0
    while tries < _COPY_TRIES and (tries < _MIN_COPY_TRIES or copied < _COPY_BUDGET):
        tries += 1
        try:
            consistent = _copy_once(source, target)
            copied += os.path.getsize(target)
        except OSError as exc:
            raise PagedKVError(f"{source}: cannot copy for a live snapshot ({exc.strerror})") from None
        if not consistent:
            continue  # a commit landed mid-copy: pages of the copied snapshot may be overwritten
        store = _make_store(path, pool, _open_spill(target_dir))
        notes = ["the writer is live: metadata is a private snapshot of data.mdb; pool pages "
                 "the writer rewrote after it may fail their checksum (reported unverified)"] if live else []
        return store, notes
    holder = lock_holder(os.path.join(path, LOCK_FILE))
    who = f" (pid {holder})" if holder and holder > 0 else ""
    raise SnapshotUnavailable(
        f"{path}: could not get a consistent snapshot of data.mdb: the writer{who} committed "
        f"during each of {tries} copies; try again when it is less busy")


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
