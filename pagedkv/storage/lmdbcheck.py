"""Checking an LMDB file before this process trusts it.

LMDB trusts its file: a truncated one is mapped and faults past its end, and
damaged page headers or database records make it assert (SIGABRT) or fault
(SIGBUS) instead of returning an error, on the read path or later, inside the
first write transaction. These checks turn such damage into ``StoreCorrupt``:
the size against the meta pages; a walk over the structure of the newest
snapshot (every tree page, every overflow header and the free list) that
refuses what LMDB's write path would trip over, in a forked child before LMDB
maps the file for this process; and a read-back of every database in that
child. Beside a live writer the child first pins a snapshot with a read
transaction and walks that one, so the writer's page reuse never looks like damage.

The on-disk layout read here is LMDB 0.9's on a 64-bit little-endian host: a
16-byte page header (``pgno`` u64, ``pad`` u16, ``flags`` u16, then ``lower``
and ``upper`` u16, or an overflow page's page count u32), 8-byte node headers
(``lo``/``hi`` u16 halves of a data size or child page number, ``flags`` u16
which is also bits 32-47 of a branch child's page number, ``ksize`` u16), and
48-byte database records (``pad`` u32, ``flags`` u16, ``depth`` u16, branch,
leaf and overflow page counts, entries and root, each u64).
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
from typing import Any

import lmdb
import numpy as np
from numpy.typing import NDArray

from ..errors import StoreCorrupt

_META_MAGIC = 0xBEEFC0DE
_META_BYTES = 152  # a meta page's header and MDB_meta, through mm_txnid
_PAGE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


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
            if psize not in _PAGE_SIZES:
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


def probe_in_child(path: str, names: tuple[bytes, ...], lock: bool = False, timeout: float = 10.0) -> None:
    """Walk the environment at ``path`` in a forked child before this process trusts it.

    The child first checks the structure of ``data.mdb`` with ``walk_pages``
    (which the writer's first commit relies on), then reads every database back.
    With ``lock`` (a reader beside a live writer) it registers as a reader and pins
    a snapshot before walking it, so that the writer cannot reuse its pages meanwhile.
    LMDB asserts (SIGABRT) or faults (SIGBUS) on some structurally damaged files
    instead of returning an error; a child that dies that way, or finds damage,
    turns into ``StoreCorrupt`` here rather than killing the caller.
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
            data_path = os.path.join(path, "data.mdb")
            try:
                if lock:
                    # Beside a live writer, pin a snapshot first: while this reader holds
                    # it, the writer reuses none of its pages, so the walk sees it whole.
                    env, txn, meta = _pinned_snapshot(path, data_path, len(names))
                    walk_pages(data_path, meta)
                else:
                    walk_pages(data_path)
                    env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=len(names))
                    txn = env.begin(buffers=True)
            except ValueError as exc:
                # One write below PIPE_BUF arrives whole: the parent reads it at once.
                os.write(write_end, b"0" + str(exc).encode("utf-8", "replace")[:1000])
                raise
            with txn:
                for name in names:
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
    reply = b""
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if ready:
            reply = os.read(read_end, 1024)
        ok = reply == b"1"
    finally:
        os.close(read_end)
        if not ok:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    if reply[:1] == b"0":
        raise StoreCorrupt(f"{path}: data.mdb is damaged ({reply[1:].decode('utf-8', 'replace')})")
    if not ok:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "an error"
        raise StoreCorrupt(f"{path}: the spill store does not read back cleanly (its reader hit {how})")


