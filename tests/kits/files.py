"""A store's files from the outside: their names, byte edits, the pool header, the raw spill env.

* names: ``POOL`` (pool.bin), ``SPILL`` (the LMDB directory), ``LOCK``, ``DATA_MDB``, ``LOCK_MDB``.
* ``copy_store``, ``store_bytes``; pokes: ``flip_bit``, ``poke``, ``resize``.
* the pool.bin header (format 1), rebuilt here so that a test can forge a valid checksum:
  ``read_header``, ``write_header``.
* ``spill_env`` / ``spill_dbs``: the LMDB spill environment opened directly (the store must
  be closed in this process).
* ``tmpfs_dir``: a scratch directory on /dev/shm when it is a writable tmpfs (fsync is free
  there), for loops that create hundreds of stores.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import lmdb
import xxhash

POOL, SPILL, LOCK = "pool.bin", "spill", "LOCK"
DATA_MDB, LOCK_MDB = os.path.join(SPILL, "data.mdb"), os.path.join(SPILL, "lock.mdb")
DBS = ("meta", "seqs", "dir", "pages", "tokens")  # the spill environment's named databases


def copy_store(src: str | Path, dst: str | Path) -> Path:
    """Copy a closed store directory (modes kept, symlinks not followed)."""
    shutil.copytree(src, dst, symlinks=True)
    return Path(dst)


def store_bytes(path: str | Path, names: tuple[str, ...] = (POOL, DATA_MDB)) -> dict[str, bytes | None]:
    """The bytes of a store's data files (not LOCK or lock.mdb, which every open rewrites)."""
    out: dict[str, bytes | None] = {}
    for name in names:
        full = os.path.join(path, name)
        out[name] = Path(full).read_bytes() if os.path.isfile(full) else None
    return out


def flip_bit(path: str | Path, offset: int, bit: int) -> None:
    """Flip one bit of a file in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def poke(path: str | Path, offset: int, data: bytes) -> bytes:
    """Overwrite bytes of a file in place; return what was there."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(len(data))
        fh.seek(offset)
        fh.write(data)
    return old


def resize(path: str | Path, size: int) -> None:
    """Truncate or extend (with zeros) a file to ``size`` bytes."""
    os.truncate(path, size)


# -- the pool.bin header (format 1) -----------------------------------------------------------

HEADER_NBYTES = 4096
HEADER = struct.Struct("<8sI16sIIII16sQQ")
HEADER_FIELDS = ("magic", "version", "uuid", "layers", "kv_heads", "head_dim", "page_size", "dtype",
                 "pool_pages", "page_nbytes")


def read_header(path: str | Path) -> dict[str, Any]:
    """The fields of the pool.bin header of the store at ``path``."""
    raw = Path(path, POOL).read_bytes()[:HEADER_NBYTES]
    return dict(zip(HEADER_FIELDS, HEADER.unpack_from(raw, 0)))


def write_header(path: str | Path, fields: dict[str, Any]) -> None:
    """Write the header page with ``fields`` and a correct xxh3-64 checksum."""
    body = HEADER.pack(*(fields[name] for name in HEADER_FIELDS)).ljust(HEADER_NBYTES - 8, b"\x00")
    poke(Path(path, POOL), 0, body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


# -- the raw LMDB spill environment --------------------------------------------------------------


def spill_env(path: str | Path, **kwargs: Any) -> lmdb.Environment:
    """Open a store's spill environment directly (the store must be closed in this process)."""
    options = dict(subdir=True, max_dbs=5, sync=False, metasync=False, create=False, max_readers=126)
    options.update(kwargs)
    return lmdb.open(os.path.join(path, SPILL), **options)


def spill_dbs(env: lmdb.Environment) -> dict[str, Any]:
    """The named databases of a spill environment, by name."""
    return {name: env.open_db(name.encode(), create=False) for name in DBS}


# -- scratch space ----------------------------------------------------------------------------------


def tmpfs_base() -> str | None:
    """/dev/shm when it is a writable tmpfs, else None."""
    base = "/dev/shm"
    try:
        with open("/proc/self/mounts") as fh:
            mounts = {line.split()[1]: line.split()[2] for line in fh if len(line.split()) > 2}
    except OSError:
        return None
    if mounts.get(base) == "tmpfs" and os.access(base, os.W_OK):
        return base
    return None


def tmpfs_dir(prefix: str = "pagedkv-test-") -> Path | None:
    """A fresh directory on tmpfs (the caller removes it), or None where there is none."""
    base = tmpfs_base()
    return None if base is None else Path(tempfile.mkdtemp(prefix=prefix, dir=base))
