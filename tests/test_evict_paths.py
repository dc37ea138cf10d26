"""The foreground's evictions and write-behind's land through one applier: the same work commits the same state.

``evict.apply_spilled`` applies every committed spill batch. A foreground batch
is planned, written and applied under the store lock; a write-behind batch is
written off it, so what happened to its pages meanwhile (written into, freed,
pinned by a step) is checked for each page as it lands. Two stores start from
one set of files, so they share a seed and their checksums compare, and run the
same randomised operations: one evicts in the foreground only, the other also
through write-behind batches. Those are driven from the test thread (the
thread is never woken), so a run replays from its seed; while a batch's
transaction is open (the ``commit`` I/O seam), pages of the batch are written
into, dropped or pinned by a step, and the first store does the same at that
point. After every commit both stores hold the same committed state, apart
from where each page lives: the same directory entries (fill, checksum, flags,
hashes), block tables and token ids; every read gives the same K/V, and so does
a reopen. With the lossy int8 codec a page's values depend on whether it was
spilled, so there only the layout is compared and the values are close.

The seed is printed; ``PAGEDKV_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import PoolExhausted, faults
from pagedkv.pages.directory import CODEC_SHIFT, NOWHERE, SPILLED
from pagedkv.storage.codec import page_checksum
from pagedkv.storage.metarecord import read_dir_value

from tests.kits.content import get_seed
from tests.kits.draws import Draws
from tests.kits.store import GEOM

PS = GEOM.page_size
VOCAB = 5  # prompts from few token ids share prefixes, so cached pages are found and reused
NO_CODEC = ~(3 << CODEC_SHIFT) & 0xFF  # directory flags without the record codec's bits
Op = Callable[[pagedkv.KVStore], Any]


def committed_state(store: pagedkv.KVStore, exact: bool) -> dict[str, dict[bytes, Any]]:
    """What LMDB holds of the store, less each page's placement and record codec.

    ``exact``: the pages' checksums too (not under a lossy codec, where a page
    spilled once holds its dequantised values).
    """
    mgr = store._mgr
    spill = mgr.spill
    with spill.begin_read() as txn:
        entries = {bytes(k): read_dir_value(bytes(k), bytes(v), mgr.seed) for k, v in spill.iterate(txn, spill.dir)}
        seqs = {bytes(k): bytes(v) for k, v in spill.iterate(txn, spill.seqs)}
        tokens = {bytes(k): bytes(v) for k, v in spill.iterate(txn, spill.tokens)}
    directory = {key: (fill, csum if exact else None, flags & NO_CODEC, digest, parent, chain)
                 for key, (_, fill, csum, flags, digest, parent, chain) in entries.items()}
    return {"dir": directory, "seqs": seqs, "tokens": tokens}


def placements_are_sound(store: pagedkv.KVStore) -> None:
    """A resident page's committed placement is its own slot, SPILLED or NOWHERE: never another slot.

    The applier relies on it: a page's committed bytes are either where it lives,
    in its record, or nowhere yet.
    """
    mgr = store._mgr
    rows = np.flatnonzero(mgr.live & (mgr.slot >= 0))
    where = mgr.c_where[rows]
    assert ((where == mgr.slot[rows]) | (where == SPILLED) | (where == NOWHERE)).all()


class Twin:
    """Two stores from one set of files: ``fg`` evicts in the foreground, ``wb`` also through write-behind."""

    def __init__(self, root: Path, seed: int, codec: str, pool_pages: int = 12) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.draws = Draws(self.rng, self.np_rng, GEOM, VOCAB)
        self.exact = codec != "int8"
        self.options: dict[str, Any] = {"durability": "nosync", "evict_batch": 3, "spill_codec": codec}
        self.paths = (root / "fg", root / "wb")
        pagedkv.open(self.paths[0], GEOM, pool_pages=pool_pages, **self.options).close()
        shutil.copytree(self.paths[0], self.paths[1])  # the same store: one uuid, one seed
        self.fg, self.wb = self.open()
        self.next_id = 0
        self.counts: dict[str, int] = {}

    def open(self) -> tuple[pagedkv.KVStore, pagedkv.KVStore]:
        fg = pagedkv.open(self.paths[0], **self.options)
        wb = pagedkv.open(self.paths[1], write_behind=True, **self.options)
        wb._write_behind.low_water = 0  # never wakes the thread: the test runs each batch itself
        return fg, wb

    def close(self) -> None:
        self.fg.close()
        self.wb.close()

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # -- random inputs, drawn once and given to both stores -----------------------------------
    def kv(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.draws.kv(n)

    def ids(self, n: int) -> list[int]:
        return self.draws.ids(n)

    def seqs(self) -> list[Any]:
        seqs = sorted(self.fg.sequences(), key=repr)
        assert seqs == sorted(self.wb.sequences(), key=repr)
        return seqs

    def both(self, op: Op) -> Any:
        """Run ``op`` on both stores: the same outcome, the same result."""
        outcomes = []
        for store in (self.fg, self.wb):
            try:
                outcomes.append(("ok", op(store)))
            except PoolExhausted:
                outcomes.append(("refused", None))
        (kind, first), (kind_wb, second) = outcomes
        assert kind == kind_wb, f"one store refused what the other did: {outcomes}"
        if kind == "ok":
            self.same(first, second)
        return first

    def same(self, first: Any, second: Any) -> None:
        if isinstance(first, tuple) and first and isinstance(first[0], np.ndarray):
            for a, b in zip(first, second):
                if self.exact:
                    assert np.array_equal(a, b)
                else:
                    np.testing.assert_allclose(a, b, atol=0.1)
        else:
            assert first == second

    # -- the operations ---------------------------------------------------------------------
    def run(self, operations: int) -> dict[str, int]:
        ops = [(self.create, 3), (self.append, 5), (self.step, 5), (self.fork, 1), (self.drop, 2),
               (self.truncate, 1), (self.clear_cache, 1), (self.read, 2), (self.batch, 6),
               (self.commit, 3), (self.reopen, 1)]
        names, weights = [op for op, _ in ops], [w for _, w in ops]
        for _ in range(operations):
            op = self.rng.choices(names, weights)[0]
            op()
            self.count(op.__name__)
        self.commit()
        self.reopen()
        for seq in self.seqs():
            self.both(lambda s: s.read(seq, 0, s.length(seq)))
        self.close()
        return self.counts

    def create(self) -> None:
        if len(self.seqs()) >= 8:
            return
        self.next_id += 1
        seq = self.next_id if self.rng.random() < 0.5 else f"s{self.next_id}"
        if self.rng.random() < 0.5:  # a prompt: its cached prefix is shared, the rest appended with ids
            prompt = self.ids(self.rng.randint(1, 4 * PS))
            k, v = self.kv(len(prompt))

            def create(store: pagedkv.KVStore) -> int:
                reused: int = store.create(seq, tokens=prompt)
                store.append(seq, k[:, reused:], v[:, reused:], tokens=prompt[reused:])
                return reused

            self.both(create)
        else:
            self.both(lambda s: s.create(seq))

    def append(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq, n, tokens = self.draws.append(seqs, PS)
            k, v = self.kv(n)
            self.both(lambda s: s.append(seq, k, v, tokens=tokens))

    def step(self) -> None:
        seqs = self.seqs()
        if not seqs:
            return
        counts, tokens, fail = self.draws.step(seqs, PS)
        k, v = self.kv(sum(counts.values()))

        def step(store: pagedkv.KVStore) -> None:
            try:
                with store.step(counts, tokens=tokens) as s:
                    engine_write(store, s.slot_mapping, k, v)
                    if fail:
                        raise Rollback
            except Rollback:
                pass

        self.both(step)

    def fork(self) -> None:
        seqs = self.seqs()
        if seqs and len(seqs) < 8:
            self.next_id += 1
            src, dst = self.rng.choice(seqs), f"f{self.next_id}"
            self.both(lambda s: s.fork(src, dst))

    def drop(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq = self.rng.choice(seqs)
            self.both(lambda s: s.drop(seq))

    def truncate(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq = self.rng.choice(seqs)
            length = self.rng.randint(0, self.fg.length(seq))
            self.both(lambda s: s.truncate(seq, length))

    def clear_cache(self) -> None:
        # Every droppable page: the same ones in both (their bytes and slots depend on placement).
        self.both(lambda s: s.clear_cache(None)["pages"])

    def read(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq = self.rng.choice(seqs)
            self.both(lambda s: s.read(seq, 0, s.length(seq)))

    def batch(self) -> None:
        """One write-behind batch on ``wb``; while its transaction is open, work on its pages (both stores)."""
        wb = self.wb._write_behind
        done: list[Op] = []
        pinned: list[Any] = []  # sequences in the steps opened meanwhile
        with ExitStack() as steps:
            def meanwhile(op: str) -> None:
                if op == "commit" and armed:
                    armed.clear()
                    wb.low_water = 0  # a slot taken meanwhile must not wake the thread either
                    done.extend(self.meanwhile(steps, pinned))

            armed = [True]
            faults.set_injector(meanwhile)
            try:
                wb.low_water = self.wb._mgr.pool_pages + 1
                landed = wb._batch()
            finally:
                wb.low_water = 0
                faults.set_injector(None)
            for op in done:
                op(self.fg)  # the same work, at the same point of the foreground store's run
            if landed:
                self.count("batches landed")
            for store in (self.fg, self.wb):  # the pages of a sequence in a step stay in the pool
                for seq in pinned:
                    assert (store._mgr.slot[store._seqs.find(seq).table] >= 0).all(), "a pinned page left"
            # Steps opened meanwhile end now, in both stores.
        assert self.wb._write_behind.error is None

    def meanwhile(self, steps: ExitStack, pinned: list[Any]) -> list[Op]:
        """Work on ``wb`` during a batch's transaction; return it, to be done on ``fg`` as well.

        Steps it opens go on ``steps``, their sequences on ``pinned``.

        Nothing here may evict or write LMDB (the transaction is open on this
        thread): writes stay inside a page's free tail, and steps only pin pages
        that are resident already.
        """
        mgr = self.wb._mgr
        batch = set(mgr.slot_pid[np.flatnonzero(mgr.bg_pins > 0)].tolist()) - {-1}
        tables = {seq.seq_id: seq.table for seq in self.wb._seqs.values()}
        touched = sorted((seq for seq, table in tables.items() if batch & set(table.tolist())), key=repr)
        ops: list[Op] = []
        for seq in self.rng.sample(touched, min(len(touched), 3)):
            table, length = tables[seq], self.wb.length(seq)
            action = self.rng.choice(["write", "drop", "pin"])
            room = -length % PS
            if action == "write" and room and int(table[-1]) in batch and mgr.ref[table[-1]] == 1:
                k, v = self.kv(self.rng.randint(1, room))
                ops.append(lambda s, seq=seq, k=k, v=v: s.append(seq, k, v))
            elif action == "drop":
                ops.append(lambda s, seq=seq: s.drop(seq))
            elif (action == "pin" and (mgr.slot[table] >= 0).all() and len(mgr.free_slots) >= 2
                  and self.wb.can_step({seq: 1})):
                k, v = self.kv(1)
                ops.append(lambda s, seq=seq, k=k, v=v: open_step(s, steps, seq, k, v))
                pinned.append(seq)
            else:
                continue
            ops[-1](self.wb)
            self.count(f"meanwhile {action}")
        return ops

    def commit(self) -> None:
        self.both(lambda s: s.commit())
        for store in (self.fg, self.wb):
            assert store.check() == []
            placements_are_sound(store)
        self.same(committed_state(self.fg, self.exact), committed_state(self.wb, self.exact))
        self.count("compared")

    def reopen(self) -> None:
        self.close()
        self.fg, self.wb = self.open()
        self.same(committed_state(self.fg, self.exact), committed_state(self.wb, self.exact))
        assert self.fg.check() == [] and self.wb.check() == []


class Rollback(Exception):
    """Raised inside a step to make the store roll it back."""


def engine_write(store: pagedkv.KVStore, mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """What an engine does inside a step: the new tokens' K/V into the pool at the slot mapping."""
    slots, offsets = np.divmod(mapping, PS)
    store.pool[slots, :, 0, offsets] = k.transpose(1, 0, 2, 3)
    store.pool[slots, :, 1, offsets] = v.transpose(1, 0, 2, 3)


