"""Write-behind eviction: spills happen in the background, and nothing is lost or wrong."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.kits.content import get_seed
from tests.kits.crash import sigkill_loop
from tests.kits.model import Model, append_or_undo, run_workers, step_one, verify_unless_pinned
from tests.kits.powerloss import power_loss_loop

WB_CYCLES = 300  # per mode, on top of the 1000 of tests/test_crash.py with write-behind off


def test_write_behind_spills_in_the_background(stores) -> None:
    model = Model(71)
    store = stores.open(pool_pages=16, write_behind=True)
    for seq in range(12):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, 9))
        if seq % 4 == 3:
            store.commit()
    # The thread races the foreground for the first evictions (on a loaded machine the
    # foreground may take them all); the pool is left below the low-water mark, so the
    # thread has a batch to land: wait for it, with a deadline.
    deadline, idle = time.monotonic() + 30, threading.Event()
    while (stats := store.stats())["background_evictions"] == 0 and time.monotonic() < deadline:
        idle.wait(0.005)
    assert stats["background_evictions"] > 0
    assert stats["evictions"] >= stats["background_evictions"]
    model.verify_all(store)
    assert store.check() == []
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_write_behind_is_off_under_a_spill_cap(stores) -> None:
    model = Model(72)
    store = stores.open(pool_pages=8, write_behind=True, spill_limit_bytes=1 << 20)
    for seq in range(6):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, 9))
    assert store.stats()["background_evictions"] == 0 and store.stats()["evictions"] > 0
    model.verify_all(store)


@pytest.mark.timeout(180)
def test_write_behind_threads_steps_and_drops(stores, seed) -> None:
    """Foreground threads append, step, fork, drop and commit while the evictor runs."""
    store = stores.open(pool_pages=14, durability="nosync", write_behind=True)
    models = [Model(seed + n) for n in range(3)]
    guard = threading.Lock()

    def worker(n: int) -> None:
        model, rng = models[n], random.Random(seed * 7 + n)
        names = iter(range(10**6))
        for _ in range(150):
            with guard:
                live = [s for s in model.segs]
            action = rng.random()
            if action < 0.15 or not live:
                seq = f"w{n}-{next(names)}"
                store.create(seq)
                model.create(seq)
                continue
            seq = rng.choice(live)
            if action < 0.45:
                append_or_undo(store, model, seq, rng.randint(1, 7))
            elif action < 0.6:
                verify_unless_pinned(store, model, seq)
            elif action < 0.75:
                step_one(store, model, seq)
            elif action < 0.82 and len(live) > 2:
                store.drop(seq)
                model.drop(seq)
            elif action < 0.9:
                dst = f"w{n}-{next(names)}"
                store.fork(seq, dst)
                model.fork(seq, dst)
            else:
                store.commit()

    run_workers(worker, len(models), 150)
    assert store.stats()["background_evictions"] > 0
    for model in models:
        for seq in model.segs:
            model.verify(store, seq)
    assert store.check() == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["durable", "nosync"])
def test_write_behind_survives_sigkill(tmp_path: Path, monkeypatch, mode: str) -> None:
    """The SIGKILL loop with write-behind on in every child: 0 wrong bytes, 0 lost pages,
    0 lost acked commits, 0 reopen failures."""
    monkeypatch.setenv("PAGEDKV_WRITE_BEHIND", "1")
    seed = get_seed(f"write-behind SIGKILL {mode}")
    result = sigkill_loop(tmp_path / "store", mode, WB_CYCLES, seed,
                          artifact_root=tmp_path / "artifacts", name=f"WB-{mode}")
    print(result.summary())
    assert result.violation_cycles == 0, result.summary()
    assert result.figures["lost_pages"] == 0 and result.figures["wrong_tokens"] == 0
    assert result.cycles == WB_CYCLES


def test_write_behind_content_is_exact_after_random_work(stores, seed) -> None:
    rng = np.random.default_rng(seed)
    model = Model(seed)
    store = stores.open(pool_pages=10, write_behind=True)
    for i in range(40):
        seq = int(rng.integers(0, 8))
        if seq not in model.segs:
            store.create(seq)
            model.create(seq)
        store.append(seq, *model.next_kv(seq, int(rng.integers(1, 9))))
        if i % 9 == 0:
            store.commit()
    model.verify_all(store)
    store._abandon()  # a crash: the last commit comes back, bit-exact
    reopened = stores.open(geom=None, pool_pages=None)
    assert reopened.check() == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_write_behind_survives_power_loss(tmp_path: Path, monkeypatch) -> None:
    """The power-loss loop with write-behind on: 0 lost committed pages, 0 wrong bytes."""
    monkeypatch.setenv("PAGEDKV_WRITE_BEHIND", "1")
    seed = get_seed("write-behind power loss")
    result = power_loss_loop(tmp_path / "store", WB_CYCLES, seed,
                             name="WB-power", artifact_root=tmp_path / "artifacts")
    print(result.summary())
    assert result.violation_cycles == 0, result.summary()
    assert result.figures["lost_pages"] == 0 and result.figures["wrong_tokens"] == 0
