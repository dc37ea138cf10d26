"""LMDB 0.9's data.mdb layout, and a bounds-checked view of one snapshot's pages.

The layout is LMDB 0.9's on a 64-bit little-endian host: a 16-byte page header
(``pgno`` u64, ``pad`` u16, ``flags`` u16, then ``lower`` and ``upper`` u16, or
an overflow page's page count u32), 8-byte node headers (``lo``/``hi`` u16
halves of a data size or child page number, ``flags`` u16 which is also bits
32-47 of a branch child's page number, ``ksize`` u16), and 48-byte database
records (``pad`` u32, ``flags`` u16, ``depth`` u16, branch, leaf and overflow
page counts, entries and root, each u64).

``PageFile`` reads these fields for many pages at once (numpy gathers over the
map) and refuses, as ``Damage``, any header or node that would send LMDB past
its page or its file.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

META_MAGIC = 0xBEEFC0DE
META_BYTES = 152  # a meta page's header and MDB_meta, through mm_txnid
PAGE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# Byte offsets in a meta page: the page size (MDB_meta's free list record's pad), the
# magic, the two database records (free list, main), the last page and the txn id.
META_PSIZE_AT, META_MAGIC_AT, META_FREE_DB_AT, META_MAIN_DB_AT = 40, 16, 40, 88
META_LAST_PAGE_AT, META_TXNID_AT = 136, 144

P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA = 0x01, 0x02
P_INVALID = (1 << 64) - 1
MDB_INTEGERKEY = 0x08
HDR = 16  # page header bytes
NODE = 8  # node header bytes
DB_RECORD = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
CURSOR_STACK = 32  # deepest tree an LMDB cursor can descend


class Damage(ValueError):
    """A structural problem found by the walk."""


class PageFile:
    """A mapped data.mdb, read as the snapshot of one meta page.

    The snapshot is the newest one, or the one whose meta page (its first
    ``META_BYTES`` bytes) ``meta`` is.
    """

    def __init__(self, raw: mmap.mmap, meta: bytes | None = None) -> None:
        self.raw = raw
        if len(raw) < 2 * 512:
            raise Damage("file is shorter than two meta pages")
        psize = struct.unpack_from("<I", raw, META_PSIZE_AT)[0]
        if psize not in PAGE_SIZES or len(raw) < 2 * psize:
            raise Damage(f"page size field {psize} does not fit the file")
        self.psize = psize
        # Views whose element i is the 2- or 8-byte field starting at byte i: one
        # gather reads a field at any offset, aligned or not.
        self.u16 = np.ndarray((len(raw) - 1,), "<u2", raw, strides=(1,))
        self.u64 = np.ndarray((len(raw) - 7,), "<u8", raw, strides=(1,))
        self.u64be = np.ndarray((len(raw) - 7,), ">u8", raw, strides=(1,))
        if meta is None:
            metas = [bytes(raw[base:base + META_BYTES]) for base in (0, psize)]
            valid = [struct.unpack_from("<I", page, META_MAGIC_AT)[0] == META_MAGIC for page in metas]
            if not any(valid):
                raise Damage("no valid meta page")
            txnids = [struct.unpack_from("<Q", page, META_TXNID_AT)[0] for page in metas]
            # LMDB's own choice between two: meta 1 only when its txnid is strictly greater.
            newest = (1 if txnids[1] > txnids[0] else 0) if all(valid) else valid.index(True)
            meta = metas[newest]
        elif len(meta) < META_BYTES or struct.unpack_from("<I", meta, META_MAGIC_AT)[0] != META_MAGIC:
            raise Damage("the pinned snapshot's meta page is not one")
        self.meta = meta
        self.last_pg, self.txnid = struct.unpack_from("<QQ", meta, META_LAST_PAGE_AT)
        file_pages = len(raw) // psize
        # Trees must lie in the file; free pages may lie past its end (allocated ahead).
        self.limit = min(self.last_pg, file_pages - 1)

    def db_records(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The snapshot's database records (MDB_db fields): the free list's and the main database's."""
        return DB_RECORD.unpack_from(self.meta, META_FREE_DB_AT), DB_RECORD.unpack_from(self.meta, META_MAIN_DB_AT)

    def page_headers(self, pages: np.ndarray, kind: int, what: str,
                     min_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Byte offsets, upper bounds and key counts of tree pages whose headers hold up."""
        base = pages * self.psize
        pgno = self.u64[base]
        flags, lower, upper = (self.u16[base + at].astype(np.int64) for at in (10, 12, 14))
        count = (lower - HDR) >> 1
        bad = (pgno != pages.astype(np.uint64)) | (flags != kind) | (lower < HDR) | (lower > upper) \
            | (upper > self.psize) | (lower & 1 != 0) | (count < min_keys)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            name = "leaf" if kind == P_LEAF else "branch"
            raise Damage(f"{what}: page {pages[i]} is not a sound {name} page (header pgno {pgno[i]}, "
                         f"flags {flags[i]:#x}, lower {lower[i]}, upper {upper[i]})")
        return base, upper, count

    def nodes(self, base: np.ndarray, upper: np.ndarray, count: np.ndarray,
              what: str) -> tuple[np.ndarray, ...]:
        """Every node of the pages: its page's offset, its own offset and header fields."""
        total = int(count.sum())
        page = np.repeat(np.arange(len(base)), count)
        slot = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
        at = base[page]
        offsets = at + HDR + 2 * slot
        ptr = self.u16[offsets].astype(np.int64)
        # Nodes are 2-byte aligned (LMDB asserts it when moving one) and lie in the node area.
        bad = (ptr < upper[page]) | (ptr > self.psize - NODE) | (ptr & 1 != 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise Damage(f"{what}: node {slot[i]} of page {at[i] // self.psize} is at offset {ptr[i]}")
        head = self.u64[at + ptr]  # lo, hi, flags and key size: four u16 fields
        lo, hi, flags, ksize = ((head >> np.uint64(shift) & np.uint64(0xFFFF)).astype(np.int64)
                                for shift in (0, 16, 32, 48))
        if (ptr + NODE + ksize > self.psize).any():
            i = int(np.flatnonzero(ptr + NODE + ksize > self.psize)[0])
            raise Damage(f"{what}: the key of node {slot[i]} of page {at[i] // self.psize} runs past it")
        return at, ptr, lo, hi, flags, ksize

    def check_tiling(self, base: np.ndarray, upper: np.ndarray, count: np.ndarray, ptr: np.ndarray,
                     sizes: np.ndarray, what: str) -> None:
        """The nodes of each page fill its node area exactly, as LMDB lays them out."""
        used = np.add.reduceat((sizes + 1) & ~1, np.cumsum(count) - count)
        bad = used != self.psize - upper
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise Damage(f"{what}: the nodes of page {base[i] // self.psize} take {used[i]} bytes, "
                         f"its header leaves {self.psize - upper[i]}")

    def overflow_runs(self, first: np.ndarray, size: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
        """The runs of overflow pages holding records (first page numbers, data sizes): first pages and
        page counts, each run's header sound and long enough for its data."""
        out = (first < 2) | (first > self.limit)
        if out.any():
            raise Damage(f"{what}: overflow page {first[out][0]} is outside pages 2..{self.limit}")
        first = first.astype(np.int64)
        at = first * self.psize
        pgno = self.u64[at]
        flags = self.u16[at + 10].astype(np.int64)
        pages = self.u16[at + 12].astype(np.int64) | self.u16[at + 14].astype(np.int64) << 16
        need = (HDR - 1 + size) // self.psize + 1
        bad = (pgno != first.astype(np.uint64)) | (flags != P_OVERFLOW) | (pages < need) \
            | (first + pages - 1 > self.limit)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise Damage(f"{what}: overflow page {first[i]} names page {pgno[i]}, flags {flags[i]:#x}, "
                         f"{pages[i]} pages for {size[i]} bytes (last page {self.limit})")
        return first, pages
