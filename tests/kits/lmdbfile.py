"""data.mdb read from the outside (LMDB 0.9's on-disk layout, data format 1), without pagedkv's checker.

* ``PSIZE`` and the page flags; ``META_END``: where the meta page's fields end.
* ``mdb_pages(data)``: page numbers by kind (meta, branch, leaf, overflow).
* ``Layout(data)``: the newest snapshot's trees, overflow runs and free-list records.
* ``free_records(path)``: how many records the newest free list holds.

The damage tests use these to aim their edits at LMDB's structure.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

PSIZE = 4096
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA = 0x01
P_INVALID = (1 << 64) - 1
META_END = 16 + 136  # page header + MDB_meta


def mdb_pages(data: bytes) -> dict[str, list[int]]:
    """Page numbers of data.mdb by kind (pages whose header names their own number)."""
    kinds: dict[str, list[int]] = {"meta": [0, 1], "branch": [], "leaf": [], "overflow": []}
    for pgno in range(2, len(data) // PSIZE):
        base = pgno * PSIZE
        number, flags = struct.unpack_from("<Q", data, base)[0], struct.unpack_from("<H", data, base + 10)[0]
        if number != pgno:
            continue
        for name, bit in (("branch", P_BRANCH), ("leaf", P_LEAF), ("overflow", P_OVERFLOW)):
            if flags & bit:
                kinds[name].append(pgno)
    return kinds


def free_records(path: Path) -> int:
    """How many records the free list of the newest snapshot holds (its record's entry count)."""
    with open(path, "rb") as fh:
        metas = fh.read(2 * PSIZE)
    txn0, txn1 = (struct.unpack_from("<Q", metas, base + 144)[0] for base in (0, PSIZE))
    meta = PSIZE if txn1 > txn0 else 0
    return struct.unpack_from("<Q", metas, meta + 72)[0]


@dataclass
class FreeRecord:
    """One free-list record: the txn that freed its pages, where it lies, the pages."""

    key: int
    node: int  # file offset of the record's node header
    offset: int  # file offset of its ID list (count, then page numbers)
    ids: list[int]


@dataclass
class Layout:
    """The newest snapshot of a healthy data.mdb, read here without pagedkv's checker."""

    data: bytes
    txnid: int = 0
    last_pgno: int = 0
    roots: dict[str, int] = field(default_factory=dict)
    tree_pages: dict[str, list[int]] = field(default_factory=dict)
    overflow: list[tuple[int, int]] = field(default_factory=list)  # (first page, pages)
    free: list[FreeRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        u64 = lambda at: struct.unpack_from("<Q", self.data, at)[0]  # noqa: E731
        meta = PSIZE if u64(PSIZE + 144) > u64(144) else 0
        self.last_pgno, self.txnid = u64(meta + 136), u64(meta + 144)
        self._tree("free", u64(meta + 80))
        for name, root in self._tree("main", u64(meta + 128)):
            self._tree(name, root)

    def _tree(self, name: str, root: int) -> list[tuple[str, int]]:
        """Record one tree's pages, overflow runs and free records; (name, root) of named databases."""
        self.roots[name] = root
        pages = self.tree_pages.setdefault(name, [])
        found: list[tuple[str, int]] = []
        stack = [root] if root != P_INVALID else []
        while stack:
            pgno = stack.pop()
            pages.append(pgno)
            base = pgno * PSIZE
            flags, lower = struct.unpack_from("<HH", self.data, base + 10)
            for index in range((lower - 16) // 2):
                node = base + struct.unpack_from("<H", self.data, base + 16 + 2 * index)[0]
                lo, hi, node_flags, ksize = struct.unpack_from("<HHHH", self.data, node)
                body = node + 8 + ksize
                if flags & P_BRANCH:
                    stack.append(lo | hi << 16 | node_flags << 32)
                elif name == "main":
                    root_of = struct.unpack_from("<Q", self.data, body + 40)[0]
                    found.append((self.data[node + 8:body].decode(), root_of))
                else:
                    offset = body
                    if node_flags & F_BIGDATA:
                        first = struct.unpack_from("<Q", self.data, body)[0]
                        runs = struct.unpack_from("<I", self.data, first * PSIZE + 12)[0]
                        self.overflow.append((first, runs))
                        offset = first * PSIZE + 16
                    if name == "free":
                        count = struct.unpack_from("<Q", self.data, offset)[0]
                        ids = list(struct.unpack_from(f"<{count}Q", self.data, offset + 8))
                        key = struct.unpack_from("<Q", self.data, node + 8)[0]
                        self.free.append(FreeRecord(key, node, offset, ids))
        return found

    def live_pages(self) -> set[int]:
        """Every tree page of the snapshot."""
        return {pgno for pages in self.tree_pages.values() for pgno in pages}

    def stale_tree_pages(self) -> list[int]:
        """Pages no tree reaches whose header still names them a branch or leaf (old versions)."""
        live = self.live_pages()
        out = []
        for pgno in range(2, len(self.data) // PSIZE):
            number, _pad, flags = struct.unpack_from("<QHH", self.data, pgno * PSIZE)
            if number == pgno and flags in (P_BRANCH, P_LEAF) and pgno not in live:
                out.append(pgno)
        return out
