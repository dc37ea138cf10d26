"""The spill store: one LMDB environment holding metadata and spilled pages.

Named databases: ``meta`` (superblock, commit state, LRU stamps), ``seqs``
(block tables by sequence id), ``dir`` (page directory by uid), ``pages``
(spilled page records by uid) and ``tokens`` (token ids of pages, by uid). Keys are fixed-width big-endian so that byte
order is numeric order.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import select
import signal
import struct
import threading
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
    """Inverse of ``uid_key``; a key of another length is damage."""
    if len(key) != _UID.size:
        raise StoreCorrupt(f"a page key of {len(key)} bytes is not a uid")
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


_META_MAGIC = 0xBEEFC0DE


def check_data_file(path: str) -> None:
    """Refuse a data.mdb whose size disagrees with its own meta pages, before LMDB maps it.

    LMDB trusts the file: a truncated one is mapped and then faults (SIGBUS) on
    the first access past its end, and an empty one is silently re-initialised.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as data:
            head = data.read(4096)
            psize = struct.unpack_from("<I", head, 40)[0] if len(head) >= 48 else 0
            if psize not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
                raise StoreCorrupt(f"{path}: not an LMDB data file (page size field {psize})")
            data.seek(0)
            metas = data.read(2 * psize)
    except OSError as exc:
        raise StoreCorrupt(f"{path}: cannot be read ({exc.strerror})") from None
    found = []
    for base in (0, psize):
        if len(metas) >= base + 152 and struct.unpack_from("<I", metas, base + 16)[0] == _META_MAGIC:
            last_page, txnid = struct.unpack_from("<QQ", metas, base + 136)
            found.append((txnid, last_page))
    if not found:
        raise StoreCorrupt(f"{path}: no valid LMDB meta page")
    if size < 2 * psize:
        raise StoreCorrupt(f"{path}: file of {size} bytes is shorter than its two meta pages")
    _, last_page = max(found)
    # A torn last page inside the range the meta declares is damage (truncation);
    # a partial page beyond it is what a failed extending write leaves, and whole
    # pages past the end are ones LMDB allocated but never needed to write.
    if size % psize and size < (last_page + 1) * psize:
        raise StoreCorrupt(f"{path}: file is {size} bytes, cut inside page {size // psize}")
    # Pages up to the meta's last page need not all be written yet (LMDB allocates
    # ahead); walk_pages checks that every page the tree reaches lies in the file.


