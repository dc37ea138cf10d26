"""T1: a Hypothesis rule-based state machine run against a plain model of every sequence.

The model keeps, per sequence, the (content key, start, n) segments its tokens
came from, so expected bytes are regenerated. The pool holds 6 pages while the
working set is many times that, so nearly every rule evicts or restores. Rules:
create, append, read, step (the engine writes K/V through slot_mapping; some
steps fail and must roll back), truncate (the model rolls back and later appends
get new content, so bytes left behind by a truncation read back wrong), fork,
drop, commit, clean close/reopen, and a
crash (``_abandon``) after which the model rolls back to the last commit.
Invariants after every rule: ``check() == []`` and the pool accounting adds up.

``PAGEDKV_HYPOTHESIS_EXAMPLES`` raises the number of examples (default 200);
``PAGEDKV_SEED`` replays a run (the seed is printed). Shrinking a failure can take
Hypothesis minutes, so it is off unless ``PAGEDKV_HYPOTHESIS_SHRINK=1``: replay the
printed seed with it set to get a minimal example.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import pagedkv
from pagedkv import PoolExhausted

from tests.kits.content import get_seed
from tests.kits.model import Model
from tests.kits.store import GEOM, check_step_outputs, engine_write



PS = GEOM.page_size
POOL_PAGES = 6
MAX_SEQS = 8
MAX_LEN = 10 * PS  # tokens per sequence: the working set reaches ~80 pages for 6 slots
EXAMPLES = int(os.environ.get("PAGEDKV_HYPOTHESIS_EXAMPLES", "200"))
STEPS = int(os.environ.get("PAGEDKV_HYPOTHESIS_STEPS", "50"))
SHRINK = os.environ.get("PAGEDKV_HYPOTHESIS_SHRINK", "") not in ("", "0")
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else [])

# Totals over every example, to show the run exercised eviction and restore at all.
TOTALS = {"evictions": 0, "restores": 0, "cow_copies": 0, "rollbacks": 0, "crashes": 0, "reopens": 0,
          "steps": 0, "appends": 0, "truncates": 0, "reads": 0, "forks": 0, "drops": 0, "commits": 0, "no_room": 0,
          "examples": 0, "busy_examples": 0}


class Rollback(Exception):
    """Raised inside a step body to make the store roll the step back."""


class StoreMachine(RuleBasedStateMachine):
    content_seed = 0

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pagedkv-sm-")
        self.path = os.path.join(self.dir, "store")
        self.store = self._open(GEOM, POOL_PAGES)
        self.model = Model(self.content_seed)
        self.committed = self._snapshot()
        self.next_id = 0
        self.evictions = 0
        TOTALS["examples"] += 1

    # -- helpers ----------------------------------------------------------------
    def _open(self, geom=None, pool_pages=None) -> pagedkv.KVStore:
        return pagedkv.open(self.path, geom, pool_pages, durability="nosync", evict_batch=2)

    def _snapshot(self) -> tuple:
        """The model as of now: what a reopen after a crash must show once this is committed."""
        m = self.model
        return (copy.deepcopy(m.segs), dict(m.lens), dict(m.keys))

    def _ids(self) -> list:
        return sorted(self.model.segs, key=repr)

    def _new_id(self):
        self.next_id += 1
        return self.next_id if self.next_id % 2 else f"seq-{self.next_id}"

    def _account(self) -> None:
        st_ = self.store.stats()
        self.evictions += st_["evictions"]
        TOTALS["evictions"] += st_["evictions"]
        TOTALS["restores"] += st_["restores"]
        TOTALS["cow_copies"] += st_["cow_copies"]

    # -- rules ----------------------------------------------------------------
    @initialize(sizes=st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=4))
    def seed_sequences(self, sizes: list[int]) -> None:
        """Start with a few sequences, typically already larger than the pool together."""
        for n in sizes:
            self.create()
            seq = self._last
            if n:
                self.store.append(seq, *self.model.next_kv(seq, n))

    @precondition(lambda self: len(self.model.segs) < MAX_SEQS)
    @rule()
    def create(self) -> None:
        seq = self._new_id()
        assert self.store.create(seq) == 0
        self.model.create(seq)
        self._last = seq

    @precondition(lambda self: self.model.segs)
    @rule(data=st.data(), n=st.integers(1, 3 * PS + 1))
    def append(self, data, n: int) -> None:
        seq = data.draw(st.sampled_from(self._ids()), label="seq")
        n = min(n, MAX_LEN - self.model.lens[seq])
        if n <= 0:
            return
        self.store.append(seq, *self.model.next_kv(seq, n))
        assert self.store.length(seq) == self.model.lens[seq]
        TOTALS["appends"] += 1

    @precondition(lambda self: self.model.segs)
    @rule(data=st.data())
    def read(self, data) -> None:
        seq = data.draw(st.sampled_from(self._ids()), label="seq")
        length = self.model.lens[seq]
        start = data.draw(st.integers(0, length), label="start")
        stop = data.draw(st.integers(start, length), label="stop")
        self.model.verify(self.store, seq, start, stop)
        TOTALS["reads"] += 1

    @precondition(lambda self: self.model.segs)
    @rule(data=st.data())
    def step(self, data) -> None:
        ids = self._ids()
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=min(4, len(ids)),
                                    unique=True), label="seqs")
        counts = {}
        for seq in chosen:
            room = MAX_LEN - self.model.lens[seq]
            n = data.draw(st.one_of(st.just(1), st.integers(0, 2 * PS + 1)), label=f"new[{seq!r}]")
            counts[seq] = max(0, min(n, room))
        fail = data.draw(st.integers(0, 7), label="fail") == 0
        if not self.store.can_step(counts):
            with pytest.raises(PoolExhausted):
                with self.store.step(counts):
                    raise AssertionError("a step that cannot fit ran its body")
            TOTALS["no_room"] += 1
            # what a scheduler does next: try a smaller batch
            while chosen and not self.store.can_step(counts):
                counts.pop(chosen.pop())
            if not chosen:
                return
        before = {seq: self.model.lens[seq] for seq in chosen}
        kvs = [self.model.next_kv(seq, counts[seq]) for seq in chosen]
        try:
            with self.store.step(counts) as s:
                check_step_outputs(self.store, s, chosen, before, counts)
                assert self.store.stats()["pool_pinned"] > 0 or not s.block_tables.size
                engine_write(self.store, s, kvs)
                if fail:
                    raise Rollback
        except Rollback:
            for seq in chosen:
                self.model.undo(seq, before[seq])
            TOTALS["rollbacks"] += 1
        TOTALS["steps"] += 1
        for seq in chosen:
            assert self.store.length(seq) == self.model.lens[seq]

    @precondition(lambda self: self.model.segs)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        """Roll a sequence back, often by a few tokens (rejected speculative ones), sometimes far."""
        seq = data.draw(st.sampled_from(self._ids()), label="seq")
        length = self.model.lens[seq]
        new = data.draw(st.one_of(st.integers(max(0, length - PS - 1), length), st.integers(0, length)),
                        label="length")
        self.store.truncate(seq, new)
        m = self.model
        m.undo(seq, new)
        m._gen += 1
        m.keys[seq] = (seq, m._gen)  # what is appended next differs from what was cut
        assert self.store.length(seq) == new
        TOTALS["truncates"] += 1

    @precondition(lambda self: self.model.segs and len(self.model.segs) < MAX_SEQS)
    @rule(data=st.data())
    def fork(self, data) -> None:
        src = data.draw(st.sampled_from(self._ids()), label="src")
        dst = self._new_id()
        self.store.fork(src, dst)
        self.model.fork(src, dst)
        self._last = dst
        TOTALS["forks"] += 1

    # Destructive rules act on one draw in GATE (0 = skip, so shrinking removes them);
    # otherwise they would keep the working set too small to stress the pool.
    @precondition(lambda self: self.model.segs)
    @rule(data=st.data(), go=st.integers(0, 2))
    def drop(self, data, go: int) -> None:
        if go != 2:
            return
        seq = data.draw(st.sampled_from(self._ids()), label="seq")
        self.store.drop(seq)
        self.model.drop(seq)
        TOTALS["drops"] += 1

    @rule(go=st.integers(0, 1))
    def commit(self, go: int) -> None:
        if not go:
            return
        self.store.commit()
        self.committed = self._snapshot()
        TOTALS["commits"] += 1

    @rule(go=st.integers(0, 3))
    def close_reopen(self, go: int) -> None:
        if go != 3:
            return
        self._account()
        self.store.close()
        self.store = self._open()
        self.committed = self._snapshot()
        TOTALS["reopens"] += 1

    @rule(go=st.integers(0, 3))
    def crash_reopen(self, go: int) -> None:
        """An in-process crash: the handle vanishes uncommitted; reopen shows the last commit."""
        if go != 3:
            return
        self._account()
        self.store._abandon()
        self.store = self._open()
        segs, lens, keys = copy.deepcopy(self.committed)
        self.model.segs, self.model.lens, self.model.keys = segs, lens, keys
        TOTALS["crashes"] += 1
        self.model.verify_all(self.store)

    # -- invariants ------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        assert self.store.check() == []
        st_ = self.store.stats()
        assert st_["pool_pinned"] == 0
        assert st_["pool_used"] + st_["pool_free"] + st_["pool_pending"] == POOL_PAGES
        assert st_["sequences"] == len(self.model.segs)
        assert st_["tokens"] == sum(self.model.lens.values())

    def teardown(self) -> None:
        try:
            if not self.store._closed:
                self.model.verify_all(self.store)
                self._account()
                TOTALS["busy_examples"] += self.evictions > 0
                self.store.close()
                # and everything is still there after a clean reopen
                store = self._open()
                try:
                    self.model.verify_all(store)
                    assert store.check() == []
                finally:
                    store.close()
        finally:
            if not self.store._closed:
                self.store._abandon()
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_statemachine_store_matches_model() -> None:
    seed = get_seed("statemachine")
    StoreMachine.content_seed = seed
    for key in TOTALS:
        TOTALS[key] = 0
    machine = hypothesis_seed(seed)(StoreMachine)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                               HealthCheck.data_too_large],
        print_blob=True, phases=PHASES,
    ))
    print("totals:", TOTALS)
    assert TOTALS["evictions"] > 0 and TOTALS["restores"] > 0
    assert TOTALS["cow_copies"] > 0 and TOTALS["rollbacks"] > 0
    assert TOTALS["crashes"] > 0 and TOTALS["reopens"] > 0 and TOTALS["steps"] > 0
    assert TOTALS["truncates"] > 0
