"""The spill store: one LMDB environment holding metadata and spilled pages.

Named databases: ``meta`` (superblock, commit state, LRU stamps), ``seqs``
(block tables by sequence id), ``dir`` (page directory by uid), ``pages``
(spilled page records by uid) and ``tokens`` (token ids of pages, by uid). Keys are fixed-width big-endian so that byte
order is numeric order.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Any, Callable, Iterator, TypeVar

import lmdb

from . import faults
from .errors import PagedKVError, StoreCorrupt, StoreFull, StoreIOError
from .files import make_private_dir, tighten_tree

T = TypeVar("T")
DB_NAMES = (b"meta", b"seqs", b"dir", b"pages", b"tokens")
_UID = struct.Struct(">Q")
DEFAULT_MAP_SIZE = 1 << 30
_MAX_GROWTHS = 12


def uid_key(uid: int) -> bytes:
    """The LMDB key of a page uid."""
    return _UID.pack(uid)


def key_uid(key: bytes) -> int:
    """Inverse of ``uid_key``."""
    return _UID.unpack(key)[0]


def lmdb_error(exc: lmdb.Error, what: str) -> PagedKVError:
    """Translate an LMDB error into pagedkv's tree."""
    text = str(exc)
    if isinstance(exc, lmdb.MapFullError) or any(
        os.strerror(code) in text for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    ):
        return StoreFull(f"{what}: {text}")
    if isinstance(exc, (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
                        lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadTxnError)):
        return StoreCorrupt(f"{what}: {text}")
    return StoreIOError(f"{what}: {text}")


class SpillStore:
    """A thin, typed wrapper over the LMDB environment of one store."""

    def __init__(self, path: str, *, readonly: bool, create: bool, sync: bool,
                 map_size: int | None = None) -> None:
        self.path = path
        self.readonly = readonly
        if create:
            make_private_dir(path)
        elif not os.path.isfile(os.path.join(path, "data.mdb")):
            raise StoreCorrupt(f"{path}: spill store is missing (no data.mdb)")
        for name in ("data.mdb", "lock.mdb"):
            if os.path.islink(os.path.join(path, name)):
                raise PagedKVError(f"{os.path.join(path, name)} is a symbolic link; refused")
        try:
            self.env = lmdb.open(
                path, map_size=map_size or DEFAULT_MAP_SIZE, subdir=True, readonly=readonly,
                lock=not readonly, sync=sync, metasync=sync, writemap=False, readahead=False,
                max_dbs=len(DB_NAMES), max_readers=126, mode=0o600, create=create,
                max_spare_txns=0,
            )
        except lmdb.Error as exc:
            raise lmdb_error(exc, f"cannot open spill store {path}") from None
        try:
            if readonly:
                self.dbs = {name: self.env.open_db(name, create=False) for name in DB_NAMES}
            else:
                self.dbs = {name: self.env.open_db(name, create=True) for name in DB_NAMES}
                self.stale_readers = self.env.reader_check()
                tighten_tree(path)
        except lmdb.NotFoundError:
            self.env.close()
            raise StoreCorrupt(f"{path}: not a pagedkv spill store (named databases missing)") from None
        except lmdb.Error as exc:
            self.env.close()
            raise lmdb_error(exc, f"cannot open spill store {path}") from None
        self.meta, self.seqs, self.dir, self.pages, self.tokens = (self.dbs[name] for name in DB_NAMES)

    def write(self, body: Callable[[lmdb.Transaction], T], what: str = "commit") -> T:
        """Run ``body`` in one write transaction and commit it; grow the map when full.

        ``body`` may run more than once (after a map growth), so it must only
        issue puts and deletes computed beforehand.
        """
        for _ in range(_MAX_GROWTHS):
            try:
                with self.env.begin(write=True) as txn:
                    result = body(txn)
                    faults.io("commit")
                    faults.crashpoint("lmdb.before_commit")
                return result
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as exc:
                raise lmdb_error(exc, what) from None
            except OSError as exc:  # raised by an injected fault inside the transaction
                raise StoreIOError(f"{what}: {exc}") from None
        raise StoreFull(f"{what}: the spill map could not grow enough")

    def _grow(self) -> None:
        size = self.env.info()["map_size"] * 2
        try:
            faults.io("set_mapsize")
            self.env.set_mapsize(size)
        except lmdb.Error as exc:
            raise lmdb_error(exc, "cannot grow the spill map") from None
        except OSError as exc:
            raise StoreIOError(f"cannot grow the spill map: {exc}") from None

    def put(self, txn: lmdb.Transaction, db: Any, key: bytes, value: bytes | bytearray) -> None:
        """Put one value (an I/O seam for fault tests)."""
        faults.io("put")
        txn.put(key, value, db=db)

    def begin_read(self) -> lmdb.Transaction:
        """A read transaction whose values are zero-copy buffers; use it in a ``with``."""
        return self.env.begin(buffers=True)

    def iterate(self, txn: lmdb.Transaction, db: Any, keys_only: bool = False) -> Iterator[Any]:
        """All (key, value) pairs of ``db`` in key order (or keys only)."""
        cursor = txn.cursor(db=db)
        return cursor.iternext(keys=True, values=not keys_only)

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
        with self.env.begin() as txn:
            entries = {name.decode(): txn.stat(db)["entries"] for name, db in self.dbs.items()}
        return {
            "map_size": info["map_size"],
            "map_used": (info["last_pgno"] + 1) * self.env.stat()["psize"],
            "readers": info["num_readers"],
            "last_txnid": info["last_txnid"],
            "entries": entries,
        }

    def close(self) -> None:
        """Close the environment (idempotent)."""
        if self.env is not None:
            self.env.close()
            self.env = None  # type: ignore[assignment]