def probe_in_child(path: str, lock: bool = False, timeout: float = 10.0) -> None:
    """Walk the environment at ``path`` in a forked child before this process trusts it.

    LMDB asserts (SIGABRT) or faults (SIGBUS) on some structurally damaged files
    instead of returning an error; a child that dies that way turns into
    ``StoreCorrupt`` here rather than killing the caller.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: walk everything the parent's load will touch, then report
        code = 1
        try:
            # Drop every inherited descriptor: one of them carries the writer's flock,
            # which must die with the parent, not linger in this child.
            os.closerange(3, write_end)
            os.closerange(write_end + 1, os.sysconf("SC_OPEN_MAX"))
            walk_pages(os.path.join(path, "data.mdb"))
            env = lmdb.open(path, readonly=True, lock=lock, subdir=True, max_dbs=len(DB_NAMES))
            with env.begin(buffers=True) as txn:
                for name in DB_NAMES:
                    for _key, value in txn.cursor(db=env.open_db(name, txn=txn, create=False)):
                        if len(value):
                            value[len(value) - 1]  # faults here, in the child, if it lies past the end
            env.close()  # frees its reader slot; os._exit would leave it stale
            os.write(write_end, b"1")
            code = 0
        except lmdb.Error as exc:
            if "already open" in str(exc):  # this process holds it: it was probed at that open
                os.write(write_end, b"1")
                code = 0
        except BaseException:
            pass
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        ok = bool(ready) and os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        if not ok:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    if not ok:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "an error"
        raise StoreCorrupt(f"{path}: the spill store does not read back cleanly (its reader hit {how})")


_P_BRANCH, _P_LEAF, _F_BIGDATA, _F_SUBDATA = 0x01, 0x02, 0x01, 0x02
_P_INVALID = (1 << 64) - 1
_U16x4 = struct.Struct("<HHHH")


_MDB_INTEGERKEY = 0x08


def _check_db_record(raw: mmap.mmap, at: int, flags: int) -> None:
    """An MDB_db record: its flags must be the expected ones and its depth plausible."""
    db_flags, depth = struct.unpack_from("<HH", raw, at + 4)
    if db_flags != flags or depth > 64:
        raise ValueError(f"database record at {at} has flags {db_flags:#x}, depth {depth}")


def walk_pages(path: str) -> None:
    """Check the header of every branch and leaf page reachable from the newest meta page.

    LMDB trusts these headers: a bad key count, node offset or child page number
    makes it assert or fault, on the read path or later on the write path. This
    walk (over tree pages only, never the overflow pages holding page records)
    raises ValueError instead.
    """
    with open(path, "rb") as data:
        raw = mmap.mmap(data.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        psize = struct.unpack_from("<I", raw, 40)[0]
        metas = [struct.unpack_from("<QQ", raw, base + 136)[::-1] + (base,) for base in (0, psize)
                 if struct.unpack_from("<I", raw, base + 16)[0] == _META_MAGIC]
        _, last_page, base = max(metas)  # (txnid, last page, offset) of the newest meta
        last_page = min(last_page, len(raw) // psize - 1)  # reachable pages must exist
        # The free list is keyed by integer txn ids and no database of ours sets flags:
        # other flags would send LMDB down dupsort paths that assert on this data.
        for offset, expected in ((40, _MDB_INTEGERKEY), (88, 0)):
            _check_db_record(raw, base + offset, expected)
        roots = [struct.unpack_from("<Q", raw, base + offset)[0] for offset in (80, 128)]
        stack = [root for root in roots if root != _P_INVALID]
        seen: set[int] = set()
        while stack:
            page = stack.pop()
            if not 2 <= page <= last_page or page in seen:
                raise ValueError(f"page {page} is out of range or reached twice")
            seen.add(page)
            stack += _page_children(raw, page * psize, psize, last_page)
    finally:
        raw.close()


def _page_children(raw: mmap.mmap, start: int, psize: int, last_page: int) -> list[int]:
    flags, lower, upper = struct.unpack_from("<HHH", raw, start + 10)
    kind = flags  # a tree page on disk is exactly a branch or a leaf: no loose/keep/dup bits
    if kind not in (_P_BRANCH, _P_LEAF) or not 16 <= lower <= upper <= psize or lower % 2:
        raise ValueError(f"page at {start} has a bad header")
    children = []
    for index in range((lower - 16) // 2):
        ptr = struct.unpack_from("<H", raw, start + 16 + 2 * index)[0]
        if not upper <= ptr <= psize - 8:
            raise ValueError(f"node pointer {ptr} of page at {start} is out of range")
        lo, hi, node_flags, ksize = _U16x4.unpack_from(raw, start + ptr)
        body = ptr + 8 + ksize
        if body > psize:
            raise ValueError(f"node key of page at {start} runs past the page")
        if kind == _P_BRANCH:
            children.append(lo | hi << 16 | node_flags << 32)
            continue
        size = lo | hi << 16
        if node_flags & _F_BIGDATA:
            first = struct.unpack_from("<Q", raw, start + body)[0] if body + 8 <= psize else _P_INVALID
            if first + (size + 16 + psize - 1) // psize - 1 > last_page:
                raise ValueError(f"overflow data of page at {start} lies past the last page")
        elif node_flags & _F_SUBDATA:
            if body + 48 > psize or size != 48:
                raise ValueError(f"sub-database record of page at {start} is malformed")
            _check_db_record(raw, start + body, 0)
            root = struct.unpack_from("<Q", raw, start + body + 40)[0]
            if root != _P_INVALID:
                children.append(root)
        elif body + size > psize:
            raise ValueError(f"node data of page at {start} runs past the page")
    return children


class _Borrowed:
    """A context manager lending a long-lived transaction without ending it."""

    def __init__(self, txn: lmdb.Transaction) -> None:
        self.txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self.txn

    def __exit__(self, *exc: Any) -> None:
        return None


class SpillStore:
    """A thin, typed wrapper over the LMDB environment of one store."""

    def __init__(self, path: str, *, readonly: bool, create: bool, sync: bool,
                 map_size: int | None = None, register_reader: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._snapshot: lmdb.Transaction | None = None
        self._readers = threading.Condition()  # guards _reading against map growth
        self._reading = 0
        self._writing = threading.Lock()  # one write transaction at a time across threads
        if os.path.islink(path):
            raise PagedKVError(f"{path} is a symbolic link; refused")
        if create:
            make_private_dir(path)
        else:
            check_data_file(os.path.join(path, "data.mdb"))
            probe_in_child(path, lock=readonly and register_reader)
        for name in ("data.mdb", "lock.mdb"):
            if os.path.islink(os.path.join(path, name)):
                raise PagedKVError(f"{os.path.join(path, name)} is a symbolic link; refused")
        # Beside a live writer a reader registers in LMDB's lock table, so the writer
        # never reuses the pages its snapshot sees. Without one it writes nothing.
        locking = not readonly or register_reader
        try:
            self.env = lmdb.open(
                path, map_size=map_size or DEFAULT_MAP_SIZE, subdir=True, readonly=readonly,
                lock=locking, sync=sync, metasync=sync, writemap=False, readahead=False,
                max_dbs=len(DB_NAMES), max_readers=126, mode=0o600, create=create,
                max_spare_txns=0,
            )
        except lmdb.Error as exc:
            raise lmdb_error(exc, f"cannot open spill store {path}") from None
        try:
            if readonly:
                self.dbs = {name: self.env.open_db(name, create=False) for name in DB_NAMES}
                # One snapshot for the handle's life: directory and records always agree.
                self._snapshot = self.env.begin(buffers=True)
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
                with self._writing, self.env.begin(write=True) as txn:
                    result = body(txn)
                    faults.io("commit")
                    faults.crashpoint("lmdb.before_commit")
                return result
            except lmdb.MapFullError:
                with self._writing:
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
            with self._readers:  # no other thread may hold a read txn over the old mapping
                self._readers.wait_for(lambda: not self._reading)
                self.env.set_mapsize(size)
        except lmdb.Error as exc:
            raise lmdb_error(exc, "cannot grow the spill map") from None
        except OSError as exc:
            raise StoreIOError(f"cannot grow the spill map: {exc}") from None

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

    @contextlib.contextmanager
    def background_read(self) -> Iterator[Any]:
        """A read transaction, counted so that map growth waits until none is open.

        Resizing remaps the file under every open transaction of this process, and
        background threads (prefetch, write-behind) read and write beside each other.
        """
        with self._readers:
            self._reading += 1
        try:
            try:
                txn = self.env.begin(buffers=True)
            except lmdb.ReadersFullError:
                self.env.reader_check()  # slots of killed readers
                txn = self.env.begin(buffers=True)
            with txn:
                yield txn
        finally:
            with self._readers:
                self._reading -= 1
                self._readers.notify_all()

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
        with self.begin_read() as txn:
            entries = {name.decode(): txn.stat(db)["entries"] for name, db in self.dbs.items()}
        return {
            "map_size": info["map_size"],
            "map_used": (info["last_pgno"] + 1) * self.env.stat()["psize"],
            "readers": info["num_readers"],
            "last_txnid": info["last_txnid"],
            "entries": entries,
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
