"""Token ids a page holds that the committed tokens table does not: written since the last
commit, or of a partial page.

A decode step writes one token id into each of hundreds of pages. Kept as one numpy
array per page, every such write allocated a new array; here every page with ids in
memory owns a row of one slab (``page_size`` uint32 ids and a length), so a step writes
all its rows' ids with one indexed assignment. ``PageTokens`` is the only owner of that
memory; the page's ``HAS_TOKENS`` flag (every id of ``[0, fill)`` known, here or in the
tokens table) stays the directory's.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
from numpy.typing import NDArray

TOKEN_DTYPE = np.dtype("<u4")
_MIN_ROWS = 64


class PageTokens:
    """page row -> the token ids held in memory for it (``[0, length)`` of its page)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.slab: NDArray[np.uint32] = np.empty((0, page_size), TOKEN_DTYPE)
        self.lens: NDArray[np.int32] = np.empty(0, np.int32)
        self.row_of: dict[int, int] = {}  # page row (pid) -> slab row
        self.owner: NDArray[np.int32] = np.empty(0, np.int32)  # slab row -> page row (-1: spare)
        self._spare: list[int] = []  # slab rows no page holds

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, pid: int) -> bool:
        return pid in self.row_of

    def pids(self) -> list[int]:
        """Every page row with ids in memory."""
        return list(self.row_of)

    def get(self, pid: int) -> NDArray[np.uint32] | None:
        """The ids held for ``pid`` (a view, valid until the page's ids next change), or None."""
        row = self.row_of.get(pid)
        return None if row is None else self.slab[row, :self.lens[row]]

    def set(self, pid: int, ids: NDArray[np.uint32]) -> None:
        """Hold exactly ``ids`` (at most a page of them) for ``pid``."""
        row = self.row_of.get(pid)
        if row is None:
            row = self._take(pid)
        self.slab[row, :len(ids)] = ids
        self.lens[row] = len(ids)

    def write(self, pid: int, offset: int, ids: NDArray[np.uint32]) -> None:
        """Write ``ids`` at ``offset`` of ``pid``'s held ids (which hold at least ``offset``)."""
        row = self.row_of[pid]
        self.slab[row, offset:offset + len(ids)] = ids
        self.lens[row] = offset + len(ids)

    def rows(self, pids: list[int]) -> NDArray[np.int64]:
        """Slab rows of ``pids`` (-1 for a page with no ids in memory)."""
        return np.fromiter(map(self.row_of.get, pids, repeat(-1, len(pids))), np.int64, len(pids))

    def rows_hinted(self, pids: NDArray[np.int64], hint: NDArray[np.int64] | None) -> NDArray[np.int64]:
        """``rows(pids)``, trusting ``hint`` (earlier answers, -1: unknown) where a row still
        belongs to its page: one comparison instead of a lookup per page."""
        if hint is None or not len(self.owner):
            return self.rows(pids.tolist())
        rows = hint.copy()
        # A shrink renumbers rows and may leave a hint past the slab's end: look those up too.
        inside = (hint >= 0) & (hint < len(self.owner))
        stale = np.flatnonzero(~inside | (self.owner[np.where(inside, hint, 0)] != pids))
        if len(stale):
            rows[stale] = self.rows(pids[stale].tolist())
        return rows

    def write_one_each(self, rows: NDArray[np.int64], offsets: NDArray[np.int64],
                       ids: NDArray[np.uint32]) -> None:
        """Write one id per slab row (``rows`` from ``rows()``, all held, distinct) at ``offsets``."""
        self.slab[rows, offsets] = ids
        self.lens[rows] = offsets + 1

    def start_one_each(self, pids: list[int], ids: NDArray[np.uint32]) -> NDArray[np.int64]:
        """Hold one id, ``ids[i]``, for each of ``pids`` (pages holding no ids in memory); return their rows."""
        rows = np.fromiter(map(self._take, pids), np.int64, len(pids))
        self.slab[rows, 0] = ids
        self.lens[rows] = 1
        return rows

    def cut(self, pid: int, keep: int) -> None:
        """Keep only the first ``keep`` held ids of ``pid`` (it holds at least that many)."""
        self.lens[self.row_of[pid]] = keep

    def drop(self, pid: int) -> None:
        """Forget ``pid``'s ids (nothing if none are held)."""
        row = self.row_of.pop(pid, None)
        if row is not None:
            self.owner[row] = -1
            self._spare.append(row)

    def drop_many(self, pids: list[int]) -> None:
        """``drop`` for each of ``pids``; a slab left mostly empty (a commit after a prefill) shrinks."""
        if self.row_of:
            for pid in pids:
                self.drop(pid)
            if len(self.lens) > _MIN_ROWS and len(self.lens) > 4 * len(self.row_of):
                self._resize(max(_MIN_ROWS, 2 * len(self.row_of)))

    def _grow(self) -> None:
        """Twice the rows; held rows keep their numbers (callers may hold them)."""
        old = len(self.lens)
        size = max(_MIN_ROWS, 2 * old)
        slab = np.empty((size, self.page_size), TOKEN_DTYPE)
        slab[:old] = self.slab
        lens = np.zeros(size, np.int32)
        lens[:old] = self.lens
        owner = np.full(size, -1, np.int32)
        owner[:old] = self.owner
        self.slab, self.lens, self.owner = slab, lens, owner
        self._spare.extend(range(size - 1, old - 1, -1))

    def _resize(self, size: int) -> None:
        """Move the held rows to the front of a slab of ``size`` rows (held rows are renumbered:
        only between operations, never while a caller holds row numbers)."""
        pids, old = list(self.row_of), np.fromiter(self.row_of.values(), np.int64, len(self.row_of))
        slab = np.empty((size, self.page_size), TOKEN_DTYPE)
        slab[:len(old)] = self.slab[old]
        lens = np.zeros(size, np.int32)
        lens[:len(old)] = self.lens[old]
        owner = np.full(size, -1, np.int32)
        owner[:len(old)] = pids
        self.slab, self.lens, self.owner = slab, lens, owner
        self.row_of = dict(zip(pids, range(len(pids))))
        self._spare = list(range(size - 1, len(pids) - 1, -1))

    def _take(self, pid: int) -> int:
        if not self._spare:
            self._grow()
        row = self._spare.pop()
        self.row_of[pid] = row
        self.owner[row] = pid
        return row