def open_step(store: pagedkv.KVStore, steps: ExitStack, seq: Any, k: np.ndarray, v: np.ndarray) -> None:
    """Enter a one-token step on ``seq`` that ``steps`` ends (its K/V written first)."""
    step = steps.enter_context(store.step({seq: 1}))
    steps.callback(engine_write, store, step.slot_mapping, k, v)


@pytest.mark.parametrize("codec", ["raw", "zstd", "int8"])
def test_foreground_and_write_behind_commit_the_same_state(tmp_path: Path, codec: str) -> None:
    seed = get_seed(f"eviction paths, {codec}")
    twin = Twin(tmp_path, seed, codec)
    counts = twin.run(300)
    assert counts.get("compared", 0) >= 15, counts
    assert counts.get("batches landed", 0) >= 10, counts
    assert sum(counts.get(f"meanwhile {what}", 0) for what in ("write", "drop", "pin")) >= 5, counts


@pytest.mark.slow
@pytest.mark.parametrize("run", range(6))
def test_foreground_and_write_behind_commit_the_same_state_long(tmp_path: Path, run: int) -> None:
    codec = ("raw", "zstd", "int8")[run % 3]
    Twin(tmp_path, get_seed(f"eviction paths, long run {run}"), codec, pool_pages=10 + 6 * (run % 2)).run(1500)


