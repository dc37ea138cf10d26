"""Eviction's victims without a scan of the pool: exactly the slots a full scan would choose.

``OldestSlots`` keeps the oldest resident slots from one scan and checks each
against the slots' state when it hands them out. The model below is the full
scan: every resident slot that no step or background batch pins, by stamp then
slot number. Random uses, placements, evictions, pins and hand-outs that the
caller does not evict (a spill cap may leave a victim resident) must never make
the two differ; then the same comparison inside a store, at every eviction.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv.geometry import Geometry
from pagedkv.pages import evict
from pagedkv.pages import victims as victims_module
from pagedkv.pages.victims import OldestSlots

GEOM = Geometry(layers=1, kv_heads=1, head_dim=2, page_size=4, dtype="float16")


def full_scan(slot_pid: np.ndarray, stamp: np.ndarray, pins: np.ndarray, bg_pins: np.ndarray,
              count: int) -> list[int]:
    """The model: the ``count`` oldest unpinned resident slots, ties by slot number."""
    idle = np.flatnonzero((slot_pid >= 0) & (pins == 0) & (bg_pins == 0))
    return [int(slot) for slot in idle[np.lexsort((idle, stamp[idle]))][:count]]


@pytest.mark.parametrize("slots", [7, 300, 5000])
def test_oldest_slots_match_a_full_scan(slots: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(victims_module, "_SPAN", rng.choice((1, 3, 16, 1024)))  # scans often, or rarely
    slot_pid = np.where(np.array([rng.random() < 0.8 for _ in range(slots)]), np.arange(slots), -1)
    tick = 0
    stamp = np.zeros(slots, np.int64)
    for slot in range(slots):  # many ties: a step stamps its slots with one tick
        if rng.random() < 0.3:
            tick += 1
        stamp[slot] = tick
    pins = np.zeros(slots, np.int32)
    bg_pins = np.zeros(slots, np.int32)
    oldest = OldestSlots()
    for _ in range(400):
        action = rng.random()
        some = np.array(rng.sample(range(slots), rng.randint(1, max(1, slots // 10))), np.int64)
        if action < 0.25:  # a use: one tick for the whole call
            tick += 1
            stamp[some[slot_pid[some] >= 0]] = tick
        elif action < 0.35:  # pages placed in empty slots take a new tick
            empty = some[slot_pid[some] < 0]
            tick += 1
            slot_pid[empty], stamp[empty] = empty, tick
        elif action < 0.45:
            pins[some] += 1
        elif action < 0.55:
            pins[some] = np.maximum(pins[some] - 1, 0)
        elif action < 0.6:
            bg_pins[some] ^= 1
        else:
            count = rng.randint(1, max(1, slots // 4))
            want = full_scan(slot_pid, stamp, pins, bg_pins, count)
            got = oldest.take(slot_pid, stamp, pins, bg_pins, count).tolist()
            assert got == want, f"seed {seed}: take({count})"
            for slot in got:  # most are evicted; a few stay resident, to be handed out again
                if rng.random() < 0.8:
                    slot_pid[slot] = -1


def test_every_eviction_of_a_store_takes_the_full_scans_victims(tmp_path: Path, seed: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps, reads, drops, commits and reopens on a small pool: each batch ``_choose`` picks is
    the pending slots first, then exactly the full scan's oldest slots."""
    rng = random.Random(seed)
    monkeypatch.setattr(victims_module, "_SPAN", 8)
    real = evict._choose
    checked = [0]

    def compared(mgr: object, count: int) -> np.ndarray:
        table = mgr  # a PageTable
        pending = np.flatnonzero((table.slot_pid < 0) & (table.slot_cpid >= 0)  # type: ignore[attr-defined]
                                 & (table.pins == 0) & (table.bg_pins == 0)).tolist()[:count]  # type: ignore[attr-defined]
        want = pending + full_scan(table.slot_pid, table.stamp, table.pins,  # type: ignore[attr-defined]
                                   table.bg_pins, count - len(pending))  # type: ignore[attr-defined]
        got = real(mgr, count)  # type: ignore[arg-type]
        assert got.tolist() == want, f"seed {seed}"
        checked[0] += 1
        return got

    monkeypatch.setattr(evict, "_choose", compared)
    path = str(tmp_path / "s")
    store = pagedkv.open(path, GEOM, pool_pages=16, evict_batch=4)
    try:
        live = list(range(12))  # 36 pages for 16 slots: most steps and reads restore, and evict
        for seq in live:
            store.create(seq)
            with store.step({seq: 9}):
                pass
        next_id = len(live)
        for _ in range(500):
            action = rng.random()
            if action < 0.15 or not live:
                store.create(next_id)
                live.append(next_id)
                next_id += 1
            elif action < 0.7:  # sequences of at most 4 pages, batches of at most 3: they fit in 16 slots
                short = [seq for seq in live if store.length(seq) <= 10]
                if not short:
                    store.drop(live.pop(0))
                    continue
                batch = rng.sample(short, min(len(short), rng.randint(1, 3)))
                with store.step({seq: rng.randint(1, 6) for seq in batch}):
                    pass
            elif action < 0.78:
                store.read(rng.choice(live))
            elif action < 0.85 and len(live) > 8:  # at least 8 sequences of 3 pages stay: 24 for 16 slots
                store.drop(live.pop(rng.randrange(len(live))))
            elif action < 0.95:
                store.commit()
            else:
                store.commit()
                store.close()
                store = pagedkv.open(path, GEOM, pool_pages=16, evict_batch=4)
            assert store.check() == [], f"seed {seed}"
        for _ in range(3):  # every sequence read back, three times: restores that keep evicting
            for seq in live:
                store.read(seq)
        assert store.check() == [], f"seed {seed}"
    finally:
        store.close()
    assert checked[0] > 15, f"seed {seed}: only {checked[0]} evictions"
