"""Background prefetch: restores ahead of use, stays exact, and never deadlocks."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import pagedkv

from tests.kits.model import Model, append_or_undo, run_workers, step_one, verify_unless_pinned
from tests.kits.store import engine_write





def filled(stores, model: Model, count: int, tokens: int, pool_pages: int = 8) -> pagedkv.KVStore:
    store = stores.open(pool_pages=pool_pages, durability="nosync")
    for seq in range(count):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, tokens))
    return store


def test_prefetch_restores_spilled_pages_ahead_of_a_step(stores) -> None:
    model = Model(61)
    store = filled(stores, model, 6, 10)  # 3 pages each, 18 pages, 8 slots
    spilled = store.stats()["spilled_pages"]
    assert spilled > 0
    handle = store.prefetch([0])
    assert handle.wait(30) and handle.error is None
    assert handle.pages == 3 and store.stats()["prefetch_restores"] == 3
    restores = store.stats()["restores"]
    with store.step({0: 1}) as s:  # everything it needs is already resident
        engine_write(store, s, [model.next_kv(0, 1)])
    assert store.stats()["restores"] == restores
    model.verify_all(store)
    assert store.check() == []


def test_prefetch_of_resident_or_missing_sequences(stores) -> None:
    model = Model(62)
    store = filled(stores, model, 2, 4)  # all resident
    handle = store.prefetch([0, 1])
    assert handle.wait(30) and handle.pages == 0
    with pytest.raises(pagedkv.SequenceNotFound):
        store.prefetch(["nope"])
    store.commit()
    reader_path = store.path
    store.close()
    reader = pagedkv.open(reader_path, readonly=True)
    try:
        assert reader.prefetch([0]).wait(30)  # nothing to move in a read-only handle
    finally:
        reader.close()


def test_prefetch_then_changes_never_serve_stale_pages(stores) -> None:
    """Pages changed, dropped or restored while a prefetch is queued are left alone."""
    model = Model(63)
    store = filled(stores, model, 6, 10)
    handles = [store.prefetch([seq]) for seq in range(6)]
    store.append(2, *model.next_kv(2, 3))
    store.drop(4)
    model.drop(4)
    with store.step({5: 2}) as s:
        engine_write(store, s, [model.next_kv(5, 2)])
    for handle in handles:
        assert handle.wait(30) and handle.error is None
    model.verify_all(store)
    assert store.check() == []
    store = stores.reopen(store)
    model.verify_all(store)


def test_close_with_prefetch_in_flight(stores) -> None:
    model = Model(64)
    store = filled(stores, model, 8, 12)
    handles = [store.prefetch(range(8)) for _ in range(3)]
    store.close()
    assert all(handle.done() for handle in handles)
    reopened = stores.open(geom=None, pool_pages=None)
    model.verify_all(reopened)


@pytest.mark.timeout(120)
def test_threads_append_read_step_prefetch_without_deadlock(stores, seed) -> None:
    """Several threads for a fixed number of operations each; then every byte is exact."""
    store = stores.open(pool_pages=12, durability="nosync")
    models = [Model(seed + n) for n in range(4)]
    for n, model in enumerate(models):
        for j in range(3):
            seq = f"t{n}-{j}"
            model.create(seq)
            store.create(seq)
            store.append(seq, *model.next_kv(seq, 5))
    start = threading.Barrier(len(models))

    def worker(n: int) -> None:
        model, rng = models[n], random.Random(seed * 31 + n)
        seqs = [f"t{n}-{j}" for j in range(3)]
        start.wait()
        for _ in range(120):
            seq = rng.choice(seqs)
            action = rng.random()
            if action < 0.3:
                append_or_undo(store, model, seq, rng.randint(1, 6))
            elif action < 0.55:
                verify_unless_pinned(store, model, seq)
            elif action < 0.8:
                step_one(store, model, seq)
            else:
                store.prefetch([rng.choice(seqs) for _ in range(2)])

    run_workers(worker, len(models), 90)
    for model in models:
        for seq in model.segs:
            model.verify(store, seq)
    assert store.check() == []
    assert np.isfinite(store.stats()["restore_ms_p99"])
