"""Compaction: rewrite a store's ``spill/data.mdb`` without its free pages.

LMDB never shrinks its file: pages freed by evictions, restores, drops and
``clear_cache`` go on its free list and are reused, but the file keeps the size
of its largest moment. ``compact(path)`` gives that space back:

1. take the writer lock (``StoreLocked`` when a writer holds it) and delete the
   copies an interrupted compaction left;
2. open the store as a writer would, with every check a writer makes (a damaged
   store is refused), and close it, which collects what an interrupted writer
   left and commits;
3. write LMDB's compacting copy (live pages only, renumbered; no free list) of
   that last commit to ``spill/data.mdb.compact-<pid>-<random>``, give it the
   same transaction id as the original (below), sync it, and check it: its
   structure walked as at open, every database's entry count equal to the
   original's;
4. rename it over ``data.mdb`` and sync the directory.

A crash at any point leaves ``data.mdb`` whole, old or new (the copy is synced
before the rename, and a rename is atomic), with the same committed content;
the next writer open, or the next compaction, deletes a leftover copy.

Why the transaction id carries over: a compacting copy starts at transaction 1,
but LMDB's lock file records the last transaction id, and a process that opens
the environment while another still has it open (a reader beside the store)
trusts that record to pick the current meta page. So the copy's two meta pages
are rewritten to name the original's last transaction N (in the slot N & 1, as
LMDB alternates them) and N - 1, both with the copied tree: whichever a process
picks, it reads the compacted commit. Readers that opened the old file keep
their mapping of it (its blocks are freed when the last one closes).
"""

from __future__ import annotations

import errno
import os
import struct
import time
import uuid as uuidlib
from typing import TypedDict

import lmdb

from . import faults, opening
from .errors import StoreCorrupt, StoreFull
from .storage.files import fsync_dir, io_error
from .storage.lmdbcheck import check_data_file
from .storage.lmdbformat import META_MAGIC, META_MAGIC_AT, META_PSIZE_AT, META_TXNID_AT, PAGE_SIZES
from .storage.lmdbwalk import walk_pages
from .storage.lockfile import WriterLock
from .storage.pool import PagePool
from .snapshot import require_store_dir
from .storage.lmdberrors import lmdb_error
from .storage.spill import (COMPACT_PREFIX as TEMP_PREFIX, DB_NAMES, SpillStore, entry_count,
                            remove_compaction_copies)
from .store import StoreOptions

POOL_FILE, SPILL_DIR, LOCK_FILE, DATA_FILE = "pool.bin", "spill", "LOCK", "data.mdb"
# Where a SIGKILL test stops compact (PAGEDKV_CRASHPOINT=name:1), in the order they are passed.
CRASH_POINTS = ("compact.after_lock", "compact.after_settle", "compact.after_copy", "compact.before_rename",
                "compact.after_rename", "compact.after_sync")
_DATA_VERSION = 1  # LMDB 0.9's data format, whose layout storage/lmdbformat.py describes
_SPACE_SLACK = 64 << 20  # free bytes the copy must leave on the filesystem


class CompactResult(TypedDict):
    """What ``compact`` did."""

    path: str
    bytes_before: int  # size of spill/data.mdb before
    bytes_after: int  # and after
    seconds: float
    leftovers_removed: int  # copies an interrupted compaction had left, deleted first


class _HeldLock:
    """Stands in for the writer lock in the handle that settles the store: compact keeps the real one."""

    def release(self) -> None:
        """The handle closes; the lock stays with ``compact``."""


def compact(path: str | os.PathLike[str]) -> CompactResult:
    """Rewrite the store at ``path``'s spill file without its free pages (see the module doc).

    Returns:
        ``{"path", "bytes_before", "bytes_after", "seconds", "leftovers_removed"}``.
    Raises:
        StoreLocked (a writer holds the store), StoreCorrupt (it is damaged: nothing
        is changed), StoreFull (too little free space for the copy), StoreIOError,
        NotAStore (``path`` is not a store directory).
    """
    path = os.fspath(path)
    started = time.monotonic()
    require_store_dir(path)
    opening._require_pool_magic(path)
    spill_dir = os.path.join(path, SPILL_DIR)
    data_path = os.path.join(spill_dir, DATA_FILE)
    lock = WriterLock(os.path.join(path, LOCK_FILE))
    temp = None
    try:
        faults.crashpoint("compact.after_lock")
        leftovers = remove_compaction_copies(os.path.join(path, SPILL_DIR))
        _settle(path)
        faults.crashpoint("compact.after_settle")
        before = _size(data_path)
        temp = os.path.join(spill_dir, f"{TEMP_PREFIX}{os.getpid()}-{uuidlib.uuid4().hex[:8]}")
        entries = _copy(spill_dir, temp)
        faults.crashpoint("compact.after_copy")
        _check_copy(temp, entries)
        faults.crashpoint("compact.before_rename")
        try:
            os.replace(temp, data_path)
        except OSError as exc:
            raise io_error(exc, f"cannot rename the compacted copy over {data_path}") from None
        temp = None
        faults.crashpoint("compact.after_rename")
        fsync_dir(spill_dir)
        faults.crashpoint("compact.after_sync")
        return CompactResult(path=path, bytes_before=before, bytes_after=_size(data_path),
                             seconds=time.monotonic() - started, leftovers_removed=leftovers)
    finally:
        if temp is not None:
            try:
                os.unlink(temp)
            except OSError:
                pass  # the next open or compact removes it
        lock.release()


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise io_error(exc, f"cannot stat {path}") from None


