"""Costs grow with the work, not with the pool: pins counted as they are taken, dirty slots noted.

A step's fixed cost once counted every slot's pins (``available()``) two or three
times a step, so a one-sequence step on a million-slot pool cost five times one
on a thousand-slot pool; a durable commit scanned every slot's dirty flag and
cleared them all. These tests hold the step to its small-pool cost on a pool a
thousand times larger, and check the bookkeeping that made that possible: the
pin count against the pins, and the room check against a full count.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import numpy as np

import pagedkv
from pagedkv.geometry import Geometry
from pagedkv.store import KVStore

# 64-byte pages, so that a million-slot pool is a 64 MB file.
GEOM = Geometry(layers=1, kv_heads=1, head_dim=1, page_size=16, dtype="float16")


def _step_us(store: KVStore, steps: int) -> float:
    """Microseconds a one-token step of sequence 0 takes, over ``steps`` steps."""
    mapping = {0: 1}
    started = time.perf_counter()
    for _ in range(steps):
        with store.step(mapping):
            pass
    return (time.perf_counter() - started) / steps * 1e6


def test_step_cost_does_not_grow_with_the_pool(tmp_path: Path) -> None:
    """A one-sequence step costs the same on a 1,000-slot and a 1,000,000-slot pool (within 1.6x).

    Blocks of steps alternate between the two stores and the ratio is the
    median of the blocks' ratios, so the machine's noise falls on both. Scanning
    the pins of a million slots costs ~85 us a step, four times the whole step.
    """
    small = pagedkv.open(str(tmp_path / "small"), GEOM, pool_pages=1_000, durability="volatile")
    large = pagedkv.open(str(tmp_path / "large"), GEOM, pool_pages=1_000_000, durability="volatile")
    try:
        for store in (small, large):
            store.create(0)
            with store.step({0: 100}):
                pass
            _step_us(store, 200)  # warm-up
        ratios = [_step_us(large, 300) / _step_us(small, 300) for _ in range(7)]
    finally:
        small.close()
        large.close()
    assert statistics.median(ratios) < 1.6, f"large / small pool step cost: {ratios}"


def test_has_room_agrees_with_a_full_count(tmp_path: Path, seed: int) -> None:
    """Random pins and unpins, slots repeated as shared pages repeat them: ``has_room(n)`` is
    ``available() >= n`` for every ``n``, and ``pin_refs`` is the sum of the pins."""
    rng = random.Random(seed)
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=40, durability="volatile")
    try:
        mgr = store._mgr
        held: list[list[int]] = []
        for _ in range(400):
            if held and rng.random() < 0.45:
                taken = held.pop(rng.randrange(len(held)))
                if len(taken) == 1 and rng.random() < 0.5:
                    mgr.unpin_slot(taken[0])
                else:
                    mgr.unpin(np.array(taken, np.int64))
            else:
                slots = [rng.randrange(40) for _ in range(rng.choice((1, 1, 3, 12, 30)))]
                if len(slots) == 1 and rng.random() < 0.5:
                    mgr.pin_slot(slots[0])
                else:
                    mgr.pin(slots)
                held.append(slots)
            assert mgr.pin_refs == int(mgr.pins.sum())
            free = mgr.available()
            assert free == 40 - int(np.count_nonzero(mgr.pins))
            for count in range(42):
                assert mgr.has_room(count) == (free >= count), (count, free, mgr.pin_refs)
            assert mgr.unpinned_at_least() <= free
            assert mgr.unpinned_at_least() > 0 or free == 0
        for taken in held:
            mgr.unpin(taken)
        assert mgr.pin_refs == 0 and not mgr.pins.any()
    finally:
        store.close()


def test_check_reports_a_pin_count_that_drifted(tmp_path: Path) -> None:
    """``check()`` compares the pin count with the pins: a pin taken behind the count is reported."""
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=16, durability="volatile")
    try:
        store.create(0)
        store.append(0, *(np.zeros((1, 20, 1, 1), np.float16),) * 2)
        assert store.check() == []
        store._mgr.pins[3] += 1  # a pin no pin() counted
        problems = store.check(detailed=True)
        assert [problem.kind for problem in problems if not isinstance(problem, str)] == ["pin_count"], problems
    finally:
        store._mgr.pins[3] -= 1
        store.close()


def test_durable_commit_flushes_exactly_the_written_slots(tmp_path: Path) -> None:
    """The slots a durable commit flushes are those written since the last commit (noted as they
    were written), and none once a commit has flushed them."""
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=64)
    flushed: list[np.ndarray] = []
    real = store._pool_file.start_flush

    def spy(slots: np.ndarray) -> None:
        flushed.append(np.array(slots))
        real(slots)

    store._pool_file.start_flush = spy  # type: ignore[method-assign]
    try:
        for seq in range(3):
            store.create(seq)
        with store.step({0: 20, 1: 5}):
            pass
        written = sorted(int(store._mgr.slot[pid]) for seq in (0, 1)
                         for pid in store._seqs.find(seq).table.tolist())
        store.commit()
        assert flushed[-1].tolist() == written
        store.commit()
        assert flushed[-1].tolist() == []
        with store.step({1: 1}):
            pass
        store.commit()
        assert flushed[-1].tolist() == [int(store._mgr.slot[store._seqs.find(1).table[-1]])]
    finally:
        store.close()


def _evict_us(store: KVStore, batches: int) -> float:
    """Microseconds per page of ``batches`` eviction batches of 64 (nosync: no sync in the figure)."""
    mgr = store._mgr
    started = time.perf_counter()
    evicted = sum(mgr.evict(64) for _ in range(batches))
    assert evicted == 64 * batches
    return (time.perf_counter() - started) / evicted * 1e6


def test_eviction_cost_does_not_grow_with_the_pool(tmp_path: Path) -> None:
    """Evicting a page costs the same from a full 40,000-slot and a full 200,000-slot pool (within 1.6x).

    Choosing a batch's victims once scanned every slot's stamp and pins: 4x the
    small pool's cost per page at 200,000 slots, 17x at 1,000,000. The victims
    now come from slots kept by one scan every 64th of the pool's evictions or
    so: each block of 100 batches spans more than one scan on either pool, so
    the scans' share is in both figures.
    """
    stores = {}
    try:
        for size in (40_000, 200_000):
            store = stores[size] = pagedkv.open(str(tmp_path / f"s{size}"), GEOM, pool_pages=size,
                                                durability="nosync")
            store.create(0)
            with store.step({0: GEOM.page_size * size}):  # every slot holds a page
                pass
            store.commit()
            _evict_us(store, 3)  # warm-up
        ratios = [_evict_us(stores[200_000], 100) / _evict_us(stores[40_000], 100) for _ in range(5)]
    finally:
        for store in stores.values():
            store.close()
    assert statistics.median(ratios) < 1.6, f"large / small pool eviction cost per page: {ratios}"
