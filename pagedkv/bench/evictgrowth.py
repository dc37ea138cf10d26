"""B4's growth row: evicting a page from a full pool of 1,000,000 slots against one of 10,000.

Each store holds one sequence filling every slot with a 64-byte page
(``META_GEOM``), committed, nosync (so no sync is in the figure); rounds
alternate between the two, each evicting blocks of 64-page batches
(``BlockManager.evict``) and timing them per evicted page. A batch's work is
its 64 pages: the ratio is 1 unless choosing the victims scans the pool.
"""

from __future__ import annotations

import time
from typing import Any

from .. import open as open_store
from ..store import KVStore
from .meta import META_GEOM
from .util import Ctx, Target, close_all, geom_params, interleave, make_row

BATCH = 64  # pages per eviction batch, the default


def _evict_us(store: KVStore, batches: int) -> float:
    """Microseconds per page of ``batches`` eviction batches of ``BATCH`` pages."""
    mgr = store._mgr
    started = time.perf_counter()
    evicted = sum(mgr.evict(BATCH) for _ in range(batches))
    assert evicted == BATCH * batches, "B4 eviction growth: a batch evicted fewer pages than asked"
    return (time.perf_counter() - started) / evicted * 1e6


def b4_evict_growth(ctx: Ctx) -> list[dict[str, Any]]:
    """B4: per evicted page, a full 1,000,000-slot pool against a full 10,000-slot one (large / small)."""
    small, large = 10_000, (100_000 if ctx.quick else 1_000_000)
    pairs, batches = (3, 10) if ctx.quick else (9, 16)  # (1 + 9 x 16) x 64 pages: within the small pool
    paths = {size: ctx.path(f"b4-evict-growth-{size}") for size in (small, large)}
    stores: dict[int, KVStore] = {}
    try:
        for size, path in paths.items():
            ctx.say(f"B4: filling a {size}-slot pool for the eviction growth row")
            store = stores[size] = open_store(path, META_GEOM, pool_pages=size, durability="nosync")
            store.create(0)
            with store.step({0: META_GEOM.page_size * size}):  # every slot holds a page
                pass
            store.commit()
            _evict_us(store, 1)  # warm-up
        result = interleave(lambda: _evict_us(stores[large], batches), lambda: _evict_us(stores[small], batches),
                            pairs)
    finally:
        close_all(stores.values(), *paths.values())
    params = {**geom_params(META_GEOM), "durability": "nosync", "evict_batch": BATCH, "batches_per_round": batches,
              "pairs": pairs, "small_pool_pages": small, "large_pool_pages": large}
    return [make_row("B4", f"eviction per page, {large} vs {small} slots", result.a_median, result.b_median,
                     "us/page", result.ratio, Target("<= 1.2x", "<=", 1.2), params,
                     f"BlockManager.evict({BATCH}) from a full pool of {large} slots vs one of {small} (one "
                     "sequence's 64-byte pages, committed, nosync), interleaved; the ratio is large / small",
                     {"small_us": result.b_median})]
