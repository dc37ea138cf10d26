"""Random inputs a randomised test draws once and hands to every store it drives."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from pagedkv.geometry import Geometry


class Draws:
    """K/V blocks, token ids, appends and steps from a test's seeded generators (``rng``, ``np_rng``)."""

    def __init__(self, rng: random.Random, np_rng: np.random.Generator, geom: Geometry, vocab: int) -> None:
        self.rng, self.np_rng, self.geom, self.vocab = rng, np_rng, geom, vocab

    def kv(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` tokens of K (normal) and V (its negation) in the geometry's layout and dtype."""
        shape = (self.geom.layers, n, self.geom.kv_heads, self.geom.head_dim)
        k = self.np_rng.standard_normal(shape).astype(self.geom.np_dtype)
        return k, -k

    def ids(self, n: int) -> list[int]:
        """``n`` token ids below the vocabulary size."""
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def append(self, seqs: list[Any], page_size: int) -> tuple[Any, int, list[int] | None]:
        """A random append: one of ``seqs``, 1 to two pages and a token of new tokens, ids 60% of the time."""
        seq, n = self.rng.choice(seqs), self.rng.randint(1, 2 * page_size + 1)
        return seq, n, self.ids(n) if self.rng.random() < 0.6 else None

    def step(self, seqs: list[Any], page_size: int) -> tuple[dict[Any, int], dict[Any, list[int]] | None, bool]:
        """A random step of 1-4 of ``seqs`` (mostly one token each), its ids 60% of the time, and
        whether the engine fails inside it (15%)."""
        chosen = self.rng.sample(seqs, self.rng.randint(1, min(4, len(seqs))))
        counts = {seq: (1 if self.rng.random() < 0.7 else self.rng.randint(1, page_size + 1)) for seq in chosen}
        tokens = {seq: self.ids(n) for seq, n in counts.items()} if self.rng.random() < 0.6 else None
        return counts, tokens, self.rng.random() < 0.15
