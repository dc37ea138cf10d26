"""A small decode step is planned with Python ints, a large one with numpy: both must do the same.

``step.py`` plans a decode step of at most ``_FEW`` sequences row by row (numpy's
per-call cost dominates there) and every other step with arrays. This runs one
random workload of small decode steps twice, once as it is and once with the
Python-int plan switched off, and requires the same results: every step's outputs
valid, every sequence's bytes and token ids the model's, the same prefix lookups,
the same committed state after a reopen, and ``check()`` clean.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import pagedkv.stepplan
from pagedkv import PoolExhausted

from tests.kits.model import Model
from tests.kits.store import GEOM, check_step_outputs, engine_write

PS = GEOM.page_size


class Boom(Exception):
    pass


def _run(stores, name: str, seed: int) -> tuple[list, dict]:
    """The workload; returns what each step reported and, per sequence, its ids and lookup."""
    rng = random.Random(seed)
    store = stores.open(name, pool_pages=40)
    model = Model(seed)
    names = iter(range(10_000))
    batch: list[int] = []
    ids: dict[int, list[int | None]] = {}
    reported: list = []
    few_steps = 0
    for _ in range(3):
        seq = next(names)
        store.create(seq)
        model.create(seq)
        ids[seq] = []
        batch.append(seq)
    for round_ in range(250):
        action = rng.random()
        if action < 0.06 and len(batch) < 4:  # a shared partial page: the next step copies it
            src, dst = rng.choice(batch), next(names)
            store.fork(src, dst)
            model.fork(src, dst)
            ids[dst] = list(ids[src])
            batch.append(dst)
        elif action < 0.09 and len(batch) > 1:
            seq = batch.pop(rng.randrange(len(batch)))
            store.drop(seq)
            model.drop(seq)
            del ids[seq]
        elif action < 0.12:
            store.commit()
        elif action < 0.14:
            store.commit()
            store = stores.reopen(store, pool_pages=40)
        elif action < 0.16:
            rng.shuffle(batch)
        for seq in [s for s in batch if model.lens[s] > 6 * PS]:  # keep every step within the pool
            batch.remove(seq)
            store.drop(seq)
            model.drop(seq)
            del ids[seq]
            seq = next(names)
            store.create(seq)
            model.create(seq)
            ids[seq] = []
            batch.append(seq)
        mapping = {seq: 1 for seq in batch}
        given = {seq: [rng.randrange(1 << 32)] for seq in batch} if rng.random() < 0.7 else None
        fail = rng.random() < 0.05
        before = {seq: model.lens[seq] for seq in batch}
        try:
            with store.step(mapping, tokens=given) as step:
                check_step_outputs(store, step, list(mapping), before, mapping)
                reported.append((step.seq_lens.tolist(), step.block_tables.shape))
                kvs = [model.next_kv(seq, 1) for seq in batch]
                if fail:
                    raise Boom
                engine_write(store, step, kvs)
        except Boom:
            for seq in batch:
                model.undo(seq, before[seq])
                if given is None and before[seq] % PS:  # the step forgot the page's ids
                    ids[seq][before[seq] - before[seq] % PS:] = [None] * (before[seq] % PS)
        except PoolExhausted:
            pytest.fail("the workload is sized to fit the pool")
        else:
            few_steps += 1
            for seq in batch:
                ids[seq].append(given[seq][0] if given else None)
        if round_ % 25 == 0:
            model.verify_all(store)
    model.verify_all(store)
    assert store.check() == []
    assert few_steps > 150
    store.commit()
    store = stores.reopen(store, pool_pages=40)
    model.verify_all(store)
    seen = {}
    for seq, row in ids.items():
        known = 0
        while (known + 1) * PS <= len(row) and None not in row[known * PS:(known + 1) * PS]:
            known += 1
        query = np.asarray([t for t in row[:known * PS]] + [0], np.int64)
        seen[seq] = (row, store.lookup(query) if known else 0)
        assert seen[seq][1] == known * PS, f"seq {seq}: {seen[seq][1]} of {known * PS} hashed tokens found"
    return reported, seen


def test_small_decode_steps_plan_the_same_with_python_ints_and_with_numpy(stores, seed, monkeypatch) -> None:
    print(f"seed {seed}")
    assert pagedkv.stepplan._FEW >= 3, "the workload's batches of 1-4 must take the Python-int plan"
    as_is = _run(stores, "python-ints", seed)
    monkeypatch.setattr(pagedkv.stepplan, "_FEW", 0)  # every step takes the numpy plan
    vectorised = _run(stores, "numpy", seed)
    assert as_is == vectorised


@pytest.mark.parametrize("interleaved_read", [False, True])
def test_a_running_batch_stays_most_recently_used(stores, interleaved_read: bool) -> None:
    """Steps of the same batch skip re-stamping their slots while no other slot was used; an
    eviction after them must still take the idle sequence's pages, never the batch's."""
    store = stores.open(pool_pages=40, evict_batch=1)  # each eviction takes the single oldest slot
    k = np.zeros((GEOM.layers, 16 * PS, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
    store.create("idle")
    store.append("idle", k[:, :6 * PS], k[:, :6 * PS])  # 6 pages, used before the batch
    batch = {name: 1 for name in range(5)}  # 5 sequences, beyond the Python-int plan
    for name in batch:
        store.create(name)
        store.append(name, k[:, :PS + 1], k[:, :PS + 1])  # 2 pages each
    for index in range(2 * PS):  # many steps of one batch, crossing pages: some slots are new
        with store.step(batch):
            pass  # the bytes do not matter here, only which slots the step used
        if interleaved_read and index == 2 * PS - 2:
            store.read("idle")  # slots used between steps: the next step stamps the batch's again
    assert store.stats()["evictions"] == 0
    store.create("late")
    store.append("late", k, k)  # 16 new pages beside the 26 held: two evictions
    mgr = store._mgr
    batch_pids = np.concatenate([store._seqs.find(name).table for name in batch])
    assert (mgr.slot[batch_pids] >= 0).all(), "an eviction took a page of the running batch"
    idle = store._seqs.find("idle").table
    assert (mgr.slot[idle] < 0).sum() == store.stats()["evictions"] == 2, \
        "the idle sequence's pages were not the victims"
