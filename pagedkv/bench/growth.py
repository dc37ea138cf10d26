"""B7's growth rows: the same decode-step commit on a small and a large store, interleaved.

``b7_growth`` grows the directory (idle pages, spilled), ``b7_pool_growth`` the
pool (idle slots): a commit must cost what the step changed in either case.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

from .. import open as open_store
from ..pages.sequence import SeqId
from ..store import KVStore
from .meta import META_GEOM, b7_commit, decode_commit
from .util import Ctx, Target, close_all, geom_params, interleave, make_row

ACTIVE = 256  # sequences in the step, as in B7's commit rows
HEADROOM = 1024  # pool slots beyond the active pages: the steps' new pages fit without evicting


def b7_all(ctx: Ctx) -> list[dict[str, Any]]:
    """B7, every row: the commit against its references (``meta.b7_commit``), then its growth with the directory."""
    return b7_commit(ctx) + b7_growth(ctx) + b7_pool_growth(ctx)


def _build(path: str, pages: int, prompts: list[int], pool: int) -> dict[str, Any]:
    """A committed store of ``pages`` directory pages: idle sequences first (spilled), then the active ones.

    Built nosync with one eviction transaction per quarter pool, B6's fastest
    honest build; the active sequences come last so the LRU spills idle pages.
    """
    page_size = META_GEOM.page_size
    started = time.perf_counter()
    store = open_store(path, META_GEOM, pool_pages=pool, durability="nosync", evict_batch=pool // 4,
                       map_size=1 << 32)
    try:
        active = sum(-(-p // page_size) for p in prompts)
        idle = pages - active
        per_seq = 1000  # pages per idle sequence
        seq = len(prompts)
        while idle > 0:
            count = min(per_seq, idle)
            k = np.zeros((1, count * page_size, 1, 1), META_GEOM.np_dtype)
            store.create(seq)
            store.append(seq, k, k)
            idle -= count
            seq += 1
        for index in range(len(prompts)):
            store.create(index)
        with store.step(dict(enumerate(prompts))):
            pass
        store.commit()
        stats = store.stats()
    finally:
        store.close()
    return {"pages": int(stats["pages"]), "spilled_pages": int(stats["spilled_pages"]),
            "idle_sequences": seq - len(prompts), "build_s": time.perf_counter() - started}


def b7_growth(ctx: Ctx) -> list[dict[str, Any]]:
    """B7: a 256-sequence one-token decode-step commit on a 10k-page and a 1M-page store, large / small.

    Both stores hold the same 256 active sequences (resident) and the same pool
    (their pages plus ``HEADROOM``); the rest of each directory is idle
    sequences committed earlier, spilled. The pages are 64 bytes
    (``META_GEOM``), so the figure is the commit's metadata work. Each round
    steps and commits the large store, then the small one.
    """
    sizes = (10_000, 100_000) if ctx.quick else (10_000, 1_000_000)
    pairs = 5 if ctx.quick else 15
    page_size = META_GEOM.page_size
    rng = ctx.rng("b7-growth")
    prompts = [rng.randint(16, 512) for _ in range(ACTIVE)]
    active = sum(-(-p // page_size) for p in prompts)
    assert active < sizes[0], "B7 growth: the small store must hold idle pages too"
    pool = active + HEADROOM
    base = ctx.path("b7-growth")
    paths = {size: os.path.join(base, str(size)) for size in sizes}
    token = np.ones((META_GEOM.layers, 2, META_GEOM.kv_heads, META_GEOM.head_dim), META_GEOM.np_dtype)
    mapping: dict[SeqId, int] = {seq: 1 for seq in range(ACTIVE)}
    rows = []
    try:
        built = {}
        for size in sizes:
            ctx.say(f"B7: building a store of {size} pages")
            built[size] = _build(paths[size], size, prompts, pool)
        small, large = sizes
        for mode in ("nosync", "durable"):
            stores: dict[int, KVStore] = {}
            try:
                opened = {}
                for size in sizes:
                    started = time.perf_counter()
                    stores[size] = open_store(paths[size], durability=mode)
                    opened[size] = time.perf_counter() - started
                for size in sizes:  # warm-up: the first use after a reopen verifies the active pages
                    decode_commit(stores[size], mapping, token)
                result = interleave(lambda: decode_commit(stores[large], mapping, token),
                                    lambda: decode_commit(stores[small], mapping, token), pairs)
                lens = [stores[size].length(0) for size in sizes]
                assert lens[0] == lens[1], "B7 growth: the two stores took different steps"
            finally:
                for store in stores.values():
                    store.close()
            params = {**geom_params(META_GEOM), "durability": mode, "sequences": ACTIVE, "pairs": pairs,
                      "pages_small": built[small]["pages"], "pages_large": built[large]["pages"],
                      "pool_pages": pool, "idle_pages": "spilled, committed (the pool holds the active "
                                                        f"pages and {HEADROOM} more)"}
            metrics = {"small_ms": result.b_median, "spilled_small": built[small]["spilled_pages"],
                       "spilled_large": built[large]["spilled_pages"], "build_large_s": built[large]["build_s"],
                       "open_large_s": opened[large], "open_small_s": opened[small]}
            rows.append(make_row("B7", f"commit after decode step {mode}, {large} vs {small} pages",
                                 result.a_median, result.b_median, "ms", result.ratio,
                                 Target("<= 1.2x", "<=", 1.2), params,
                                 f"the same commit() after a 1-token step of {ACTIVE} resident sequences on a "
                                 f"store of {large} directory pages vs one of {small}, interleaved; the ratio "
                                 "is large / small", metrics))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def b7_pool_growth(ctx: Ctx) -> list[dict[str, Any]]:
    """B7: the 256-sequence decode-step commit on a 1,000,000-slot pool against one of its pages + ``HEADROOM``.

    The same active sequences, resident in both; the large pool's other slots
    are empty. Each round steps and commits the large store, then the small
    one, per durability mode. What a commit writes of the slots (their LRU
    stamps, the slots it flushes) must be what the step touched.
    """
    pairs = 5 if ctx.quick else 15
    page_size = META_GEOM.page_size
    rng = ctx.rng("b7-pool-growth")
    prompts = [rng.randint(16, 512) for _ in range(ACTIVE)]
    small = sum(-(-p // page_size) for p in prompts) + HEADROOM
    large = 100_000 if ctx.quick else 1_000_000
    token = np.ones((META_GEOM.layers, 2, META_GEOM.kv_heads, META_GEOM.head_dim), META_GEOM.np_dtype)
    mapping: dict[SeqId, int] = {seq: 1 for seq in range(ACTIVE)}
    rows = []
    for mode in ("nosync", "durable"):
        base = ctx.path(f"b7-pool-growth-{mode}")
        stores: dict[int, KVStore] = {}
        try:
            for slots in (small, large):
                ctx.say(f"B7: a {mode} store with a {slots}-slot pool")
                store = stores[slots] = open_store(os.path.join(base, str(slots)), META_GEOM, pool_pages=slots,
                                                   durability=mode)
                for seq in range(ACTIVE):
                    store.create(seq)
                with store.step(dict(enumerate(prompts))):
                    pass
                store.commit()
                decode_commit(store, mapping, token)  # warm-up
            result = interleave(lambda: decode_commit(stores[large], mapping, token),
                                lambda: decode_commit(stores[small], mapping, token), pairs)
            lens = [store.length(0) for store in stores.values()]
            assert lens[0] == lens[1], "B7 pool growth: the two stores took different steps"
        finally:
            close_all(stores.values(), base)
        params = {**geom_params(META_GEOM), "durability": mode, "sequences": ACTIVE, "pairs": pairs,
                  "pool_pages_small": small, "pool_pages_large": large}
        rows.append(make_row("B7", f"commit after decode step {mode}, {large}-slot vs {small}-slot pool",
                             result.a_median, result.b_median, "ms", result.ratio, Target("<= 1.2x", "<=", 1.2),
                             params, f"the same commit() after a 1-token step of {ACTIVE} resident sequences "
                             f"with a pool of {large} slots vs one of {small} (their pages + {HEADROOM}), "
                             "interleaved; the ratio is large / small", {"small_ms": result.b_median}))
    return rows
