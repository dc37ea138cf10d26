"""``pagedkv.open``: create a store atomically, or reopen one and validate its identity."""

from __future__ import annotations

import os
import shutil
import stat
import time
import uuid as uuidlib
import weakref
from typing import Any

import lmdb

from . import faults
from .storage.codec import FORMAT_VERSION
from .errors import GeometryMismatch, ModelMismatch, PagedKVError, StoreCorrupt, StoreLocked
from .storage.files import (fsync_dir, io_error, list_dir, lookup, make_private_dir, open_dir, open_file,
                            refuse_remote, refuse_untrusted)
from .geometry import Geometry
from .storage.lockfile import WriterLock, _alive, lock_holder
from .pages.persist import read_superblock, rewrite_superblock, write_superblock
from .storage.pool import MAGIC, PagePool
from .storage.spill import SpillStore, remove_compaction_copies
from .storage.codecs import CODECS
from .store import DURABILITY, KVStore, StoreOptions
from .remote import RemoteConfig

POOL_FILE, SPILL_DIR, LOCK_FILE = "pool.bin", "spill", "LOCK"


def is_store(path: str) -> bool:
    """Whether ``path`` looks like a pagedkv store directory (it has a pool file)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, POOL_FILE))


def _require_pool_magic(path: str) -> None:
    """Refuse a directory whose pool.bin is not ours before touching anything in it."""
    pool_path = os.path.join(path, POOL_FILE)
    fd = open_file(pool_path, writable=False)
    try:
        magic = os.pread(fd, len(MAGIC), 0)
    except OSError as exc:
        raise StoreCorrupt(f"{pool_path}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if magic != MAGIC:
        raise StoreCorrupt(f"{pool_path}: not a pagedkv pool file (bad magic); refusing to touch {path}")


# Writers open in this process, by real path: LMDB cannot open one environment twice
# in a process, so a second handle must be refused before it gets that far.
_OPEN_WRITERS: dict[str, "weakref.ref[KVStore]"] = {}


def _writer_here(path: str) -> KVStore | None:
    ref = _OPEN_WRITERS.get(os.path.realpath(path))
    store = ref() if ref is not None else None
    return store if store is not None and not store._closed else None


def open_store(path: str | os.PathLike[str], geometry: Geometry | None = None,
               pool_pages: int | None = None, *, durability: str = "durable",
               readonly: bool = False, evict_batch: int = 64, map_size: int | None = None,
               allow_remote: bool = False, model: str | None = None,
               allow_model_change: bool = False, spill_limit_bytes: int | None = None,
               spill_codec: str = "raw", write_behind: bool | None = None,
               recreate: bool = False, lock_timeout: float | None = None,
               remote: Any = None) -> KVStore:
    """Open the store at ``path``, creating it if the directory is missing or empty.

    Params:
        geometry, pool_pages: required to create; checked against the store when given.
        durability: "durable" (flush + synced commits), "nosync" (survives a process
            crash), or "volatile" (nothing persists: the store is recreated empty, and
            one holding committed data is refused unless ``recreate``).
        recreate: with durability="volatile", allow erasing an existing store that holds
            committed data (geometry and pool size kept unless given).
        readonly: open without the writer lock and without writing a byte.
        evict_batch: pages spilled per LMDB transaction when the pool is full.
        map_size: initial LMDB map size in bytes (it doubles on its own when full).
        allow_remote: permit a network filesystem (unsafe for LMDB; refused by default).
        model: a model fingerprint (e.g. name plus weights hash) recorded at creation and
            mixed into every prefix hash; reopening with another one is ``ModelMismatch``
            unless ``allow_model_change`` (then the store adopts it: old prefixes never match).
        spill_limit_bytes: cap on the bytes of spilled page records; least recently used
            cache-only pages are dropped to stay under it, else ``StoreFull``. A writer
            opening a store that holds more drops its oldest spilled cache-only pages at
            once (committed); if live sequences alone exceed it, a warning is logged and
            the cap applies from the next eviction.
        spill_codec: how pages are encoded when spilled: "raw" (bit-exact), "int8"
            (lossy: within half a quantisation step), or "zstd" (lossless, smaller).
        write_behind: spill in a background thread ahead of need, so appends and steps
            wait for spill I/O only when no slot is free (default: ``PAGEDKV_WRITE_BEHIND=1``).
        lock_timeout: seconds to wait for another writer to release the store's lock
            (polled, 1 ms doubling to 50 ms; ``math.inf`` waits for ever); None or 0
            raises ``StoreLocked`` at once. A read-only open takes no lock.
        remote: a shared remote tier on Redis: a URL (``redis://host:6379/0``,
            ``rediss://``, ``unix:///path``, ``redis+cluster://h1:p1,h2:p2``) or a
            ``pagedkv.RemoteConfig``; needs a model fingerprint and the redis extra.
    Raises:
        StoreLocked (naming the holder's pid; after ``lock_timeout`` seconds if given),
        StoreCorrupt, GeometryMismatch, FormatVersionError, StoreIOError (an unreadable
        directory or file), PagedKVError (a volatile open that would erase data).
    """
    path = os.fspath(path)
    if durability not in DURABILITY:
        raise PagedKVError(f"durability must be one of {DURABILITY}, got {durability!r}")
    if readonly and durability == "volatile":
        raise PagedKVError("a volatile store cannot be opened read-only")
    if recreate and (readonly or durability != "volatile"):
        raise PagedKVError("recreate=True applies to durability='volatile' only (it erases the store)")
    if pool_pages is not None and (isinstance(pool_pages, bool) or not isinstance(pool_pages, int)
                                   or pool_pages < 1):
        raise PagedKVError(f"pool_pages must be a positive int, got {pool_pages!r}")
    if geometry is not None and not isinstance(geometry, Geometry):
        raise PagedKVError("geometry must be a pagedkv.Geometry")
    if model is not None and not isinstance(model, str):
        raise PagedKVError("model must be a str fingerprint")
    if spill_limit_bytes is not None and (not isinstance(spill_limit_bytes, int) or spill_limit_bytes < 1):
        raise PagedKVError("spill_limit_bytes must be a positive int")
    if lock_timeout is not None and (isinstance(lock_timeout, bool)
                                     or not isinstance(lock_timeout, (int, float)) or not lock_timeout >= 0):
        raise PagedKVError(f"lock_timeout must be None or a number of seconds >= 0, got {lock_timeout!r}")
    if spill_codec not in CODECS:
        raise PagedKVError(f"spill_codec must be one of {CODECS}, got {spill_codec!r}")
    if write_behind is None:
        write_behind = os.environ.get("PAGEDKV_WRITE_BEHIND", "") == "1"
    if remote is not None:
        remote = RemoteConfig.of(remote)  # a bad URL is refused before the store is touched
    opts = StoreOptions(geometry, pool_pages, durability, readonly, evict_batch, map_size, model,
                        allow_model_change, spill_limit_bytes, spill_codec, bool(write_behind), remote)
    seen = lookup(path)
    if seen is not None and stat.S_ISLNK(seen.st_mode):
        raise PagedKVError(f"{path} is a symbolic link; refused")
    if seen is not None and not stat.S_ISDIR(seen.st_mode):
        raise PagedKVError(f"{path} exists and is not a directory")
    refuse_remote(path if seen is not None else os.path.dirname(os.path.abspath(path)), allow_remote)
    empty = seen is None or not list_dir(path)
    if not empty:
        os.close(open_dir(path))  # the directory is what is trusted: it must be this user's
    if readonly:
        if empty or not is_store(path):
            raise StoreCorrupt(f"{path} is not a pagedkv store")
        _require_pool_magic(path)
        _require_lock_file(path)
        if _writer_here(path) is not None:
            raise StoreLocked(f"{path} is open for writing in this process (pid {os.getpid()}); "
                              "read through that handle")
        return _open_existing(path, opts, None)
    created = empty and _create(path, opts)
    if not empty and not is_store(path):
        raise PagedKVError(f"{path} exists and is not a pagedkv store; refusing to touch it")
    _require_pool_magic(path)
    wipe = durability == "volatile" and not created
    lock_path = os.path.join(path, LOCK_FILE)
    if wipe and not recreate and lock_holder(lock_path) is None:
        _refuse_erasing(path)  # before the lock, so that a refusal leaves every byte (LOCK too)
    # Without a timeout, the one-argument call that stand-ins for the lock (tests) expect.
    lock = WriterLock(lock_path, lock_timeout) if lock_timeout else WriterLock(lock_path)
    faults.crashpoint("open.after_lock")
    try:
        # A compaction killed before its rename left its copy in spill/: under the lock it is abandoned.
        remove_compaction_copies(os.path.join(path, SPILL_DIR))
        if wipe:
            if not recreate:
                _refuse_erasing(path)  # again: a writer may have committed before we locked
            _recreate(path, opts)
        store = _open_existing(path, opts, lock)
    except BaseException:
        lock.release()
        raise
    _OPEN_WRITERS[os.path.realpath(path)] = weakref.ref(store)
    return store


def _require_lock_file(path: str) -> None:
    """A reader never opens LOCK, but one that is not a plain file of ours means the store is not."""
    lock_path = os.path.join(path, LOCK_FILE)
    seen = lookup(lock_path)
    if seen is not None:
        refuse_untrusted(lock_path, seen, writable=False)


def _refuse_erasing(path: str) -> None:
    """Raise unless erasing the store at ``path`` loses nothing: it holds no commit.

    A store only ever opened volatile has none (volatile commits are no-ops), so
    reopening it volatile goes ahead; a store that cannot be read might hold data.
    """
    hint = "pass recreate=True to replace it, or open it 'durable' or 'nosync'"
    try:
        spill = SpillStore(os.path.join(path, SPILL_DIR), readonly=True, create=False, sync=False)
    except PagedKVError as exc:
        raise PagedKVError(f"{path}: durability='volatile' would erase this store, and whether it holds "
                           f"committed data cannot be told ({exc}); {hint}") from None
    try:
        with spill.begin_read() as txn:
            committed = txn.get(b"state", db=spill.meta) is not None
    except lmdb.Error as exc:
        raise StoreCorrupt(f"{path}: cannot read the commit state ({exc})") from None
    finally:
        spill.close()
    if committed:
        raise PagedKVError(f"{path} holds committed data that durability='volatile' would erase; {hint}")


def _create(path: str, opts: StoreOptions) -> bool:
    """Build the store in a private sibling directory, then rename it into place.

    Returns False when another process created it first (then it is theirs).
    """
    if opts.geometry is None or opts.pool_pages is None:
        raise PagedKVError(f"{path} holds no store; creating one needs geometry and pool_pages")
    parent, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        make_private_dir(parent)
    _remove_abandoned(parent, name)
    temp = os.path.join(parent, f".{name}.creating-{os.getpid()}-{uuidlib.uuid4().hex[:8]}")
    make_private_dir(temp)
    try:
        _populate(temp, opts.geometry, opts.pool_pages, opts)
        try:
            os.rename(temp, path)  # replaces an empty directory, fails on a populated one
        except OSError:
            if not is_store(path):
                raise PagedKVError(f"{path} appeared while the store was being created") from None
            shutil.rmtree(temp, ignore_errors=True)  # another process created it first; open theirs
            return False
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return True


def _remove_abandoned(parent: str, name: str) -> None:
    """Delete half-built stores of creators that died (their pid is in the name)."""
    prefix = f".{name}.creating-"
    try:
        entries = os.listdir(parent)
    except OSError:
        return  # creation itself reports what is wrong with the parent
    for entry in entries:
        pid = entry[len(prefix):].split("-", 1)[0] if entry.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _populate(path: str, geometry: Geometry, pool_pages: int, opts: StoreOptions) -> None:
    store_uuid = uuidlib.uuid4().bytes
    pool = PagePool.create(os.path.join(path, POOL_FILE), geometry, pool_pages, store_uuid)
    pool.close()
    faults.crashpoint("create.after_pool")
    spill = SpillStore(os.path.join(path, SPILL_DIR), readonly=False, create=True, sync=True,
                       map_size=opts.map_size)
    try:
        write_superblock(spill, {
            "format": FORMAT_VERSION, "uuid": store_uuid, "geometry": geometry.to_dict(),
            "pool_pages": pool_pages, "created": time.time(), "salt": os.urandom(16),
            "model": opts.model,
        })
    finally:
        spill.close()
    faults.crashpoint("create.after_superblock")


def _recreate(path: str, opts: StoreOptions) -> None:
    """Volatile mode: replace the store's contents (the caller holds the lock)."""
    geometry, pool_pages = opts.geometry, opts.pool_pages
    if geometry is None or pool_pages is None:
        pool = PagePool.open(os.path.join(path, POOL_FILE), writable=False)
        geometry, pool_pages = geometry or pool.geom, pool_pages or pool.pool_pages
        pool.close()
    # Build the new store beside the old one, so a failure leaves the old one whole.
    staging = os.path.join(path, f".recreate-{uuidlib.uuid4().hex[:8]}")
    make_private_dir(staging)
    try:
        _populate(staging, geometry, pool_pages, opts)
        shutil.rmtree(os.path.join(path, SPILL_DIR), ignore_errors=True)
        try:
            os.rename(os.path.join(staging, SPILL_DIR), os.path.join(path, SPILL_DIR))
            os.replace(os.path.join(staging, POOL_FILE), os.path.join(path, POOL_FILE))
        except OSError as exc:
            raise io_error(exc, f"cannot recreate {path}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _open_existing(path: str, opts: StoreOptions, lock: Any) -> KVStore:
    if not opts.readonly:
        make_private_dir(path)
    pool = PagePool.open(os.path.join(path, POOL_FILE), writable=not opts.readonly)
    try:
        spill = _open_spill(path, opts)
    except BaseException:
        pool.close()
        raise
    try:
        return assemble(path, pool, spill, opts, lock)
    except BaseException:
        pool.close()
        raise


def _open_spill(path: str, opts: StoreOptions) -> SpillStore:
    """The spill store; beside a live writer, checked again when its file looked damaged."""
    lock_path = os.path.join(path, LOCK_FILE)
    for attempt in range(_LIVE_ATTEMPTS):
        live_writer = opts.readonly and lock_holder(lock_path) is not None
        try:
            return SpillStore(os.path.join(path, SPILL_DIR), readonly=opts.readonly, create=False,
                              sync=opts.durability == "durable", map_size=opts.map_size,
                              register_reader=not opts.readonly or live_writer)
        except StoreCorrupt:
            # The checks read data.mdb before LMDB maps it, while the writer's commits
            # reuse free pages: a page rewritten mid-walk looks like damage. Real
            # damage stays on every look; a writer's churn does not.
            if not live_writer or attempt == _LIVE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_LIVE_ATTEMPTS = 5


def assemble(path: str, pool: PagePool, spill: SpillStore, opts: StoreOptions, lock: Any) -> KVStore:
    """Check that pool and spill store belong together and match ``opts``; build the handle.

    On failure the spill store is closed (the pool is the caller's).
    """
    try:
        superblock = read_superblock(spill)
        if superblock["uuid"] != pool.uuid:
            raise StoreCorrupt(f"{path}: pool.bin belongs to another store (uuid differs)")
        if superblock["pool_pages"] != pool.pool_pages:
            raise StoreCorrupt(f"{path}: pool.bin has {pool.pool_pages} slots, the superblock "
                               f"{superblock['pool_pages']}")
        if superblock["geometry"] != pool.geom:
            raise StoreCorrupt(f"{path}: pool.bin geometry differs from the superblock's")
        if opts.geometry is not None:
            pool.geom.require_same(opts.geometry)
        if opts.pool_pages is not None and opts.pool_pages != pool.pool_pages:
            raise GeometryMismatch(f"{path} has {pool.pool_pages} pool pages, asked {opts.pool_pages}")
        if opts.model is not None and opts.model != superblock.get("model"):
            if not opts.allow_model_change or opts.readonly:
                raise ModelMismatch(f"{path} holds KV of model {superblock.get('model')!r}, "
                                    f"not {opts.model!r} (allow_model_change=True to adopt it)")
            superblock["model"] = opts.model
            rewrite_superblock(spill, superblock)
        return KVStore(path, pool, spill, superblock, opts, lock)
    except BaseException:
        spill.close()
        raise
