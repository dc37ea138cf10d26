"""Deterministic K/V content for the tests: one splitmix64 family, regenerated, never stored.

Every generator here is splitmix64's finaliser (``mix64``) over a counter or a chain, so a
verifier recomputes the expected bytes from a few numbers instead of keeping them:

* ``kv(seed, key, start, n)``: raw bit patterns keyed by a content key (NaN and denormal
  patterns included, or finite ones with ``finite=True``); token ``t`` of a key is the same
  whatever range it is generated in. The store tests, the crash loops and the mutation
  campaign use it through ``kits.model.Model``.
* ``token_kv(ids, start)``: values that are multiples of 1/512 in [-1, 1), a function of
  (token id, position) (or of the id alone), exact in float16 and float32: prefix caching.
* ``prefix_kv(ids, start, stop)``: the same values, but position ``i`` is a function of
  ``ids[:i + 1]``, as in a real model, so a page served after the wrong prefix differs.

``get_seed`` gives a randomised test its seed: ``PAGEDKV_SEED`` if set, else a fresh one,
printed either way so that ``PAGEDKV_SEED=<n> pytest ...`` replays a failure.
"""

from __future__ import annotations

import functools
import os
import random
import zlib
from typing import Any, Hashable

import numpy as np

from pagedkv import Geometry

from .store import GEOM

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1


def get_seed(label: str = "") -> int:
    """The seed of a randomised test: ``PAGEDKV_SEED`` if set, else a fresh one; printed."""
    env = os.environ.get("PAGEDKV_SEED", "").strip()
    seed = int(env, 0) if env else random.SystemRandom().randrange(1 << 32)
    where = f" ({label})" if label else ""
    print(f"PAGEDKV_SEED={seed}{where}", flush=True)
    return seed


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def split_kv(tokens: np.ndarray, geom: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``(layers, n, kv_heads, head_dim)`` of ``n`` tokens laid out ``(n, layers, 2, heads, dim)``."""
    arr = tokens.reshape(-1, geom.layers, 2, geom.kv_heads, geom.head_dim)
    return (np.ascontiguousarray(arr[:, :, 0].transpose(1, 0, 2, 3)),
            np.ascontiguousarray(arr[:, :, 1].transpose(1, 0, 2, 3)))


def join_kv(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The inverse of ``split_kv``: tokens ``(n, layers, 2, heads, dim)``, as a pool page holds them."""
    return np.stack([k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3)], axis=2)


def _key_hash(key: Hashable) -> int:
    text = repr(key).encode()
    return zlib.crc32(text) | (zlib.adler32(text) << 32)


def kv(seed: int, key: Hashable, start: int, n: int, geom: Geometry = GEOM, finite: bool = False
       ) -> tuple[np.ndarray, np.ndarray]:
    """K and V, each ``(layers, n, kv_heads, head_dim)`` in ``geom``'s dtype, for tokens
    ``[start, start + n)`` of content key ``key``.

    Every element is raw random bits, so a comparison of the bytes is the only sound one.
    With ``finite`` the top exponent bit of every value is cleared: never NaN or Inf (a
    lossy codec then quantises the page instead of falling back).
    """
    per_token = 2 * geom.layers * geom.kv_heads * geom.head_dim
    base = mix64(np.array([((seed & _MASK64) ^ _key_hash(key))], np.uint64) + _GOLD)[0]
    with np.errstate(over="ignore"):
        idx = np.arange(start * per_token, (start + n) * per_token, dtype=np.uint64) + base
        bits = mix64(idx + _GOLD)
    unsigned = np.uint32 if geom.itemsize == 4 else np.uint16
    raw = bits.astype(unsigned)
    if finite:
        raw &= unsigned(~(1 << (8 * geom.itemsize - 2)) & ((1 << (8 * geom.itemsize)) - 1))
    return split_kv(raw.view(geom.np_dtype), geom)


@functools.lru_cache(maxsize=8)
def _elements(per_token: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(np.arange(1, per_token + 1, dtype=np.uint64) * _GOLD)


def _unit_values(token_state: np.ndarray, geom: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """K and V whose elements are multiples of 1/512 in [-1, 1), from one uint64 state per token."""
    elements = _elements(2 * geom.layers * geom.kv_heads * geom.head_dim)
    bits = mix64(token_state[:, None] ^ elements[None, :])
    values = ((bits >> np.uint64(54)).astype(np.float32) / 512.0 - 1.0).astype(geom.np_dtype)
    return split_kv(values, geom)


def token_kv(token_ids: Any, start: int, geom: Geometry, model: str = "",
             positional: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """K and V of ``token_ids`` at positions ``start...``: exact in float16 and float32.

    ``model`` keys the content (KV of another model differs); ``positional=False`` makes
    it a function of the token id alone.
    """
    ids = np.asarray(token_ids, np.int64).astype(np.uint64)
    key = np.uint64(zlib.crc32(model.encode()) + 1)
    with np.errstate(over="ignore"):
        token = mix64(ids * _GOLD + key)
        if positional:
            token = mix64(token ^ (np.arange(start, start + len(ids), dtype=np.uint64) * _M2 + _M1))
    return _unit_values(token, geom)


def prefix_kv(token_ids: Any, start: int, stop: int, geom: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """K and V of positions ``[start, stop)`` of ``token_ids``: each a function of ``ids[:position + 1]``."""
    state, chain = np.uint64(1), np.empty(stop, np.uint64)
    with np.errstate(over="ignore"):
        for pos, token in enumerate(np.asarray(token_ids[:stop], np.uint64)):
            state = mix64(np.array([state ^ (token * _GOLD + _M1)]))[0]
            chain[pos] = state
    return _unit_values(chain[start:stop], geom)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality: dtype, shape and every byte."""
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """``same_bits``, or an AssertionError naming the first differing byte."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not same_bits(actual, expected):
        a = np.ascontiguousarray(actual).view(np.uint8)
        e = np.ascontiguousarray(expected).view(np.uint8)
        bad = np.argwhere(a != e)
        raise AssertionError(f"{what}: {len(bad)} bytes differ, first at index {bad[0].tolist()}")


def differing_tokens(k: np.ndarray, v: np.ndarray, want_k: np.ndarray, want_v: np.ndarray) -> int:
    """How many tokens (axis 1) of ``k``/``v`` differ in any byte from ``want_k``/``want_v``."""
    if k.shape != want_k.shape or v.shape != want_v.shape or k.dtype != want_k.dtype:
        return max(want_k.shape[1], 1)
    if not k.shape[1]:
        return 0
    tokens = k.shape[1]

    def per_token(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.transpose(1, 0, 2, 3)).view(np.uint8).reshape(tokens, -1)

    bad = (per_token(k) != per_token(want_k)).any(1) | (per_token(v) != per_token(want_v)).any(1)
    return int(bad.sum())