def test_a_victim_taken_out_of_a_lossy_batch_keeps_its_checksums(stores, seed) -> None:
    """Under the cap a resident cache page may stand in for a victim: the victim stays as it was.

    Its int8 record was planned, with the dequantised checksums that would have
    come with it; taken out of the batch, the page still holds its own values, so
    it must keep its own checksums (a served pool re-checks them on every read).
    """
    store = stores.open(pool_pages=8, evict_batch=2, spill_codec="int8", spill_limit_bytes=1)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((GEOM.layers, 28, GEOM.kv_heads, GEOM.head_dim)).astype(GEOM.np_dtype)
    store.create("a")
    store.append("a", k[:, :16], -k[:, :16])
    store.commit()
    store.create("c")
    store.append("c", k[:, :8], k[:, :8], tokens=list(range(8)))
    store.commit()
    store.drop("c")
    store.commit()  # c's pages are cache-only now, and used more recently than a's
    store.pool  # served: every read re-checks the committed tokens of the pages it serves
    store.append("a", k[:, 16:], -k[:, 16:])  # evicts: the cap drops c's pages instead of spilling a's
    stats = store.stats()
    assert stats["cache_drops"] == 2 and stats["bytes_spilled"] == 0
    mgr = store._mgr
    for pid in store._seqs.find("a").table.tolist():
        slot = int(mgr.slot[pid])
        assert slot >= 0 and mgr.rec[pid] == 0
        if mgr.csum_ok[pid]:  # the pages written by the append have theirs computed when needed
            assert page_checksum(mgr.pool[slot], int(mgr.fill[pid]), int(mgr.uid[pid]), mgr.seed) == mgr.csum[pid]
        if mgr.c_where[pid] != NOWHERE:
            assert page_checksum(mgr.pool[slot], int(mgr.c_fill[pid]), int(mgr.uid[pid]), mgr.seed) == mgr.c_csum[pid]
        assert mgr.codec[pid] == 0
    got_k, got_v = store.read("a", 0, 28)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, -k)


