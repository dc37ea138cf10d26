"""Keys of LMDB tree pages as rows of numpy words, compared the way LMDB compares them.

The walk checks many keys at once: that a leaf's keys ascend and lie inside the
range its parents' separators give its page. ``read_keys`` gathers keys from
the map into rows of 64-bit words, ``Keys.less`` compares rows.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .lmdbformat import PageFile

# Masks keeping the first n bytes of a big-endian word, for n = 0..8.
_KEEP = np.array([((1 << 64) - 1) ^ ((1 << (64 - 8 * n)) - 1) for n in range(9)], np.uint64)


class Keys:
    """Keys as rows of comparable words, their lengths, and which are absent (no bound)."""

    def __init__(self, words: np.ndarray, lengths: np.ndarray, none: np.ndarray) -> None:
        self.words, self.lengths, self.none = words, lengths, none

    @staticmethod
    def unbounded() -> Keys:
        """The one bound of a root page: none."""
        return Keys(np.zeros((1, 1), np.uint64), np.zeros(1, np.int64), np.ones(1, bool))

    def __getitem__(self, part: slice) -> Keys:
        return Keys(self.words[part], self.lengths[part], self.none[part])

    def take(self, index: np.ndarray) -> Keys:
        """The keys at ``index``, in its order."""
        return Keys(self.words[index], self.lengths[index], self.none[index])

    @staticmethod
    def choose(where: np.ndarray, yes: Keys, no: Keys) -> Keys:
        """Row by row, ``yes`` where ``where`` holds, else ``no``."""
        a, b = Keys._aligned(yes.words, no.words)
        return Keys(np.where(where[:, None], a, b), np.where(where, yes.lengths, no.lengths),
                    np.where(where, yes.none, no.none))

    def less(self, other: Keys) -> NDArray[np.bool_]:
        """Whether each key sorts strictly before the matching key of ``other``."""
        a, b = Keys._aligned(self.words, other.words)
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


def read_keys(file: PageFile, integer: bool, offsets: np.ndarray, ksize: np.ndarray) -> Keys:
    """Keys at file offsets, as rows of words that compare the way LMDB compares keys.

    The free list (``integer``) compares txn ids as native integers; other databases
    compare bytes, then lengths, which big-endian words padded with zeros do too.
    """
    last = len(file.raw) - 8  # the last offset a whole word can be read from
    if integer:  # a txn id lies inside its page; only empty keys get near the end
        rows = np.where(ksize == 8, file.u64[np.minimum(offsets, last)], 0)[:, None]
        return Keys(rows, ksize, np.zeros(len(ksize), bool))
    words = max(1, -(-int(ksize.max()) // 8))
    rows = np.empty((len(offsets), words), np.uint64)
    for word in range(words):
        start = offsets + 8 * word
        # Bytes past the key's end are masked off; a word running past the file's end
        # is read from the last whole word and shifted into place.
        past = np.clip(start - last, 0, 8).astype(np.uint64)
        value = file.u64be[np.minimum(start, last)] << (np.minimum(past, 7) * np.uint64(8))
        rows[:, word] = np.where(past < 8, value, 0) & _KEEP[np.clip(ksize - 8 * word, 0, 8)]
    return Keys(rows, ksize, np.zeros(len(ksize), bool))
