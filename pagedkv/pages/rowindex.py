"""A compact hash table of directory rows keyed by the 16-byte digests those rows hold.

The prefix index maps a page's chained hash to its directory rows: several pages
may hold one digest (the same prompt prefilled twice), and each is kept. A dict would
keep a 16-byte key object and an int per page (about 120 bytes with the table);
the digest is already in the directory's ``hash`` column, so this table keeps
only the row: an int32 per slot, open addressing with linear probing, at most
70% full. The caller passes the current ``hash`` column to every call that
compares keys (the column is replaced when the directory grows).
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = -1, -2  # a never-used slot; a slot whose row was removed (probing goes on)
_MIN_SLOTS = 1024


def _homes(digests: np.ndarray, mask: int) -> np.ndarray:
    """Home slots of 16-byte digests (a V16 array): their first 8 bytes, little-endian."""
    return (np.ascontiguousarray(digests).view("<u8")[::2] & np.uint64(mask)).astype(np.int64)


def _ints(slots: np.ndarray) -> memoryview:
    """A memoryview of an int32 table: its items read and written as Python ints."""
    return memoryview(slots.data)


class RowIndex:
    """digest -> rows whose digest is ``hashes[row]``; a digest may have several rows."""

    def __init__(self) -> None:
        self.slots = np.full(_MIN_SLOTS, EMPTY, np.int32)
        self._view = _ints(self.slots)  # the same memory, read and written as Python ints
        self.count = 0  # rows held
        self.used = 0  # slots not EMPTY (rows and GONE marks): what bounds probe lengths

    def __len__(self) -> int:
        return self.count

    def _probe(self, digest: bytes) -> tuple[memoryview, int, int]:
        """The table as Python ints, its mask and ``digest``'s home slot.

        Probing reads a few slots per call: through a memoryview each read is a
        Python int, where a numpy scalar read and its conversion cost several times
        as much.
        """
        mask = len(self.slots) - 1
        return self._view, mask, int.from_bytes(digest[:8], "little") & mask

    def get(self, digest: bytes, hashes: np.ndarray) -> list[int]:
        """Every row held for ``digest``, in probe order (the first added first, unless rebuilt)."""
        view, mask, at = self._probe(digest)
        found: list[int] = []
        while True:
            row = view[at]
            if row == EMPTY:
                return found
            if row >= 0 and hashes[row].tobytes() == digest:
                found.append(row)
            at = (at + 1) & mask

    def _find(self, digest: bytes, row: int) -> int:
        """The slot holding ``row`` on ``digest``'s probe path, or -1."""
        view, mask, at = self._probe(digest)
        while True:
            found = view[at]
            if found == row:
                return at
            if found == EMPTY:
                return -1
            at = (at + 1) & mask

    def holds(self, digest: bytes, row: int) -> bool:
        """Whether ``row`` is held under ``digest`` (its own digest)."""
        return self._find(digest, row) >= 0

    def add(self, digest: bytes, row: int, hashes: np.ndarray) -> bool:
        """Hold ``row`` (whose digest is ``hashes[row]`` == ``digest``) unless it is held already."""
        return self._insert(digest, row, hashes, None)

    def insert(self, digest: bytes, row: int, hashes: np.ndarray) -> list[int]:
        """``add``, in the same probe returning the other rows held for ``digest`` (probe order)."""
        equal: list[int] = []
        self._insert(digest, row, hashes, equal)
        return equal

    def _insert(self, digest: bytes, row: int, hashes: np.ndarray, equal: list[int] | None) -> bool:
        """Hold ``row`` unless held; collect into ``equal`` the other rows held for ``digest``."""
        view, mask, at = self._probe(digest)
        reuse, held = -1, False
        while True:
            found = view[at]
            if found == EMPTY:
                break
            if found == GONE:
                if reuse < 0:
                    reuse = at
            elif found == row:
                held = True
                if equal is None:
                    return False
            elif equal is not None and hashes[found].tobytes() == digest:
                equal.append(found)
            at = (at + 1) & mask
        if held:
            return False
        if reuse < 0:  # the path's empty end
            reuse = at
            self.used += 1
        view[reuse] = row
        self.count += 1
        if 10 * self.used > 7 * len(self.slots):
            self._rebuild(hashes)
        return True

    def discard(self, digest: bytes, row: int) -> None:
        """Stop holding ``row`` under ``digest`` (nothing if it is not held)."""
        at = self._find(digest, row)
        if at >= 0:
            self._view[at] = GONE
            self.count -= 1

    def rows(self) -> np.ndarray:
        """Every row held, in slot order."""
        return self.slots[self.slots >= 0].astype(np.int64)

    def add_many(self, rows: np.ndarray, hashes: np.ndarray) -> None:
        """``add`` for many rows at once (a reopen's rebuild); rows held already are skipped."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        held = self.rows()
        fresh = rows[~np.isin(rows, held)]
        _, first = np.unique(fresh, return_index=True)
        self._rebuild(hashes, np.concatenate([held, fresh[np.sort(first)]]))

    def _rebuild(self, hashes: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Lay ``rows`` (default: those held) out afresh in a table at most half full.

        The next rebuild comes at 70% use, so at least a fifth of the table's size
        in adds lies between two rebuilds: each costs O(1) per add, amortised.
        """
        rows = self.rows() if rows is None else rows
        size = _MIN_SLOTS
        while size < 2 * len(rows):
            size *= 2
        slots = np.full(size, EMPTY, np.int32)
        at = _homes(hashes[rows], size - 1)
        pending = np.arange(len(rows))
        while len(pending):  # one probe step for every row not placed yet
            want = at[pending]
            free = slots[want] == EMPTY
            taken, first = np.unique(want[free], return_index=True)
            winners = pending[free][first]
            slots[taken] = rows[winners]
            placed = np.zeros(len(rows), bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            at[pending] = (at[pending] + 1) & (size - 1)
        self.slots, self.count, self.used = slots, len(rows), len(rows)
        self._view = _ints(slots)
