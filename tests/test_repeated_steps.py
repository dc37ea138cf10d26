"""Steps over the same batch of sequences: the reused block table and the batched new pages.

A decode loop steps the same sequences again and again; the store then reuses
the last step's sequences, lengths and block table, and gives the rows that
cross a page boundary their new pages in one batch. Anything that changes a
block table between steps must invalidate that, so this drives a random mix of
repeated steps and outside changes and checks every step's outputs and every
sequence's bytes against a model.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import PoolExhausted, SequenceBusy

from tests.kits.model import Model
from tests.kits.store import GEOM, check_step_outputs, engine_write



PS = GEOM.page_size


class Boom(Exception):
    pass


def _step(store, model: Model, mapping: dict, fail: bool) -> bool:
    """One step of ``mapping``; the engine writes the new K/V (or raises: rolled back)."""
    before = {seq: model.lens[seq] for seq in mapping}
    try:
        with store.step(mapping) as step:
            check_step_outputs(store, step, list(mapping), before, mapping)
            kvs = [model.next_kv(seq, count) for seq, count in mapping.items()]
            if fail:
                raise Boom
            engine_write(store, step, kvs)
    except Boom:
        for seq, length in before.items():
            model.undo(seq, length)
        return False
    return True


def test_repeated_steps_with_outside_changes_match_the_model(stores, seed) -> None:
    rng = random.Random(seed)
    store = stores.open(pool_pages=48)
    model = Model(seed)
    names = iter(range(10_000))
    batch: list = []
    for _ in range(4):
        seq = next(names)
        store.create(seq)
        model.create(seq)
        batch.append(seq)
    reused = fresh_crossings = 0
    for round_ in range(400):
        action = rng.random()
        if action < 0.06 and batch:  # append outside a step
            seq = rng.choice(batch)
            store.append(seq, *model.next_kv(seq, rng.randint(1, 2 * PS)))
        elif action < 0.10 and batch and len(batch) < 6:  # fork: a shared partial page, copy on write
            src, dst = rng.choice(batch), next(names)
            store.fork(src, dst)
            model.fork(src, dst)
            batch.append(dst)
        elif action < 0.13 and len(batch) > 1:  # drop a member
            seq = batch.pop(rng.randrange(len(batch)))
            store.drop(seq)
            model.drop(seq)
        elif action < 0.16 and len(batch) < 6:  # a new empty member
            seq = next(names)
            store.create(seq)
            model.create(seq)
            batch.append(seq)
        elif action < 0.18:
            rng.shuffle(batch)  # the same sequences in another order is another batch
        elif action < 0.20:
            store.commit()
        if not batch:
            continue
        for seq in [s for s in batch if model.lens[s] > 9 * PS]:  # keep every step within the pool
            batch.remove(seq)
            store.drop(seq)
            model.drop(seq)
            seq = next(names)
            store.create(seq)
            model.create(seq)
            batch.append(seq)
        mapping = {seq: (1 if rng.random() < 0.85 else rng.randint(0, 2 * PS)) for seq in batch}
        if not store.can_step(mapping):
            with pytest.raises(PoolExhausted):
                with store.step(mapping):
                    pass
            continue
        last = store._seqs.batch
        reused += last is not None and last.seq_ids == batch and last.table_epoch == store._seqs.epoch
        fresh_crossings += sum(model.lens[s] % PS == 0 and n == 1 for s, n in mapping.items())
        _step(store, model, mapping, fail=rng.random() < 0.05)
        if round_ % 25 == 0:
            model.verify_all(store)
    model.verify_all(store)
    assert store.check() == []
    # the loop must have exercised what it is about
    assert reused > 100, f"only {reused} steps reused the last batch"
    assert fresh_crossings > 50, f"only {fresh_crossings} decode rows crossed into a new page"
    print(f"steps reusing the last batch: {reused}; decode page crossings: {fresh_crossings}")


def test_nested_step_of_the_same_batch_is_busy(store) -> None:
    model = Model(7)
    for seq in ("a", "b", "c"):
        store.create(seq)
        model.create(seq)
    assert _step(store, model, {"a": 1, "b": 1}, fail=False)
    with store.step({"a": 1, "b": 1}) as step:  # reuses the last batch
        kvs = [model.next_kv("a", 1), model.next_kv("b", 1)]
        with pytest.raises(SequenceBusy):
            with store.step({"a": 1, "b": 1}):
                pass
        with pytest.raises(SequenceBusy):
            store.append("b", *kv_of(model, "c"))
        assert not store.can_step({"b": 1})
        assert store.can_step({"c": 1})
        engine_write(store, step, kvs)
    assert store.can_step({"a": 1, "b": 1})
    assert _step(store, model, {"a": 1, "b": 1}, fail=False)
    model.verify_all(store)


def kv_of(model: Model, seq) -> tuple:
    """K/V of one token that no sequence will hold (the append is refused)."""
    k, v = model.next_kv(seq, 1)
    model.undo(seq, model.lens[seq] - 1)
    return k, v


def test_step_without_ids_forgets_ids_of_a_reopened_partial_page(stores) -> None:
    """A step that writes tokens without ids into a page whose earlier ids are known (from
    before a reopen) must leave that page unshareable: its ids are no longer all known."""
    store = stores.open(pool_pages=8)
    model = Model(11)
    store.create("a")
    model.create("a")
    ids = list(range(100, 100 + PS + 2))  # one full page and two tokens of the next, with ids
    store.append("a", *model.next_kv("a", PS + 2), tokens=ids)
    store = stores.reopen(store)
    for _ in range(PS - 2):  # fill the partial page through steps that give no ids
        _step(store, model, {"a": 1}, fail=False)
    assert store.length("a") == 2 * PS
    from pagedkv.pages.manager import HAS_TOKENS

    second = int(store._seqs["a"].pids[1])
    assert not store._mgr.flags[second] & HAS_TOKENS, "the page still claims to know every id"
    # only the first page may be served: the second's last ids were never given
    assert store.lookup(ids[:PS + 2] + [7] * (PS - 2) + [0]) == PS
    store = stores.reopen(store)
    assert store.lookup(ids[:PS + 2] + [7] * (PS - 2) + [0]) == PS
    model.verify_all(store)


class _Id(int):
    """An int subclass: names the sequence its value names (``Sequences.find``)."""


@pytest.mark.parametrize("width", [1, 6])  # the Python-int plan and the vectorised one
@pytest.mark.parametrize("other", [True, 1.0, np.int64(1), _Id(1)], ids=["bool", "float", "np.int64", "int-subclass"])
def test_an_id_equal_to_the_last_batchs_but_of_another_type_is_judged_as_on_a_fresh_batch(
        stores, width: int, other: object) -> None:
    """``True == 1.0 == 1``: the reuse of the last batch must not let such an id through, or refuse one.

    The same step is tried on a store whose last batch holds the int ids and on one
    with no last batch; both must give the same answer (the error, or the step).
    """
    outcomes = []
    for warm in (False, True):
        store = stores.open(name=f"s-{warm}", pool_pages=32)
        seqs = list(range(width)) if width > 1 else [1]
        for seq in seqs:
            store.create(seq)
        if warm:
            with store.step({seq: 1 for seq in seqs}):
                pass
        mapping = {(other if seq == 1 else seq): 1 for seq in seqs}
        try:
            with store.step(mapping) as step:
                outcomes.append(("stepped", step.seq_lens.shape))
        except Exception as exc:  # the outcome compared is the error itself
            outcomes.append((type(exc).__name__, str(exc)))
        store.close()
    assert outcomes[0] == outcomes[1], f"{other!r}: a fresh batch gives {outcomes[0]}, a reused one {outcomes[1]}"