@pytest.mark.parametrize("meanwhile", ["pinned", "written"])
def test_a_page_that_stays_resident_while_its_lossy_record_is_written_keeps_its_bytes(
        stores, seed, meanwhile: str) -> None:
    """A step pins (or an append writes) the page of a write-behind batch during its transaction:
    the page stays resident with its own bytes and checksums, its lossy record is not taken for
    them, and the next commit makes it resident on disk too."""
    store = stores.open(pool_pages=16, evict_batch=4, spill_codec="int8", write_behind=True)
    wb = store._write_behind
    wb.low_water = 0  # the test runs the batch itself
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((GEOM.layers, 2 * PS, GEOM.kv_heads, GEOM.head_dim)).astype(GEOM.np_dtype)
    store.create("a")
    store.append("a", k[:, :2 * PS - 1], -k[:, :2 * PS - 1])  # a full page, then a partial one
    store.commit()
    with ExitStack() as steps:
        def meddle(op: str) -> None:
            if op == "commit" and not done:
                wb.low_water = 0
                if meanwhile == "pinned":  # both pages, for the step's token into the partial one
                    done.append(steps.enter_context(store.step({"a": 1})))
                else:  # the partial page, while the full one leaves the pool
                    store.append("a", k[:, 2 * PS - 1:], -k[:, 2 * PS - 1:])
                    done.append(None)

        done: list[pagedkv.Step | None] = []
        faults.set_injector(meddle)
        try:
            wb.low_water = store._mgr.pool_pages + 1
            assert wb._batch()
        finally:
            faults.set_injector(None)
            wb.low_water = 0
        assert done and store.stats()["background_evictions"] == (meanwhile == "written")
        if done[0] is not None:
            engine_write(store, done[0].slot_mapping, k[:, 2 * PS - 1:], -k[:, 2 * PS - 1:])
    exact = 0 if meanwhile == "pinned" else PS  # tokens of the page that left are its dequantised values
    assert store.pool is not None  # handed out, as an engine has it: reads re-check committed tokens
    assert store.check() == []
    for handle in (store, None):
        if handle is None:
            store.commit()
            handle = stores.reopen(store)  # the commit made the page that stayed resident on disk too
            assert handle.check() == []
        got_k, got_v = handle.read("a")  # the pool was served: the committed tokens are re-checked
        assert np.array_equal(got_k[:, exact:], k[:, exact:]) and np.array_equal(got_v[:, exact:], -k[:, exact:]), \
            "the page that stayed resident lost its own bytes"
        np.testing.assert_allclose(got_k, k, atol=0.1)
