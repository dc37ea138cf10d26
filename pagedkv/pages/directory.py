"""The page directory: numpy columns over dense, recycled rows, one row per live page.

A row id (``pid``) is reused once its page is gone; a page's public identity is
its ``uid`` (64-bit, never reused). Columns grow in modest steps, a new row is
reset with one assignment per column, and columns only stores that hash pages
need cost nothing until then.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

NOWHERE = -2  # c_where of a page no commit has recorded
SPILLED = -1
REC_NONE, REC_CURRENT, REC_STALE = 0, 1, 2
HASHED, HAS_TOKENS = 1, 2  # page flags: full page with a chained hash; every token id known
CODEC_SHIFT = 4  # directory flags bits 4-5: codec of the page's spill record


class Directory:
    """The directory columns and their row allocation (the block manager builds on it)."""

    _COLUMNS: dict[str, tuple[Any, Any]] = {
        "uid": (np.uint64, 0), "slot": (np.int32, -1), "fill": (np.int32, 0),
        "csum": (np.uint64, 0), "csum_ok": (np.bool_, True),
        "verified": (np.bool_, True), "rec": (np.int8, REC_NONE), "live": (np.bool_, False),
        "corrupt": (np.bool_, False), "c_where": (np.int32, NOWHERE), "c_fill": (np.int32, 0),
        "c_csum": (np.uint64, 0), "flags": (np.uint8, 0), "c_flags": (np.uint8, 0),
        "hash": (np.dtype("V16"), b""), "ref": (np.int32, 0), "c_ref": (np.int32, 0),
        "pstamp": (np.int64, 0), "rec_bytes": (np.int32, 0),
        "chg": (np.bool_, False),  # the next commit rewrites this page's directory entry
        "codec": (np.uint8, 0),  # index into spillcodecs.CODECS of the page's record
        "parent": (np.uint64, 0),  # chain class of the page a hashed page follows (0: first page)
        "chain": (np.uint64, 0),  # chain class of a hashed page: the uid of the first of its equals
        "gen": (np.uint32, 0),  # bumped on every write, so background work can tell
    }

    # Only pages given token ids are hashed; until the first one, these columns are
    # zero-stride views of their default, so a store that never hashes pays nothing.
    _SPARSE = ("hash", "parent", "chain")

    def _init_directory(self, capacity: int, page_size: int) -> None:
        self.next_uid = 1
        self._cap = 0
        self.hashing = False
        if page_size <= np.iinfo(np.uint16).max:  # fills fit in two bytes: two fewer per column
            fill = (np.uint16, 0)
            self._COLUMNS = {**self._COLUMNS, "fill": fill, "c_fill": fill}
        self._grow(capacity)
        # Spare rows as a machine-int array: a list would hold an int object per row.
        self.free_pids = array("q", range(self._cap - 1, -1, -1))

    def _grow(self, capacity: int) -> None:
        old = self._cap
        for name, (dtype, default) in self._COLUMNS.items():
            if name in self._SPARSE and not self.hashing:
                column = np.broadcast_to(np.full(1, default, dtype=dtype), (capacity,))
            else:
                column = np.full(capacity, default, dtype=dtype)
                if old:
                    column[:old] = getattr(self, name)
            setattr(self, name, column)
        self._reset_pairs()
        self._cap = capacity
        if old:
            self.free_pids.extend(range(capacity - 1, old - 1, -1))

    def _reset_pairs(self) -> None:
        # (column, default) pairs, so a new row is reset without a lookup per column.
        self._defaults = [(getattr(self, name), default) for name, (_, default) in self._COLUMNS.items()
                          if self.hashing or name not in self._SPARSE]

    def track_hashes(self) -> None:
        """Give the content-hash columns storage of their own (before the first hashed page)."""
        if self.hashing:
            return
        self.hashing = True
        for name in self._SPARSE:
            dtype, default = self._COLUMNS[name]
            setattr(self, name, np.full(self._cap, default, dtype=dtype))
        self._reset_pairs()

    def _reserve(self, count: int) -> None:
        while len(self.free_pids) < count:
            # Modest steps: metadata RAM is per page, and a copy per step is amortised anyway.
            self._grow(self._cap + max(64, self._cap // 8))

    def _new_pid(self, uid: int) -> int:
        if not self.free_pids:
            self._reserve(1)
        pid = self.free_pids.pop()
        for column, default in self._defaults:
            column[pid] = default
        self.uid[pid] = uid
        self.live[pid] = True
        return pid

    def _new_pids(self, count: int) -> np.ndarray:
        """``count`` reset live rows with fresh uids, in the order ``_new_pid`` would give them."""
        self._reserve(count)
        pids = np.array(self.free_pids[:-count - 1:-1], np.int64)
        del self.free_pids[-count:]
        for column, default in self._defaults:
            column[pids] = default
        self.uid[pids] = np.arange(self.next_uid, self.next_uid + count, dtype=np.uint64)
        self.next_uid += count
        self.live[pids] = True
        return pids

    def _recycle(self, pid: int) -> None:
        self.live[pid] = False
        self.free_pids.append(pid)
