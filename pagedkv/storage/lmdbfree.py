"""Which pages of a data.mdb snapshot are in use and which are free, each claimed once.

LMDB trusts its free list: one that names a page still in use, or one twice,
makes the next write transaction hand that page out again and assert
(``mdb_page_touch``, ``mdb_freelist_save``) or silently overwrite live data.
``PageLedger`` records, per page, whether a tree or the free list has claimed
it, and refuses a second claim of either kind.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

from .lmdbformat import Damage

_UNSEEN, _IN_USE, _FREE = 0, 1, 2


class PageLedger:
    """The owner of every page up to ``limit`` (the last one a tree may use), and the free
    pages listed past it, up to the meta's ``last_pg`` (allocated ahead, never written)."""

    def __init__(self, limit: int, last_pg: int) -> None:
        self.limit, self.last_pg = limit, last_pg
        self.owner = np.zeros(limit + 1, np.uint8)  # _UNSEEN, _IN_USE or _FREE
        self.far_free: set[int] = set()

    def claim_pages(self, pages: np.ndarray, what: str) -> None:
        """Mark tree pages in use: each in range and reached once, by one tree, and not free."""
        if pages.min() < 2 or pages.max() > self.limit:
            bad = pages[(pages < 2) | (pages > self.limit)][0]
            raise Damage(f"{what} reaches page {bad}, outside pages 2..{self.limit}")
        if len(pages) > 1 and len(np.unique(pages)) != len(pages):
            raise Damage(f"{what} reaches a page twice within one branch level")
        self._claim(pages, what)

    def claim_ranges(self, first: np.ndarray, pages: np.ndarray, what: str) -> None:
        """Mark runs of overflow pages in use; no run may overlap another or any tree page."""
        order = np.argsort(first, kind="stable")
        first, pages = first[order], pages[order]
        if (first[1:] < first[:-1] + pages[:-1]).any():
            raise Damage(f"{what}: two overflow records share pages")
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

    def _claim(self, pages: np.ndarray, what: str) -> None:
        """Mark distinct pages in use, refusing any already in use or on the free list."""
        owner = self.owner[pages]
        if owner.any():
            index = int(np.flatnonzero(owner)[0])
            how = "is on the free list" if owner[index] == _FREE else "was reached before"
            raise Damage(f"page {pages[index]} used by {what} {how}")
        self.owner[pages] = _IN_USE

    def mark_free(self, raw: mmap.mmap, key: int, offset: int, size: int) -> None:
        """One free-list record (of txn ``key``, ``size`` bytes at ``offset`` in ``raw``): an ID
        list of pages, strictly descending, none listed before."""
        count = struct.unpack_from("<Q", raw, offset)[0] if size >= 8 else 0
        # LMDB writes each record at exactly its list's size, and the bundled LMDB
        # refuses any other size when it reads one back.
        if size != 8 * (count + 1):
            raise Damage(f"free list record of txn {key}: {size} bytes for a list of {count} pages")
        if not count:
            return
        ids = np.frombuffer(raw, "<u8", count, offset + 8)
        if count > 1 and not (ids[:-1] > ids[1:]).all():
            raise Damage(f"free list record of txn {key} is not sorted descending")
        lowest, highest = int(ids[-1]), int(ids[0])
        if lowest < 2 or highest > self.last_pg:
            raise Damage(f"free list record of txn {key} lists page {lowest if lowest < 2 else highest}, "
                         f"outside pages 2..{self.last_pg}")
        far = int(np.count_nonzero(ids > self.limit))  # the leading ids, past the file's end
        for pgno in ids[:far].tolist():
            if pgno in self.far_free:
                raise Damage(f"free list lists page {pgno} twice")
            self.far_free.add(pgno)
        near = ids[far:].astype(np.int64)
        owner = self.owner[near]
        if owner.any():
            index = int(np.flatnonzero(owner)[0])
            how = "twice" if owner[index] == _FREE else "while a tree uses it"
            raise Damage(f"free list lists page {near[index]} {how}")
        self.owner[near] = _FREE
