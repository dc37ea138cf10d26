"""The walk over a data.mdb snapshot's trees that refuses what LMDB would trip over.

``walk_pages`` maps the file privately, read-only, and walks the free list, the
main database and each named database depth-first, a chunk of pages of one
level at a time: page headers and nodes (``lmdbformat.PageFile``), key order
and ranges (``lmdbkeys``), and who owns each page (``lmdbfree.PageLedger``).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from .lmdbformat import (
    CURSOR_STACK, DB_RECORD, F_BIGDATA, F_SUBDATA, HDR, MDB_INTEGERKEY, NODE, P_BRANCH, P_INVALID, P_LEAF,
    Damage, PageFile)
from .lmdbfree import PageLedger
from .lmdbkeys import Keys, read_keys


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


def _walk(raw: mmap.mmap, meta: bytes | None) -> str | None:
    # Every array viewing the map lives in this call's frames, so the map can be
    # closed once it returns, whatever was found.
    try:
        _Walker(raw, meta).run()
    except (ValueError, IndexError, OverflowError, struct.error) as exc:
        return str(exc) if isinstance(exc, Damage) else f"unreadable structure ({exc})"
    return None


_FREE, _MAIN, _DATA = "free list", "main database", "database"
# What a leaf node of a tree holds: (txn id, data offset, data size) in the free list, (name,
# MDB_db fields) in the main database; other trees' leaves are checked, not returned.
_Leaf = tuple[Any, ...]


class _Walker:
    """One pass over a snapshot of a mapped data.mdb (see ``walk_pages``)."""

    def __init__(self, raw: mmap.mmap, meta: bytes | None = None) -> None:
        self.file = PageFile(raw, meta)
        self.ledger = PageLedger(self.file.limit, self.file.last_pg)
        self.chunk = max(1, (1 << 20) // self.file.psize)  # tree pages looked at in one vectorised step
        self.last_free_key = 0

    def run(self) -> None:
        """Walk the free list, then the main database and every database it names."""
        free_db, main_db = self.file.db_records()
        # The free list is keyed by integer txn ids and no database of ours sets flags:
        # other flags would send LMDB down dupsort paths that assert on this data.
        self.check_record(free_db, MDB_INTEGERKEY, "the free list's record")
        self.check_record(main_db, 0, "the main database's record")
        records = self.tree(free_db, _FREE, "the free list")
        # Free pages are marked before the other trees are walked, so a page both
        # free and in use is found wherever it is used.
        for key, offset, size in records:
            self.ledger.mark_free(self.file.raw, key, offset, size)
        named = self.tree(main_db, _MAIN, "the main database")
        for name, record in named:
            what = f"database {name!r}"
            self.check_record(record, 0, f"the record of {what}")
            self.tree(record, _DATA, what)

    def check_record(self, record: tuple[int, ...], flags: int, what: str) -> None:
        """A database record (MDB_db) is consistent with itself before its tree is walked."""
        pad, db_flags, depth, _branch, _leaf, _overflow, entries, root = record
        if db_flags != flags:
            raise Damage(f"{what} has flags {db_flags:#x}, not {flags:#x}")
        # The free list's pad is the page size; any other pad is a fixed key size.
        if flags != MDB_INTEGERKEY and pad > self.file.psize - HDR:
            raise Damage(f"{what} has a key size field of {pad}")
        if root == P_INVALID:
            if depth or entries:
                raise Damage(f"{what} is empty but has depth {depth} and {entries} entries")
        elif not 1 <= depth <= CURSOR_STACK or not 2 <= root <= self.file.limit or not entries:
            raise Damage(f"{what} has root {root}, depth {depth}, {entries} entries")

    def tree(self, record: tuple[int, ...], kind: str, what: str) -> list[_Leaf]:
        """Walk one B-tree depth-first in chunks of pages; what its leaves hold, in key order."""
        depth, entries, root = record[2], record[6], record[7]
        if root == P_INVALID:
            return []
        found: list[_Leaf] = []
        seen = 0
        # A level, its pages in key order, and per page the key range [low, high) its
        # parents' separators leave it. LMDB's searches and inserts trust these
        # ranges: a key outside its page's range is never found again.
        stack: list[tuple[int, np.ndarray, Keys, Keys]] = [
            (1, np.array([root], np.int64), Keys.unbounded(), Keys.unbounded())]
        while stack:
            level, pages, lows, highs = stack.pop()
            if len(pages) > self.chunk:
                rest = slice(self.chunk, None)
                stack.append((level, pages[rest], lows[rest], highs[rest]))
                head = slice(None, self.chunk)
                pages, lows, highs = pages[head], lows[head], highs[head]
            self.ledger.claim_pages(pages, what)
            leaf = level == depth
            base, upper, count = self.file.page_headers(pages, P_LEAF if leaf else P_BRANCH, what,
                                                        1 if leaf or kind == _FREE else 2)
            at, ptr, lo, hi, flags, ksize = self.file.nodes(base, upper, count, what)
            first = np.cumsum(count) - count  # each page's first node
            last = first + count - 1
            page = np.repeat(np.arange(len(pages)), count)
            keys = read_keys(self.file, kind == _FREE, at + ptr + NODE, ksize)
            if not leaf:
                # Branch node sizes have no data part; the flags field is the child's high bits.
                self.file.check_tiling(base, upper, count, ptr, NODE + ksize, what)
                starts = np.zeros(len(ptr), bool)
                starts[first] = True
                if kind == _FREE and (~starts & (ksize != 8)).any():
                    raise Damage(f"{what}: a separator key is not a txn id")
                # A search ignores a branch page's first key: its first child keeps the
                # page's own lower bound, and each later child's separator bounds the one before.
                ends = np.zeros(len(ptr), bool)
                ends[last] = True
                following = np.minimum(np.arange(len(ptr)) + 1, len(ptr) - 1)
                child_lows = Keys.choose(starts, lows.take(page), keys)
                child_highs = Keys.choose(ends, highs.take(page), keys.take(following))
                stack.append((level + 1, lo | hi << 16 | flags << 32, child_lows, child_highs))
                continue
            seen += len(ptr)
            same_page = page[:-1] == page[1:]
            bad = same_page & ~keys[:-1].less(keys[1:])
            if bad.any():
                raise Damage(f"{what}: keys out of order in page {pages[page[int(np.flatnonzero(bad)[0])]]}")
            firsts, lasts = keys.take(first), keys.take(last)
            bad = ~lows.none & firsts.less(lows) | ~highs.none & ~lasts.less(highs)
            if bad.any():
                raise Damage(f"{what}: the keys of page {pages[int(np.flatnonzero(bad)[0])]} lie outside "
                             f"the range its parent gives them")
            found += self.leaves(kind, base, upper, count, at, ptr, lo | hi << 16, flags, ksize, what)
        if seen != entries:
            raise Damage(f"{what} holds {seen} entries, its record says {entries}")
        return found

    def leaves(self, kind: str, base: np.ndarray, upper: np.ndarray, count: np.ndarray, at: np.ndarray,
               ptr: np.ndarray, size: np.ndarray, flags: np.ndarray, ksize: np.ndarray,
               what: str) -> list[_Leaf]:
        """Check leaf nodes by kind; the free list's records or the main database's named
        database records (name, MDB_db fields), in key order."""
        psize, raw, u64 = self.file.psize, self.file.raw, self.file.u64
        body = at + ptr + NODE + ksize  # file offset of each node's data
        big = flags == F_BIGDATA
        allowed = (flags == F_SUBDATA) if kind == _MAIN else (flags == 0) | big
        inline = np.where(big, 8, size)
        bad = ~allowed | (ksize == 0) | (ptr + NODE + ksize + inline > psize)
        if kind == _FREE:
            bad |= ksize != 8
        elif kind == _MAIN:
            bad |= size != DB_RECORD.size
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise Damage(f"{what}: leaf node at {ptr[i]} of page {at[i] // psize} has flags "
                         f"{flags[i]:#x}, key size {ksize[i]}, data size {size[i]}")
        self.file.check_tiling(base, upper, count, ptr, NODE + ksize + inline, what)
        data = body.copy()
        if big.any():
            data[big] = self.overflow(u64[body[big]], size[big], what) * psize + HDR
        if kind == _FREE:
            keys = u64[at + ptr + NODE]
            previous = np.concatenate((np.array([self.last_free_key], np.uint64), keys[:-1]))
            bad = (keys <= previous) | (keys > self.file.txnid)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise Damage(f"{what}: key {keys[i]} is out of order or past txn {self.file.txnid}")
            self.last_free_key = int(keys[-1])
            return list(zip(keys.tolist(), data.tolist(), size.tolist()))
        if kind == _MAIN:
            names = [bytes(raw[a + p + NODE:a + p + NODE + k]) for a, p, k in
                     zip(at.tolist(), ptr.tolist(), ksize.tolist())]
            return [(name, DB_RECORD.unpack_from(raw, offset)) for name, offset in
                    zip(names, data.tolist())]
        return []

    def overflow(self, first: np.ndarray, size: np.ndarray, what: str) -> np.ndarray:
        """Check the overflow pages of records (first page numbers, data sizes) and claim them."""
        first, pages = self.file.overflow_runs(first, size, what)
        self.ledger.claim_ranges(first, pages, what)
        return first
