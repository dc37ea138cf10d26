"""A store serving a steady workload keeps a steady amount of memory: what it holds follows
what is live, not how long it has run.

A server runs for months. Anything that grows with the history of operations rather
than with the live state (a list of freed rows never reused, marks of removed index
entries, per-operation records, a table the interpreter rebuilds because of churn)
shows up here as memory that keeps growing once the workload is steady. The workload
is an engine's: sequences with token ids, many sharing a prompt prefix, created, given
decode steps, read, dropped, committed, with the spill store capped so that the cached
prefixes it keeps on disk are bounded too.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv.geometry import Geometry

from tests.kits.content import get_seed

GEOM = Geometry(layers=1, kv_heads=1, head_dim=4, page_size=4, dtype="float16")
LIVE = 12  # sequences alive at once
PROMPTS = 6  # distinct prompt prefixes the requests draw from


def _cycle(store: pagedkv.KVStore, rng: random.Random, live: list[int], next_id: list[int]) -> None:
    """One scheduler round: a request arrives, the running batch takes a step, maybe one finishes."""
    seq = next_id[0]
    next_id[0] += 1
    prefix = [1000 * rng.randrange(PROMPTS) + i for i in range(rng.randrange(4, 24))]
    prompt = prefix + [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 9))]
    store.create(seq, tokens=prompt)
    kv = np.ones((GEOM.layers, len(prompt) - store.length(seq), GEOM.kv_heads, GEOM.head_dim), np.float16)
    store.append(seq, kv, kv, tokens=prompt[store.length(seq):])
    live.append(seq)
    ids = {s: [rng.randrange(1 << 20)] for s in live}
    with store.step({s: 1 for s in live}, tokens=ids):
        pass
    store.read(live[0], 0, store.length(live[0]))
    if len(live) > LIVE:
        store.drop(live.pop(0 if rng.random() < 0.7 else rng.randrange(len(live))))
    store.commit()


CYCLES = 300  # per window


@pytest.mark.slow
def test_steady_workload_does_not_grow_memory(tmp_path: Path) -> None:
    """What a second window of the workload holds beyond the first: objects, traced bytes.

    The first window brings every structure to its steady size (the spill cap is
    reached before it starts) and lets the allocators' caches of freed blocks fill;
    a leak grows in the second window as it did in the first. Interpreter and numpy
    caches keep filling slowly for a while (a few KB a window here), so the bound is
    what a leak of one small object per cycle would exceed.
    """
    seed = get_seed("steady memory")
    rng = random.Random(seed)
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=256, durability="nosync",
                         spill_limit_bytes=64 << 10)
    live: list[int] = []
    next_id = [0]
    try:
        for _ in range(CYCLES):
            _cycle(store, rng, live, next_id)
        assert store.stats()["cache_drops"] > 0  # the spill store is at its cap: the cache is bounded
        objects = []
        for _ in range(2):  # untraced: a snapshot's own traces are objects too
            for _ in range(CYCLES):
                _cycle(store, rng, live, next_id)
            gc.collect()
            objects.append(len(gc.get_objects()))
        tracemalloc.start(4)
        try:
            snapshots = []
            for _ in range(3):  # the first window's growth is mostly caches filling: compared are the last two
                for _ in range(CYCLES):
                    _cycle(store, rng, live, next_id)
                gc.collect()
                snapshots.append(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
        stats = store.stats()
    finally:
        store.close()
    assert stats["spilled_pages"] > 0 and stats["evictions"] > 0  # the pool and the spill store took part
    # Objects the collector tracks (containers, instances): a steady store has as many each time.
    assert objects[1] - objects[0] < 30, f"seed {seed}: {objects[1] - objects[0]} more objects"
    diff = snapshots[2].compare_to(snapshots[1], "traceback")
    total = sum(stat.size_diff for stat in diff)
    top = "; ".join(f"+{stat.size_diff} B +{stat.count_diff} at {stat.traceback.format()[-1].strip()}"
                    for stat in diff[:5] if stat.size_diff > 0)
    # One object of ~60 B kept per cycle would be 18 KB more.
    assert total < 16 << 10, f"seed {seed}: {total} B more held after {CYCLES} more cycles: {top}"
