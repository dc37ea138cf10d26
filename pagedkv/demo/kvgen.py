"""Deterministic K/V content for demos, samples and tests: a pure function of (seed, origin, position).

A token's K/V is generated from the seed, the *origin* (the sequence that first
wrote it) and its position, so a verifier regenerates the expected bytes instead
of remembering them; a forked sequence inherits its parent's origins for the
shared prefix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import PagedKVError
from ..geometry import Geometry
from ..store import KVStore

VOCAB = 32_000  # token ids are drawn from a Llama-sized vocabulary
_M1, _M2, _M3 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


class DemoFailed(PagedKVError):
    """What the demo read back differs from what it wrote."""


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps by design)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def token_kv(geom: Geometry, seed: int, origin: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic K and V, each ``(layers, n, kv_heads, head_dim)``, for tokens at ``positions``.

    Values are multiples of 1/512 in [-1, 1): exact in float16 and float32.
    """
    positions = np.asarray(positions, np.uint64)
    per_token = 2 * geom.layers * geom.kv_heads * geom.head_dim
    # One-element arrays, not numpy scalars: array arithmetic wraps without warnings.
    ident = np.array([seed & (2**64 - 1), origin & (2**64 - 1)], np.uint64)
    base = _mix(ident[:1] * _M3 + ident[1:] + _M1)
    token = _mix(base ^ (positions * _M2))
    elems = _elements(per_token)
    bits = _mix(token[:, None] ^ elems[None, :]) >> np.uint64(54)  # 10 random bits
    values = (bits.astype(np.float32) / 512.0 - 1.0).astype(geom.np_dtype)
    values = values.reshape(len(positions), geom.layers, 2, geom.kv_heads, geom.head_dim)
    kv = values.transpose(2, 1, 0, 3, 4)  # (2, layers, n, heads, dim)
    return np.ascontiguousarray(kv[0]), np.ascontiguousarray(kv[1])


@functools.lru_cache(maxsize=8)
def _elements(per_token: int) -> np.ndarray:
    return _mix(np.arange(per_token, dtype=np.uint64) * _M3 + np.uint64(1))


@dataclass
class Request:
    """One request: which origin wrote each span of its tokens, and its own work left."""

    seq_id: int | str
    segments: list[tuple[int, int]]  # (origin, first position it wrote), ascending
    prompt_left: int = 0  # own prompt tokens still to prefill
    decode_left: int = 0  # tokens still to generate
    length: int = 0

    def origin_of(self, positions: np.ndarray) -> np.ndarray:
        """The origin that wrote each position."""
        starts = np.array([start for _, start in self.segments])
        origins = np.array([origin for origin, _ in self.segments])
        return origins[np.searchsorted(starts, positions, side="right") - 1]

    def token_ids(self, seed: int, start: int, stop: int) -> np.ndarray:
        """The token ids at positions ``[start, stop)`` (each a function of its origin)."""
        positions = np.arange(start, stop)
        origins = self.origin_of(positions).astype(np.uint64)
        ident = np.array([seed & (2**64 - 1)], np.uint64)
        mixed = _mix(_mix(ident * _M2 + origins + _M1) ^ (positions.astype(np.uint64) * _M3))
        return (mixed % np.uint64(VOCAB)).astype(np.int64)


def expected_kv(geom: Geometry, seed: int, req: Request, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """The K/V ``req`` must hold for tokens ``[start, stop)``."""
    positions = np.arange(start, stop)
    origins = req.origin_of(positions)
    shape = (geom.layers, stop - start, geom.kv_heads, geom.head_dim)
    out_k, out_v = np.empty(shape, geom.np_dtype), np.empty(shape, geom.np_dtype)
    for origin in np.unique(origins).tolist():
        mask = origins == origin
        out_k[:, mask], out_v[:, mask] = token_kv(geom, seed, origin, positions[mask])
    return out_k, out_v


def check_read(store: KVStore, geom: Geometry, seed: int, req: Request) -> int:
    """Read the whole sequence back and compare bit-exact; return tokens checked."""
    k, v = store.read(req.seq_id)
    want_k, want_v = expected_kv(geom, seed, req, 0, req.length)
    if k.tobytes() != want_k.tobytes() or v.tobytes() != want_v.tobytes():
        raise DemoFailed(f"sequence {req.seq_id!r}: K/V read back differ from what was written")
    return req.length