def _pinned_snapshot(path: str, data_path: str,
                     max_dbs: int) -> tuple[lmdb.Environment, lmdb.Transaction, bytes]:
    """A read transaction and the meta page of the snapshot it holds, read at once.

    The reader keeps the snapshot's tree pages from reuse but not its meta page,
    which the writer's next commit but one overwrites: it is copied here, read
    twice alike so that a copy torn by that write is not taken. ValueError when a
    fast writer won every try.
    """
    env = lmdb.open(path, readonly=True, lock=True, subdir=True, max_dbs=max_dbs)
    with open(data_path, "rb") as data:
        psize = struct.unpack_from("<I", data.read(48), 40)[0]  # LMDB has just accepted it
        for _ in range(5):
            txn = env.begin(buffers=True)
            for base in (0, psize):
                first = os.pread(data.fileno(), _META_BYTES, base)
                if len(first) == _META_BYTES and struct.unpack_from("<Q", first, 144)[0] == txn.id() \
                        and os.pread(data.fileno(), _META_BYTES, base) == first:
                    return env, txn, first
            txn.abort()
    env.close()
    raise ValueError("no copy of a pinned snapshot's meta page could be taken (a writer kept moving)")


def walk_pages(path: str, meta: bytes | None = None) -> None:
    """Check the structure of a snapshot in ``path`` against what LMDB trusts.

    The snapshot is the newest one, or the one whose meta page (its first 152
    bytes) ``meta`` is: a copy taken while a read transaction holds that snapshot,
    so that a live writer reuses none of its pages meanwhile.

    LMDB trusts its pages: a bad key count, node offset or child page number makes
    it assert or fault on the read path, and a free list that names a page still
    in use, or one twice, makes the next write transaction hand that page out
    again and assert (``mdb_page_touch``, ``mdb_freelist_save``) or silently
    overwrite live data. This walk raises ValueError, naming the first damage, if:

    * a tree page (free list, main database, each named database) is out of range,
      past the file's end, reached twice (a cycle, or a page shared by two trees),
      names another page number in its own header, is not a branch above its
      database's depth and a leaf at it, has a malformed node array, or nodes
      that do not fill its node area exactly;
    * keys are out of order within a leaf, or lie outside the range the
      separator keys above their page give it (LMDB would neither find them
      nor insert beside them correctly);
    * a database record (in a meta page or the main database) has unexpected
      flags, a depth or entry count its tree does not have, or a bad root;
    * an overflow record's first page does not name itself, or its page count is
      too small for the data or runs past the file, or overlaps another page;
    * a free-list record is not a txnid key in ``[1, txnid]`` in ascending order
      with an ID list (count, then page numbers strictly descending), or lists a
      meta page, a page past the meta's last page, a page listed elsewhere, or a
      page some tree still uses.

    The file is read through a private read-only map, never through LMDB; memory
    beyond bounded working sets is one byte per page of the file.
    """
    with open(path, "rb") as data:
        raw = mmap.mmap(data.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        problem = _walk(raw, meta)
    finally:
        try:
            raw.close()
        except BufferError:  # only while an unexpected error still holds a view; GC closes it
            pass
    if problem is not None:
        raise ValueError(problem)


class _Damage(ValueError):
    """A structural problem found by the walk."""


def _walk(raw: mmap.mmap, meta: bytes | None) -> str | None:
    # Every array viewing the map lives in this call's frames, so the map can be
    # closed once it returns, whatever was found.
    try:
        _Walker(raw, meta).run()
    except (ValueError, IndexError, OverflowError, struct.error) as exc:
        return str(exc) if isinstance(exc, _Damage) else f"unreadable structure ({exc})"
    return None


_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_P_INVALID = (1 << 64) - 1
_MDB_INTEGERKEY = 0x08
_HDR = 16  # page header bytes
_NODE = 8  # node header bytes
_DB_RECORD = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
_CURSOR_STACK = 32  # deepest tree an LMDB cursor can descend
_FREE, _MAIN, _DATA = "free list", "main database", "database"
# Masks keeping the first n bytes of a big-endian word, for n = 0..8.
_KEEP = np.array([((1 << 64) - 1) ^ ((1 << (64 - 8 * n)) - 1) for n in range(9)], np.uint64)
# What a leaf node of a tree holds: (txn id, data offset, data size) in the free list, (name,
# MDB_db fields) in the main database; other trees' leaves are checked, not returned.
_Leaf = tuple[Any, ...]


class _Keys:
    """Keys as rows of comparable words, their lengths, and which are absent (no bound)."""

    def __init__(self, words: np.ndarray, lengths: np.ndarray, none: np.ndarray) -> None:
        self.words, self.lengths, self.none = words, lengths, none

    @staticmethod
    def unbounded() -> _Keys:
        """The one bound of a root page: none."""
        return _Keys(np.zeros((1, 1), np.uint64), np.zeros(1, np.int64), np.ones(1, bool))

    def __getitem__(self, part: slice) -> _Keys:
        return _Keys(self.words[part], self.lengths[part], self.none[part])

    def take(self, index: np.ndarray) -> _Keys:
        return _Keys(self.words[index], self.lengths[index], self.none[index])

    @staticmethod
    def choose(where: np.ndarray, yes: _Keys, no: _Keys) -> _Keys:
        """Row by row, ``yes`` where ``where`` holds, else ``no``."""
        a, b = _Keys._aligned(yes.words, no.words)
        return _Keys(np.where(where[:, None], a, b), np.where(where, yes.lengths, no.lengths),
                     np.where(where, yes.none, no.none))

    def less(self, other: _Keys) -> NDArray[np.bool_]:
        """Whether each key sorts strictly before the matching key of ``other``."""
        a, b = _Keys._aligned(self.words, other.words)
        if a.shape[1] == 1:
            a, b = a[:, 0], b[:, 0]
            before: NDArray[np.bool_] = (a < b) | (a == b) & (self.lengths < other.lengths)
            return before
        differ = a != b
        at = differ.argmax(axis=1)
        rows = np.arange(len(a))
        return np.where(differ.any(axis=1), a[rows, at] < b[rows, at], self.lengths < other.lengths)

    @staticmethod
    def _aligned(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Both word arrays as wide as the wider, zero words appended (zero bytes, as for a short key)."""
        width = max(a.shape[1], b.shape[1])

        def pad(words: np.ndarray) -> np.ndarray:
            return words if words.shape[1] == width else np.pad(words, ((0, 0), (0, width - words.shape[1])))

        return pad(a), pad(b)


class _Walker:
    """One pass over a snapshot of a mapped data.mdb (see ``walk_pages``)."""

    def __init__(self, raw: mmap.mmap, meta: bytes | None = None) -> None:
        self.raw = raw
        if len(raw) < 2 * 512:
            raise _Damage("file is shorter than two meta pages")
        psize = struct.unpack_from("<I", raw, 40)[0]
        if psize not in _PAGE_SIZES or len(raw) < 2 * psize:
            raise _Damage(f"page size field {psize} does not fit the file")
        self.psize = psize
        # Views whose element i is the 2- or 8-byte field starting at byte i: one
        # gather reads a field at any offset, aligned or not.
        self.u16 = np.ndarray((len(raw) - 1,), "<u2", raw, strides=(1,))
        self.u64 = np.ndarray((len(raw) - 7,), "<u8", raw, strides=(1,))
        self.u64be = np.ndarray((len(raw) - 7,), ">u8", raw, strides=(1,))
        if meta is None:
            metas = [bytes(raw[base:base + _META_BYTES]) for base in (0, psize)]
            valid = [struct.unpack_from("<I", page, 16)[0] == _META_MAGIC for page in metas]
            if not any(valid):
                raise _Damage("no valid meta page")
            txnids = [struct.unpack_from("<Q", page, 144)[0] for page in metas]
            # LMDB's own choice between two: meta 1 only when its txnid is strictly greater.
            newest = (1 if txnids[1] > txnids[0] else 0) if all(valid) else valid.index(True)
            meta = metas[newest]
        elif len(meta) < _META_BYTES or struct.unpack_from("<I", meta, 16)[0] != _META_MAGIC:
            raise _Damage("the pinned snapshot's meta page is not one")
        self.meta = meta
        self.last_pg, self.txnid = struct.unpack_from("<QQ", meta, 136)
        file_pages = len(raw) // psize
        # Trees must lie in the file; free pages may lie past its end (allocated ahead).
        self.limit = min(self.last_pg, file_pages - 1)
        self.owner = np.zeros(self.limit + 1, np.uint8)  # 0 unseen, 1 in use, 2 free
        self.far_free: set[int] = set()
        self.chunk = max(1, (1 << 20) // psize)  # tree pages looked at in one vectorised step
        self.last_free_key = 0

    # -- the whole pass ------------------------------------------------------------------

    def run(self) -> None:
        free_db = _DB_RECORD.unpack_from(self.meta, 40)
        main_db = _DB_RECORD.unpack_from(self.meta, 88)
        # The free list is keyed by integer txn ids and no database of ours sets flags:
        # other flags would send LMDB down dupsort paths that assert on this data.
        self.check_record(free_db, _MDB_INTEGERKEY, "the free list's record")
        self.check_record(main_db, 0, "the main database's record")
        records = self.tree(free_db, _FREE, "the free list")
        # Free pages are marked before the other trees are walked, so a page both
        # free and in use is found wherever it is used.
        for key, offset, size in records:
            self.mark_free(key, offset, size)
        named = self.tree(main_db, _MAIN, "the main database")
        for name, record in named:
            what = f"database {name!r}"
            self.check_record(record, 0, f"the record of {what}")
            self.tree(record, _DATA, what)

    def check_record(self, record: tuple[int, ...], flags: int, what: str) -> None:
        """A database record (MDB_db) is consistent with itself before its tree is walked."""
        pad, db_flags, depth, _branch, _leaf, _overflow, entries, root = record
        if db_flags != flags:
            raise _Damage(f"{what} has flags {db_flags:#x}, not {flags:#x}")
        # The free list's pad is the page size; any other pad is a fixed key size.
        if flags != _MDB_INTEGERKEY and pad > self.psize - _HDR:
            raise _Damage(f"{what} has a key size field of {pad}")
        if root == _P_INVALID:
            if depth or entries:
                raise _Damage(f"{what} is empty but has depth {depth} and {entries} entries")
        elif not 1 <= depth <= _CURSOR_STACK or not 2 <= root <= self.limit or not entries:
            raise _Damage(f"{what} has root {root}, depth {depth}, {entries} entries")

    # -- trees -----------------------------------------------------------------------------

    def tree(self, record: tuple[int, ...], kind: str, what: str) -> list[_Leaf]:
        """Walk one B-tree depth-first in chunks of pages; what its leaves hold, in key order."""
        depth, entries, root = record[2], record[6], record[7]
        if root == _P_INVALID:
            return []
        found: list[_Leaf] = []
        seen = 0
        # A level, its pages in key order, and per page the key range [low, high) its
        # parents' separators leave it. LMDB's searches and inserts trust these
        # ranges: a key outside its page's range is never found again.
        stack: list[tuple[int, np.ndarray, _Keys, _Keys]] = [
            (1, np.array([root], np.int64), _Keys.unbounded(), _Keys.unbounded())]
        while stack:
            level, pages, lows, highs = stack.pop()
            if len(pages) > self.chunk:
                rest = slice(self.chunk, None)
                stack.append((level, pages[rest], lows[rest], highs[rest]))
                head = slice(None, self.chunk)
                pages, lows, highs = pages[head], lows[head], highs[head]
            self.claim_pages(pages, what)
            leaf = level == depth
            base, upper, count = self.page_headers(pages, _P_LEAF if leaf else _P_BRANCH, what,
                                                   1 if leaf or kind == _FREE else 2)
            at, ptr, lo, hi, flags, ksize = self.nodes(base, upper, count, what)
            first = np.cumsum(count) - count  # each page's first node
            last = first + count - 1
            page = np.repeat(np.arange(len(pages)), count)
            keys = self.keys(kind, at + ptr + _NODE, ksize)
            if not leaf:
                # Branch node sizes have no data part; the flags field is the child's high bits.
                self.check_tiling(base, upper, count, ptr, _NODE + ksize, what)
                starts = np.zeros(len(ptr), bool)
                starts[first] = True
                if kind == _FREE and (~starts & (ksize != 8)).any():
                    raise _Damage(f"{what}: a separator key is not a txn id")
                # A search ignores a branch page's first key: its first child keeps the
                # page's own lower bound, and each later child's separator bounds the one before.
                ends = np.zeros(len(ptr), bool)
                ends[last] = True
                following = np.minimum(np.arange(len(ptr)) + 1, len(ptr) - 1)
                child_lows = _Keys.choose(starts, lows.take(page), keys)
                child_highs = _Keys.choose(ends, highs.take(page), keys.take(following))
                stack.append((level + 1, lo | hi << 16 | flags << 32, child_lows, child_highs))
                continue
            seen += len(ptr)
            same_page = page[:-1] == page[1:]
            bad = same_page & ~keys[:-1].less(keys[1:])
            if bad.any():
                raise _Damage(f"{what}: keys out of order in page {pages[page[int(np.flatnonzero(bad)[0])]]}")
            firsts, lasts = keys.take(first), keys.take(last)
            bad = ~lows.none & firsts.less(lows) | ~highs.none & ~lasts.less(highs)
            if bad.any():
                raise _Damage(f"{what}: the keys of page {pages[int(np.flatnonzero(bad)[0])]} lie outside "
                              f"the range its parent gives them")
            found += self.leaves(kind, base, upper, count, at, ptr, lo | hi << 16, flags, ksize, what)
        if seen != entries:
            raise _Damage(f"{what} holds {seen} entries, its record says {entries}")
        return found

    def keys(self, kind: str, offsets: np.ndarray, ksize: np.ndarray) -> _Keys:
        """Keys at file offsets, as rows of words that compare the way LMDB compares keys.

        The free list compares txn ids as native integers; other databases compare
        bytes, then lengths, which big-endian words padded with zeros do too.
        """
        last = len(self.raw) - 8  # the last offset a whole word can be read from
        if kind == _FREE:  # a txn id lies inside its page; only empty keys get near the end
            rows = np.where(ksize == 8, self.u64[np.minimum(offsets, last)], 0)[:, None]
            return _Keys(rows, ksize, np.zeros(len(ksize), bool))
        words = max(1, -(-int(ksize.max()) // 8))
        rows = np.empty((len(offsets), words), np.uint64)
        for word in range(words):
            start = offsets + 8 * word
            # Bytes past the key's end are masked off; a word running past the file's end
            # is read from the last whole word and shifted into place.
            past = np.clip(start - last, 0, 8).astype(np.uint64)
            value = self.u64be[np.minimum(start, last)] << (np.minimum(past, 7) * np.uint64(8))
            rows[:, word] = np.where(past < 8, value, 0) & _KEEP[np.clip(ksize - 8 * word, 0, 8)]
        return _Keys(rows, ksize, np.zeros(len(ksize), bool))

    def claim_pages(self, pages: np.ndarray, what: str) -> None:
        """Mark tree pages in use: each in range and reached once, by one tree, and not free."""
        if pages.min() < 2 or pages.max() > self.limit:
            bad = pages[(pages < 2) | (pages > self.limit)][0]
            raise _Damage(f"{what} reaches page {bad}, outside pages 2..{self.limit}")
        if len(pages) > 1 and len(np.unique(pages)) != len(pages):
            raise _Damage(f"{what} reaches a page twice within one branch level")
        self._claim(pages, what)

    def _claim(self, pages: np.ndarray, what: str) -> None:
        """Mark distinct pages in use, refusing any already in use or on the free list."""
        owner = self.owner[pages]
        if owner.any():
            index = int(np.flatnonzero(owner)[0])
            how = "is on the free list" if owner[index] == 2 else "was reached before"
            raise _Damage(f"page {pages[index]} used by {what} {how}")
        self.owner[pages] = 1

    def page_headers(self, pages: np.ndarray, kind: int, what: str,
                     min_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Byte offsets, upper bounds and key counts of tree pages whose headers hold up."""
        base = pages * self.psize
        pgno = self.u64[base]
        flags, lower, upper = (self.u16[base + at].astype(np.int64) for at in (10, 12, 14))
        count = (lower - _HDR) >> 1
        bad = (pgno != pages.astype(np.uint64)) | (flags != kind) | (lower < _HDR) | (lower > upper) \
            | (upper > self.psize) | (lower & 1 != 0) | (count < min_keys)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            name = "leaf" if kind == _P_LEAF else "branch"
            raise _Damage(f"{what}: page {pages[i]} is not a sound {name} page (header pgno {pgno[i]}, "
                          f"flags {flags[i]:#x}, lower {lower[i]}, upper {upper[i]})")
        return base, upper, count

    def nodes(self, base: np.ndarray, upper: np.ndarray, count: np.ndarray,
              what: str) -> tuple[np.ndarray, ...]:
        """Every node of the pages: its page's offset, its own offset and header fields."""
        total = int(count.sum())
        page = np.repeat(np.arange(len(base)), count)
        slot = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
        at = base[page]
        offsets = at + _HDR + 2 * slot
        ptr = self.u16[offsets].astype(np.int64)
        # Nodes are 2-byte aligned (LMDB asserts it when moving one) and lie in the node area.
        bad = (ptr < upper[page]) | (ptr > self.psize - _NODE) | (ptr & 1 != 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _Damage(f"{what}: node {slot[i]} of page {at[i] // self.psize} is at offset {ptr[i]}")
        head = self.u64[at + ptr]  # lo, hi, flags and key size: four u16 fields
        lo, hi, flags, ksize = ((head >> np.uint64(shift) & np.uint64(0xFFFF)).astype(np.int64)
                                for shift in (0, 16, 32, 48))
        if (ptr + _NODE + ksize > self.psize).any():
            i = int(np.flatnonzero(ptr + _NODE + ksize > self.psize)[0])
            raise _Damage(f"{what}: the key of node {slot[i]} of page {at[i] // self.psize} runs past it")
        return at, ptr, lo, hi, flags, ksize

    def check_tiling(self, base: np.ndarray, upper: np.ndarray, count: np.ndarray, ptr: np.ndarray,
                     sizes: np.ndarray, what: str) -> None:
        """The nodes of each page fill its node area exactly, as LMDB lays them out."""
        used = np.add.reduceat((sizes + 1) & ~1, np.cumsum(count) - count)
        bad = used != self.psize - upper
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _Damage(f"{what}: the nodes of page {base[i] // self.psize} take {used[i]} bytes, "
                          f"its header leaves {self.psize - upper[i]}")

    # -- leaves ----------------------------------------------------------------------------

    def leaves(self, kind: str, base: np.ndarray, upper: np.ndarray, count: np.ndarray, at: np.ndarray,
               ptr: np.ndarray, size: np.ndarray, flags: np.ndarray, ksize: np.ndarray,
               what: str) -> list[_Leaf]:
        """Check leaf nodes by kind; the free list's records or the main database's named
        database records (name, MDB_db fields), in key order."""
        body = at + ptr + _NODE + ksize  # file offset of each node's data
        big = flags == _F_BIGDATA
        allowed = (flags == _F_SUBDATA) if kind == _MAIN else (flags == 0) | big
        inline = np.where(big, 8, size)
        bad = ~allowed | (ksize == 0) | (ptr + _NODE + ksize + inline > self.psize)
        if kind == _FREE:
            bad |= ksize != 8
        elif kind == _MAIN:
            bad |= size != _DB_RECORD.size
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _Damage(f"{what}: leaf node at {ptr[i]} of page {at[i] // self.psize} has flags "
                          f"{flags[i]:#x}, key size {ksize[i]}, data size {size[i]}")
        self.check_tiling(base, upper, count, ptr, _NODE + ksize + inline, what)
        data = body.copy()
        if big.any():
            first = self.u64[body[big]]
            data[big] = self.overflow(first, size[big], what) * self.psize + _HDR
        if kind == _FREE:
            keys = self.u64[at + ptr + _NODE]
            previous = np.concatenate((np.array([self.last_free_key], np.uint64), keys[:-1]))
            bad = (keys <= previous) | (keys > self.txnid)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise _Damage(f"{what}: key {keys[i]} is out of order or past txn {self.txnid}")
            self.last_free_key = int(keys[-1])
            return list(zip(keys.tolist(), data.tolist(), size.tolist()))
        if kind == _MAIN:
            names = [bytes(self.raw[a + p + _NODE:a + p + _NODE + k]) for a, p, k in
                     zip(at.tolist(), ptr.tolist(), ksize.tolist())]
            return [(name, _DB_RECORD.unpack_from(self.raw, offset)) for name, offset in
                    zip(names, data.tolist())]
        return []

    def overflow(self, first: np.ndarray, size: np.ndarray, what: str) -> np.ndarray:
        """Check the overflow pages of records (first page numbers, data sizes) and claim them."""
        out = (first < 2) | (first > self.limit)
        if out.any():
            raise _Damage(f"{what}: overflow page {first[out][0]} is outside pages 2..{self.limit}")
        first = first.astype(np.int64)
        at = first * self.psize
        pgno = self.u64[at]
        flags = self.u16[at + 10].astype(np.int64)
        pages = self.u16[at + 12].astype(np.int64) | self.u16[at + 14].astype(np.int64) << 16
        need = (_HDR - 1 + size) // self.psize + 1
        bad = (pgno != first.astype(np.uint64)) | (flags != _P_OVERFLOW) | (pages < need) \
            | (first + pages - 1 > self.limit)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _Damage(f"{what}: overflow page {first[i]} names page {pgno[i]}, flags {flags[i]:#x}, "
                          f"{pages[i]} pages for {size[i]} bytes (last page {self.limit})")
        self.claim_ranges(first, pages, what)
        return first

    def claim_ranges(self, first: np.ndarray, pages: np.ndarray, what: str) -> None:
        """Mark runs of overflow pages in use; no run may overlap another or any tree page."""
        order = np.argsort(first, kind="stable")
        first, pages = first[order], pages[order]
        if (first[1:] < first[:-1] + pages[:-1]).any():
            raise _Damage(f"{what}: two overflow records share pages")
        budget = 1 << 20  # pages expanded at once
        start = 0
        while start < len(first):
            ends = np.cumsum(pages[start:])
            stop = start + max(1, int(np.searchsorted(ends, budget, side="right")))
            run_first, run_pages = first[start:stop], pages[start:stop]
            total = int(run_pages.sum())
            index = np.arange(total) + np.repeat(run_first - (np.cumsum(run_pages) - run_pages), run_pages)
            self._claim(index, what)
            start = stop

    # -- the free list -----------------------------------------------------------------------

    def mark_free(self, key: int, offset: int, size: int) -> None:
        """One free-list record: an ID list of pages, strictly descending, none listed before."""
        count = struct.unpack_from("<Q", self.raw, offset)[0] if size >= 8 else 0
        # LMDB writes each record at exactly its list's size, and the bundled LMDB
        # refuses any other size when it reads one back.
        if size != 8 * (count + 1):
            raise _Damage(f"free list record of txn {key}: {size} bytes for a list of {count} pages")
        if not count:
            return
        ids = np.frombuffer(self.raw, "<u8", count, offset + 8)
        if count > 1 and not (ids[:-1] > ids[1:]).all():
            raise _Damage(f"free list record of txn {key} is not sorted descending")
        lowest, highest = int(ids[-1]), int(ids[0])
        if lowest < 2 or highest > self.last_pg:
            raise _Damage(f"free list record of txn {key} lists page {lowest if lowest < 2 else highest}, "
                          f"outside pages 2..{self.last_pg}")
        far = int(np.count_nonzero(ids > self.limit))  # the leading ids, past the file's end
        for pgno in ids[:far].tolist():
            if pgno in self.far_free:
                raise _Damage(f"free list lists page {pgno} twice")
            self.far_free.add(pgno)
        near = ids[far:].astype(np.int64)
        owner = self.owner[near]
        if owner.any():
            index = int(np.flatnonzero(owner)[0])
            how = "twice" if owner[index] == 2 else "while a tree uses it"
            raise _Damage(f"free list lists page {near[index]} {how}")
        self.owner[near] = 2
