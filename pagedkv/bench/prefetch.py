"""Prefetch scenario: a decode loop over spilled sequences, with and without prefetch one step ahead."""

from __future__ import annotations

import os
import time
from typing import Any


from .util import Ctx, Target, close_all, geom_params, interleave, make_row
from ..geometry import Geometry
from ..opening import open_store
from ..store import KVStore

GEOM = Geometry(layers=32, kv_heads=8, head_dim=128, page_size=16, dtype="float16")  # 2 MiB pages
QUICK_GEOM = Geometry(layers=8, kv_heads=4, head_dim=64, page_size=16, dtype="float16")  # 128 KiB


def b9_prefetch(ctx: Ctx) -> list[dict[str, Any]]:
    """B9: wall time of a decode loop whose sequences were spilled since their last step.

    Each step serves two sequences while the "engine" computes (device time: the
    CPU is free, as beside a GPU); the prefetching loop asks for the next step's
    sequences inside this step. Ratio < 1 means prefetch hid restore time behind
    compute.
    """
    geom = QUICK_GEOM if ctx.quick else GEOM
    nseq, tokens, rounds = (16, 48, 2) if ctx.quick else (16, 64, 2)
    pairs = 3 if ctx.quick else 5
    pages_per_seq = -(-(tokens + rounds * 2 + 2) // geom.page_size)
    pool_pages = 3 * 2 * pages_per_seq  # room for this step's group and the next: 3/16 of the set
    rng = ctx.np_rng("b9")
    # The engine's compute is device time (a GPU kernel): the CPU idles meanwhile, as it
    # would beside a GPU, so the prefetch thread has a core. Sized near one step's restores.
    device_s = 0.003 if ctx.quick else 0.012
    groups = [[2 * j, 2 * j + 1] for j in range(nseq // 2)]
    stores: dict[bool, KVStore] = {}
    base = ctx.path("b9")
    try:
        for prefetch in (True, False):
            store = open_store(os.path.join(base, str(prefetch)), geom, pool_pages, durability="nosync")
            for seq in range(nseq):
                k = rng.standard_normal((geom.layers, tokens, geom.kv_heads, geom.head_dim)).astype(
                    geom.np_dtype)
                store.create(seq)
                store.append(seq, k, k)
            stores[prefetch] = store

        def compute() -> None:
            time.sleep(device_s)

        def loop(prefetch: bool) -> float:
            store = stores[prefetch]
            started = time.perf_counter()
            handle = None
            for _ in range(rounds):
                for j, group in enumerate(groups):
                    with store.step({seq: 1 for seq in group}):
                        if prefetch:  # this step's pages are pinned: the next group's load beside it
                            handle = store.prefetch(groups[(j + 1) % len(groups)])
                        compute()
                    if handle is not None:
                        handle.wait()
            if handle is not None:
                handle.wait()
            return (time.perf_counter() - started) * 1e3

        loop(True)
        loop(False)
        result = interleave(lambda: loop(True), lambda: loop(False), pairs)
        with_stats, without_stats = stores[True].stats(), stores[False].stats()
    finally:
        close_all(stores.values(), base)
    params = {**geom_params(geom), "sequences": nseq, "tokens": tokens, "pool_pages": pool_pages,
              "rounds": rounds, "pairs": pairs}
    metrics = {"prefetch_restores": with_stats["prefetch_restores"],
               "on_demand_restores_with_prefetch": with_stats["restores"],
               "on_demand_restores_without": without_stats["restores"]}
    return [make_row("B9", "decode loop with prefetch one step ahead", result.a_median, result.b_median,
                     "ms", result.ratio, Target("< 1.0 (hides restores)", "<=", 1.0), params,
                     "same loop without prefetch is the reference; the engine's compute is "
                     f"{device_s * 1e3:.0f} ms of device time per step (the CPU idle)",
                     metrics)]
