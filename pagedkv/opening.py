"""``pagedkv.open``: create a store atomically, or reopen one and validate its identity."""

from __future__ import annotations

import os
import shutil
import time
import uuid as uuidlib
from typing import Any

from . import faults
from .codec import FORMAT_VERSION
from .errors import GeometryMismatch, PagedKVError, StoreCorrupt
from .files import fsync_dir, make_private_dir, refuse_remote
from .geometry import Geometry
from .lockfile import WriterLock
from .persist import read_superblock, write_superblock
from .pool import PagePool
from .spill import SpillStore
from .store import DURABILITY, KVStore

POOL_FILE, SPILL_DIR, LOCK_FILE = "pool.bin", "spill", "LOCK"


def is_store(path: str) -> bool:
    """Whether ``path`` looks like a pagedkv store directory (it has a pool file)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, POOL_FILE))


def open_store(path: str | os.PathLike[str], geometry: Geometry | None = None,
               pool_pages: int | None = None, *, durability: str = "durable",
               readonly: bool = False, evict_batch: int = 64, map_size: int | None = None,
               allow_remote: bool = False) -> KVStore:
    """Open the store at ``path``, creating it if the directory is missing or empty.

    Params:
        geometry, pool_pages: required to create; checked against the store when given.
        durability: "durable" (flush + synced commits), "nosync" (survives a process
            crash), or "volatile" (nothing persists: an existing store is recreated).
        readonly: open without the writer lock and without writing a byte.
        evict_batch: pages spilled per LMDB transaction when the pool is full.
        map_size: initial LMDB map size in bytes (it doubles on its own when full).
        allow_remote: permit a network filesystem (unsafe for LMDB; refused by default).
    Raises:
        StoreLocked, StoreCorrupt, GeometryMismatch, FormatVersionError, PagedKVError.
    """
    path = os.fspath(path)
    if durability not in DURABILITY:
        raise PagedKVError(f"durability must be one of {DURABILITY}, got {durability!r}")
    if readonly and durability == "volatile":
        raise PagedKVError("a volatile store cannot be opened read-only")
    if pool_pages is not None and (isinstance(pool_pages, bool) or not isinstance(pool_pages, int)
                                   or pool_pages < 1):
        raise PagedKVError(f"pool_pages must be a positive int, got {pool_pages!r}")
    if geometry is not None and not isinstance(geometry, Geometry):
        raise PagedKVError("geometry must be a pagedkv.Geometry")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise PagedKVError(f"{path} exists and is not a directory")
    if os.path.islink(path):
        raise PagedKVError(f"{path} is a symbolic link; refused")
    refuse_remote(os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else path,
                  allow_remote)
    empty = not os.path.isdir(path) or not os.listdir(path)
    if readonly:
        if empty or not is_store(path):
            raise StoreCorrupt(f"{path} is not a pagedkv store")
        return _open_existing(path, geometry, pool_pages, durability, True, evict_batch, map_size, None)
    if empty:
        _create(path, geometry, pool_pages, map_size)
    elif not is_store(path):
        raise PagedKVError(f"{path} exists and is not a pagedkv store; refusing to touch it")
    lock = WriterLock(os.path.join(path, LOCK_FILE))
    faults.crashpoint("open.after_lock")
    try:
        if durability == "volatile":
            geometry, pool_pages = _recreate(path, geometry, pool_pages, map_size)
        return _open_existing(path, geometry, pool_pages, durability, False, evict_batch, map_size, lock)
    except BaseException:
        lock.release()
        raise


def _create(path: str, geometry: Geometry | None, pool_pages: int | None, map_size: int | None) -> None:
    """Build the store in a private sibling directory, then rename it into place."""
    if geometry is None or pool_pages is None:
        raise PagedKVError(f"{path} holds no store; creating one needs geometry and pool_pages")
    parent, name = os.path.split(os.path.abspath(path))
    make_private_dir(parent) if not os.path.isdir(parent) else None
    temp = os.path.join(parent, f".{name}.creating-{os.getpid()}-{uuidlib.uuid4().hex[:8]}")
    make_private_dir(temp)
    try:
        _populate(temp, geometry, pool_pages, map_size)
        try:
            os.rename(temp, path)  # replaces an empty directory, fails on a populated one
        except OSError:
            if not is_store(path):
                raise PagedKVError(f"{path} appeared while the store was being created") from None
            shutil.rmtree(temp)  # another process created it first; open theirs
            return
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _populate(path: str, geometry: Geometry, pool_pages: int, map_size: int | None) -> None:
    store_uuid = uuidlib.uuid4().bytes
    pool = PagePool.create(os.path.join(path, POOL_FILE), geometry, pool_pages, store_uuid)
    pool.close()
    faults.crashpoint("create.after_pool")
    spill = SpillStore(os.path.join(path, SPILL_DIR), readonly=False, create=True, sync=True,
                       map_size=map_size)
    try:
        write_superblock(spill, {
            "format": FORMAT_VERSION, "uuid": store_uuid, "geometry": geometry.to_dict(),
            "pool_pages": pool_pages, "created": time.time(),
        })
    finally:
        spill.close()
    faults.crashpoint("create.after_superblock")


def _recreate(path: str, geometry: Geometry | None, pool_pages: int | None,
              map_size: int | None) -> tuple[Geometry, int]:
    """Volatile mode: replace the store's contents (the caller holds the lock)."""
    if geometry is None or pool_pages is None:
        pool = PagePool.open(os.path.join(path, POOL_FILE), writable=False)
        geometry, pool_pages = geometry or pool.geom, pool_pages or pool.pool_pages
        pool.close()
    os.unlink(os.path.join(path, POOL_FILE))
    shutil.rmtree(os.path.join(path, SPILL_DIR), ignore_errors=True)
    _populate(path, geometry, pool_pages, map_size)
    return geometry, pool_pages


def _open_existing(path: str, geometry: Geometry | None, pool_pages: int | None, durability: str,
                   readonly: bool, evict_batch: int, map_size: int | None, lock: Any) -> KVStore:
    if not readonly:
        make_private_dir(path)
    pool = PagePool.open(os.path.join(path, POOL_FILE), writable=not readonly)
    try:
        spill = SpillStore(os.path.join(path, SPILL_DIR), readonly=readonly, create=False,
                           sync=durability == "durable", map_size=map_size)
    except BaseException:
        pool.close()
        raise
    try:
        superblock = read_superblock(spill)
        if superblock["uuid"] != pool.uuid:
            raise StoreCorrupt(f"{path}: pool.bin belongs to another store (uuid differs)")
        if superblock["pool_pages"] != pool.pool_pages:
            raise StoreCorrupt(f"{path}: pool.bin has {pool.pool_pages} slots, the superblock "
                               f"{superblock['pool_pages']}")
        if superblock["geometry"] != pool.geom:
            raise StoreCorrupt(f"{path}: pool.bin geometry differs from the superblock's")
        if geometry is not None:
            pool.geom.require_same(geometry)
        if pool_pages is not None and pool_pages != pool.pool_pages:
            raise GeometryMismatch(f"{path} has {pool.pool_pages} pool pages, asked {pool_pages}")
        return KVStore(path, pool, spill, superblock, durability, readonly, evict_batch, lock)
    except BaseException:
        spill.close()
        pool.close()
        raise
