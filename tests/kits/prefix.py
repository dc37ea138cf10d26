"""Prefix caching in the tests: a geometry, prompts, prefill as an engine does it, exact checks.

* ``GEOM``: 2 layers, 2 KV heads, head_dim 4, 8 tokens a page, float32 (1 KiB pages).
* ``prompt(rng, n)``: random token ids; ``extend`` / ``prefill``: append the K/V of token ids
  (``kits.content.token_kv``: a function of (token id, position), or of ``model`` too).
* ``assert_holds(store, seq, ids)``: the sequence holds exactly the K/V of those ids.
* ``PrefixStores``: ``kits.store.Stores`` with this geometry and a 16-slot pool.
* ``index_problems(store)``: white-box, every entry of the prefix index names a live,
  full, hashed page with that hash.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import pagedkv
from pagedkv import Geometry

from .content import same_bits, token_kv
from .store import Stores

GEOM = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=8, dtype="float32")
PS = GEOM.page_size


def prompt(rng: np.random.Generator, n: int, vocab: int = 50_000) -> np.ndarray:
    """``n`` random token ids."""
    return rng.integers(0, vocab, n, dtype=np.int64)


def extend(store: pagedkv.KVStore, seq: Any, ids: Any, start: int | None = None, **kv_args: Any) -> None:
    """Append the K/V of ``ids`` (at the sequence's next positions) with their token ids."""
    ids = np.asarray(ids, np.int64)
    if len(ids):
        start = store.length(seq) if start is None else start
        store.append(seq, *token_kv(ids, start, store.geometry, **kv_args), tokens=ids)


def prefill(store: pagedkv.KVStore, seq: Any, ids: Any, **kv_args: Any) -> int:
    """``create(seq, tokens=ids)``, then append what was not reused; return the reused count."""
    reused = store.create(seq, tokens=ids)
    extend(store, seq, np.asarray(ids)[reused:], reused, **kv_args)
    return reused


def assert_holds(store: pagedkv.KVStore, seq: Any, ids: Any, start: int = 0, stop: int | None = None,
                 **kv_args: Any) -> None:
    """``seq`` holds exactly the K/V of token ids ``ids`` (all of it, or ``[start, stop)``), bit for bit."""
    ids = np.asarray(ids, np.int64)
    stop = len(ids) if stop is None else stop
    if start == 0 and stop == len(ids):
        assert store.length(seq) == len(ids), f"{seq!r}: length {store.length(seq)}, expected {len(ids)}"
    k, v = store.read(seq, start, stop)
    ek, ev = token_kv(ids[start:stop], start, store.geometry, **kv_args)
    for name, got, want in (("K", k, ek), ("V", v, ev)):
        if not same_bits(got, want):
            bad = np.flatnonzero((got != want).any(axis=(0, 2, 3)))
            raise AssertionError(f"{name} of {seq!r}[{start}:{stop}] differs at tokens "
                                 f"{(bad + start).tolist()[:10]}")


class PrefixStores(Stores):
    """``kits.store.Stores`` with this module's geometry and a 16-slot pool by default."""

    def open(self, name: str = "store", geom: Geometry | None = GEOM, pool_pages: int | None = 16,
             **kwargs: Any) -> pagedkv.KVStore:
        """``Stores.open`` with the prefix geometry."""
        return super().open(name, geom, pool_pages, **kwargs)


def index_problems(store: pagedkv.KVStore) -> list[str]:
    """White-box: every hash -> page entry of the prefix index names a live, hashed page with that hash."""
    from pagedkv.pages.manager import HAS_TOKENS, HASHED

    mgr = store._mgr
    problems = []
    for pid in mgr.prefix.pages().tolist():
        digest = bytes(mgr.hash[pid])
        if not mgr.prefix.holds(digest, pid):
            problems.append(f"page row {pid} is indexed off its hash's probe path")
        if not mgr.live[pid]:
            problems.append(f"index entry {digest.hex()} names freed row {pid}")
        elif bytes(mgr.hash[pid]) != digest or not mgr.flags[pid] & HASHED:
            problems.append(f"index entry {digest.hex()} names page {int(mgr.uid[pid])} with another hash")
        elif not mgr.flags[pid] & HAS_TOKENS or mgr.fill[pid] != store.geometry.page_size:
            problems.append(f"indexed page {int(mgr.uid[pid])} lacks token ids or is not full")
    return problems
