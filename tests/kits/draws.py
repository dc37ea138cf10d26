"""Random inputs a randomised test draws once and hands to every store it drives."""

from __future__ import annotations

import random

import numpy as np

from pagedkv.geometry import Geometry


class Draws:
    """K/V blocks and token ids from a test's seeded generators (``rng``, ``np_rng``)."""

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
