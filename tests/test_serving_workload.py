"""A random serving workload: 200 sequences, a pool of ~5% of the working set.

Prefills and decode steps (the engine writes K/V through slot_mapping), plain
appends, reads, forks and drops, with several close/reopen cycles and one
in-process crash. At the end every token ever appended (and not dropped or
lost to the crash) reads back bit-exact. The seed is printed; ``PAGEDKV_SEED``
replays it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import pagedkv

from tests.kits.model import Model
from tests.kits.store import GEOM, check_step_outputs, engine_write



PS = GEOM.page_size
SEQS = 200
POOL_PAGES = 300  # about 5% of the ~6000 pages the working set ends with
ROUNDS = 5  # close/reopen cycles (one of them a crash)
OPS_PER_ROUND = 500


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workload_many_sequences_under_pressure(stores, seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = Model(seed)
    store = stores.open(pool_pages=POOL_PAGES)
    totals = {"evictions": 0, "restores": 0, "steps": 0, "reads": 0, "no_room": 0}
    committed = None
    ids = list(range(SEQS))
    for seq in ids:  # half of the prompts arrive as plain appends, half are prefilled in steps
        store.create(seq)
        model.create(seq)
    next_id = SEQS

    def pick(n: int) -> list:
        live = sorted(model.segs, key=repr)
        return [live[i] for i in rng.choice(len(live), size=min(n, len(live)), replace=False)]

    def account(s: pagedkv.KVStore) -> None:
        st = s.stats()
        totals["evictions"] += st["evictions"]
        totals["restores"] += st["restores"]

    for rnd in range(ROUNDS):
        for _ in range(OPS_PER_ROUND):
            op = rng.random()
            if op < 0.40:  # a step: one prefill now and then, mostly decodes
                batch = pick(int(rng.integers(1, 12)))
                counts = {}
                for seq in batch:
                    fresh = model.lens[seq] == 0
                    counts[seq] = int(rng.integers(4, 40)) if fresh or rng.random() < 0.1 else 1
                while batch and not store.can_step(counts):
                    counts.pop(batch.pop())
                if not batch:
                    totals["no_room"] += 1
                    continue
                before = {seq: model.lens[seq] for seq in batch}
                kvs = [model.next_kv(seq, counts[seq]) for seq in batch]
                with store.step(counts) as s:
                    check_step_outputs(store, s, batch, before, counts)
                    engine_write(store, s, kvs)
                totals["steps"] += 1
            elif op < 0.65:  # a plain append, spanning pages
                (seq,) = pick(1)
                store.append(seq, *model.next_kv(seq, int(rng.integers(1, 3 * PS))))
            elif op < 0.90:  # a read of a random range
                (seq,) = pick(1)
                n = model.lens[seq]
                start = int(rng.integers(0, n + 1))
                stop = int(rng.integers(start, n + 1))
                model.verify(store, seq, start, stop)
                totals["reads"] += 1
            elif op < 0.95:  # fork a sequence (shares its pages)
                (src,) = pick(1)
                store.fork(src, f"f{next_id}")
                model.fork(src, f"f{next_id}")
                next_id += 1
            elif op < 0.98 and len(model.segs) > SEQS // 2:
                (seq,) = pick(1)
                store.drop(seq)
                model.drop(seq)
            else:
                store.commit()
                committed = copy.deepcopy((model.segs, model.lens, model.keys))
        account(store)
        if rnd == 2 and committed is not None:  # an in-process crash: back to the last commit
            store._abandon()
            store = stores.open(geom=None, pool_pages=None)
            model.segs, model.lens, model.keys = copy.deepcopy(committed)
        else:
            store = stores.reopen(store)
        assert store.check() == []
    pages = sum(-(-n // PS) for n in model.lens.values())
    print(f"totals={totals} sequences={len(model.segs)} tokens={sum(model.lens.values())} "
          f"pages~{pages} pool={POOL_PAGES}")
    assert pages > 10 * POOL_PAGES, "the working set did not outgrow the pool"
    model.verify_all(store)
    account(store)
    assert totals["evictions"] > 0 and totals["restores"] > 0 and totals["steps"] > 0
    assert store.check() == []