def _settle(path: str) -> None:
    """Open the store as its writer would (every check; damage refused) and close it, committing."""
    pool = PagePool.open(os.path.join(path, POOL_FILE), writable=True)
    try:
        spill = SpillStore(os.path.join(path, SPILL_DIR), readonly=False, create=False, sync=True)
        store = opening.assemble(path, pool, spill, StoreOptions(), _HeldLock())
    except BaseException:
        pool.close()
        raise
    store.close()


def _copy(spill_dir: str, temp: str) -> dict[str, int]:
    """Write the compacting copy of the last commit to ``temp``, synced; the entry count of each database."""
    spill = SpillStore(spill_dir, readonly=True, create=False, sync=False)
    try:
        info = spill.info()
        last_txnid, entries = int(info["last_txnid"]), dict(info["entries"])
        need = info["map_used"] + _SPACE_SLACK
        fs = os.statvfs(spill_dir)
        free = (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize
        if free < need:
            raise StoreFull(f"compacting {spill_dir} needs about {need:,} bytes free for the copy; "
                            f"the filesystem has {free:,}")
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise io_error(exc, f"cannot create {temp}") from None
        try:
            try:
                spill.env.copyfd(fd, compact=True)
            except lmdb.Error as exc:
                raise lmdb_error(exc, f"cannot write the compacted copy {temp}", spill_dir) from None
            _carry_txnid(fd, temp, last_txnid)
            os.fsync(fd)
        except OSError as exc:
            raise io_error(exc, f"cannot write the compacted copy {temp}") from None
        finally:
            os.close(fd)
    finally:
        spill.close()
    return entries


def _carry_txnid(fd: int, temp: str, txnid: int) -> None:
    """Make the copy's meta pages name transaction ``txnid`` (and ``txnid - 1``), as the original's do.

    A compacting copy holds its tree in meta page 1 with transaction id 1 and an
    empty meta page 0 (LMDB 0.9's ``mdb_env_copyfd1``).
    """
    head = os.pread(fd, META_PSIZE_AT + 8, 0)
    psize = struct.unpack_from("<I", head, META_PSIZE_AT)[0] if len(head) >= META_PSIZE_AT + 4 else 0
    if psize not in PAGE_SIZES:
        raise StoreCorrupt(f"{temp}: LMDB's copy has no recognisable meta page")
    meta = bytearray(os.pread(fd, psize, psize))
    magic, version = struct.unpack_from("<II", meta, META_MAGIC_AT)  # the version follows the magic
    if magic != META_MAGIC or version != _DATA_VERSION:
        raise StoreCorrupt(f"{temp}: LMDB's copy is data format {version}, not {_DATA_VERSION} (LMDB 0.9)")
    if struct.unpack_from("<Q", meta, META_TXNID_AT)[0] != 1:
        raise StoreCorrupt(f"{temp}: LMDB's copy does not hold its tree in meta page 1")
    if txnid <= 1:
        return  # the copy's numbering is the original's already
    for slot, number in ((txnid & 1, txnid), (1 - (txnid & 1), txnid - 1)):
        struct.pack_into("<Q", meta, 0, slot)  # the page header's own page number
        struct.pack_into("<Q", meta, META_TXNID_AT, number)
        if os.pwrite(fd, bytes(meta), slot * psize) != psize:
            raise OSError(errno.EIO, "short write of a meta page", temp)


def _check_copy(temp: str, entries: dict[str, int]) -> None:
    """Refuse a copy whose structure does not hold or whose databases differ in size from the original's."""
    check_data_file(temp)
    try:
        walk_pages(temp)
    except ValueError as exc:
        raise StoreCorrupt(f"{temp}: the compacted copy does not check ({exc})") from None
    try:
        env = lmdb.open(temp, subdir=False, readonly=True, lock=False, max_dbs=len(DB_NAMES))
    except lmdb.Error as exc:
        raise StoreCorrupt(f"{temp}: the compacted copy does not open ({exc})") from None
    try:
        with env.begin() as txn:
            got = {name.decode(): entry_count(txn, env.open_db(name, txn=txn, create=False))
                   for name in DB_NAMES}
    except lmdb.Error as exc:
        raise StoreCorrupt(f"{temp}: the compacted copy does not read back ({exc})") from None
    finally:
        env.close()
    if got != entries:
        raise StoreCorrupt(f"{temp}: the compacted copy holds {got} entries, the original {entries}")

