"""Steps with token ids: the ids every page records, the pages hashed as they fill, against a model.

A decode step writes one id into each of many pages at once and hashes the pages
that filled; prefill steps, steps giving ids for only some sequences, steps with
no ids, forks, truncation, rollbacks, commits and reopening mix with it here. After
each round the store's recorded ids of every page must be the model's (or the page
must say they are unknown), and ``lookup`` of every sequence's ids must find exactly
its full pages whose ids were all given.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.kits.model import Model
from tests.kits.store import GEOM, engine_write

PS = GEOM.page_size


class Boom(Exception):
    pass


class Ids:
    """The model's token ids: per sequence its ids (None where a step gave none)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids: dict[int, list[int | None]] = {}

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(0, 1 << 32) for _ in range(n)]

    def cut(self, seq: int, keep: int) -> None:
        """Truncate: a kept part of a page that had an unknown id stays unknown."""
        row, start = self.ids[seq], keep - keep % PS
        if keep % PS and None in row[start:start + PS]:
            row[start:keep] = [None] * (keep - start)
        del row[keep:]

    def forget_last(self, seq: int) -> None:
        """The ids of a partial last page are no longer known."""
        row = self.ids[seq]
        start = len(row) - len(row) % PS
        row[start:] = [None] * (len(row) - start)

    def known_pages(self, seq: int) -> int:
        """Leading full pages whose every id was given."""
        ids, pages = self.ids[seq], 0
        while (pages + 1) * PS <= len(ids) and None not in ids[pages * PS:(pages + 1) * PS]:
            pages += 1
        return pages


def _check(store, ids: Ids) -> None:
    mgr = store._mgr
    for seq, row in ids.ids.items():
        table = store._seqs[seq].pids[:store._seqs[seq].npages].tolist()
        for index, pid in enumerate(table):
            page_ids = row[index * PS:(index + 1) * PS]
            held = mgr.page_tokens_of(pid)
            if None in page_ids:
                continue  # unknown somewhere: the page may know only some, and must not be hashed
            assert held is not None, f"seq {seq} page {index}: ids lost"
            assert held.tolist() == page_ids, f"seq {seq} page {index}: ids differ"
        known = [t for t in row[:ids.known_pages(seq) * PS]]
        if known:
            assert store.lookup(np.asarray(known + [0], np.int64)) == len(known), \
                f"seq {seq}: lookup misses its hashed pages"


