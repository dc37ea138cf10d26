"""Rows a commit must visit: a compact log of the rows noted since the last commit.

A decode step changes a few hundred pages of a directory that may hold millions,
so a commit that scanned a whole column for what changed would cost time in
proportion to the store rather than to the step. The page table notes each row
it changes here instead (``PageTable.note_changed``, ``note_refs``), and the
commit reads the distinct rows back (``rows``), filtered by the column that
stays the authority (``chg``, or ``ref`` against ``c_ref``).

The log may hold a row more than once, and rows that no longer qualify (a page
freed since, a refcount back at its committed value): readers filter. Without
commits (a volatile store) it would grow without bound, so once it passes a
limit it drops the rows its ``keep`` filter rejects and the duplicates, and the
limit doubles past what is left: amortised O(1) per note.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np
from numpy.typing import NDArray

__all__ = ["PendingRows"]

_MIN_LIMIT = 4096  # rows noted before the first compaction

Rows = NDArray[np.int64]


class PendingRows:
    """Row ids noted since the last ``clear``, in note order, duplicates allowed."""

    __slots__ = ("_log", "_limit", "_keep")

    def __init__(self, keep: Callable[[Rows], Rows]) -> None:
        # A machine-int array: one append per row, 8 bytes each, and a zero-copy numpy view.
        self._log = array("q")
        self._limit = _MIN_LIMIT
        self._keep = keep  # the distinct rows that still qualify, of those given

    def __len__(self) -> int:
        return len(self._log)

    def add(self, pid: int) -> None:
        """Note one row."""
        self._log.append(pid)
        if len(self._log) > self._limit:
            self._compact()

    def add_many(self, pids: NDArray[Any]) -> None:
        """Note each row of ``pids`` (an array of row ids)."""
        self._log.frombytes(np.asarray(pids, np.int64).tobytes())
        if len(self._log) > self._limit:
            self._compact()

    def rows(self) -> Rows:
        """Every distinct row noted since the last ``clear``, ascending (unfiltered)."""
        # Sorting and dropping repeats: np.unique's hash-based path costs twice as much at these sizes.
        ordered: Rows = np.sort(np.frombuffer(self._log, np.int64))
        if len(ordered) < 2:
            return ordered
        keep = np.empty(len(ordered), np.bool_)
        keep[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
        distinct: Rows = ordered[keep]
        return distinct

    def retain(self) -> None:
        """Drop the rows the ``keep`` filter rejects, and the repeats (a log read across commits)."""
        if len(self._log):
            self._compact()

    def clear(self) -> None:
        """Forget every noted row (after a commit has written them)."""
        self._log = array("q")
        self._limit = _MIN_LIMIT

    def _compact(self) -> None:
        kept = self._keep(self.rows())
        self._log = array("q")
        self._log.frombytes(np.asarray(kept, np.int64).tobytes())
        self._limit = max(_MIN_LIMIT, 2 * len(kept))