@pytest.mark.parametrize("round_seed", range(3))
def test_steps_with_token_ids_record_every_id_and_hash_every_full_page(stores, seed, round_seed) -> None:
    rng = random.Random(seed * 7 + round_seed)
    print(f"seed {seed} round {round_seed}")
    store = stores.open(pool_pages=96)
    model, ids = Model(seed + round_seed), Ids(rng)
    names = iter(range(10_000))
    batch: list[int] = []
    decoded = 0
    for _ in range(5):
        seq = next(names)
        store.create(seq)
        model.create(seq)
        ids.ids[seq] = []
        batch.append(seq)
    for round_ in range(300):
        action = rng.random()
        if action < 0.05 and len(batch) < 7:  # fork: a shared partial page, copied on write
            src, dst = rng.choice(batch), next(names)
            store.fork(src, dst)
            model.fork(src, dst)
            ids.ids[dst] = list(ids.ids[src])
            batch.append(dst)
        elif action < 0.08 and len(batch) > 2:
            seq = batch.pop(rng.randrange(len(batch)))
            store.drop(seq)
            model.drop(seq)
            del ids.ids[seq]
        elif action < 0.11:
            seq = rng.choice(batch)
            keep = rng.randint(0, len(ids.ids[seq]))
            store.truncate(seq, keep)
            model.undo(seq, keep)
            ids.cut(seq, keep)
        elif action < 0.15:
            store.commit()
        elif action < 0.17:
            store.commit()
            store = stores.reopen(store, pool_pages=96)
        for seq in [s for s in batch if model.lens[s] > 10 * PS]:  # keep every step within the pool
            batch.remove(seq)
            store.drop(seq)
            model.drop(seq)
            del ids.ids[seq]
            seq = next(names)
            store.create(seq)
            model.create(seq)
            ids.ids[seq] = []
            batch.append(seq)
        kind = rng.random()
        if kind < 0.7:  # decode with every id, in the step's order: the vectorised path
            mapping = {seq: 1 for seq in batch}
            given = {seq: ids.fresh(1) for seq in batch}
            decoded += 1
        elif kind < 0.8:  # decode, ids in another order
            mapping = {seq: 1 for seq in batch}
            given = {seq: ids.fresh(1) for seq in reversed(batch)}
        elif kind < 0.9:  # ids for some sequences only
            mapping = {seq: 1 for seq in batch}
            given = {seq: ids.fresh(1) for seq in batch if rng.random() < 0.5}
        else:  # prefill-like counts
            mapping = {seq: rng.randint(0, 2 * PS) for seq in batch}
            given = {seq: ids.fresh(n) for seq, n in mapping.items() if rng.random() < 0.8}
        if not store.can_step(mapping):
            continue
        # A step that writes without ids into a page a fork shares forgets that page's ids for
        # both sequences, and rolling it back does not bring them back (ids are a cache hint):
        # so only steps giving every sequence's ids, or none, are rolled back here.
        fail = rng.random() < 0.05 and (not given or set(given) >= {s for s, n in mapping.items() if n})
        try:
            with store.step(mapping, tokens=given or None) as step:
                kvs = [model.next_kv(seq, n) for seq, n in mapping.items()]
                if fail:
                    raise Boom
                engine_write(store, step, kvs)
        except Boom:
            for seq, n in mapping.items():
                model.undo(seq, model.lens[seq] - n)
                if n and seq not in given:  # the step forgot the last page's ids; undoing keeps that
                    ids.forget_last(seq)
        else:
            for seq, n in mapping.items():
                ids.ids[seq].extend(given.get(seq, [None] * n))
        if round_ % 10 == 0:
            _check(store, ids)
    _check(store, ids)
    model.verify_all(store)
    assert store.check() == []
    assert decoded > 150, f"only {decoded} vectorised decode steps"
    store.commit()
    store = stores.reopen(store, pool_pages=96)
    _check(store, ids)


def test_page_tokens_keeps_ids_through_growth_and_shrinking(seed) -> None:
    from pagedkv.pages.tokens import PageTokens

    rng = np.random.default_rng(seed)
    tokens, want = PageTokens(PS), {}
    for round_ in range(6):
        for pid in range(round_ * 500, round_ * 500 + 500):  # grows the slab past its first sizes
            ids = rng.integers(0, 1 << 32, rng.integers(1, PS + 1), dtype=np.uint64).astype(np.uint32)
            tokens.set(pid, ids)
            want[pid] = ids
        rows = tokens.rows(list(want))
        assert (tokens.owner[rows] == np.array(list(want))).all()
        gone = [pid for pid in want if rng.random() < 0.9]
        tokens.drop_many(gone)  # mostly empty: shrinks, renumbering the rows held
        for pid in gone:
            del want[pid]
        assert len(tokens.lens) <= max(64, 4 * len(want))
        stale = tokens.rows_hinted(np.array(list(want), np.int64), rows[:len(want)])
        assert (tokens.owner[stale] == np.array(list(want))).all(), "a stale hint was trusted"
        past = tokens.rows_hinted(np.array(list(want), np.int64), np.full(len(want), len(tokens.lens) + 7))
        assert (tokens.owner[past] == np.array(list(want))).all(), "a hint past the shrunk slab was trusted"
        for pid, ids in want.items():
            assert tokens.get(pid).tolist() == ids.tolist()
