"""A commit visits only the rows the page table noted: what it writes must equal what a full scan gives.

``persist.commit`` reads the rows to write from ``PageTable.changed`` and the
refcounts to carry from ``PageTable.refs_moved`` instead of scanning every
directory row, and extends the free list instead of rebuilding it. A path that
changes a page without noting it would leave the disk behind memory, silently,
until a reopen. So a randomised run of every operation that moves pages
(create with and without a cached prompt, append with and without token ids,
steps with and without ids, some rolled back, fork, drop, truncate, cache
drops, evictions and restores through a small pool, commits, reopens) checks at
every commit:

- before it: the rows noted are exactly the old full scan ``chg & live``, and
  every live page whose state differs from its committed one is among them;
- after it: the full scan of the old commit (every live row committed as it
  is now, ``c_ref == ref`` on every row, the free list rebuilt from every slot)
  gives what the incremental commit left, and LMDB holds exactly the entries,
  block tables, token lists and records that state implies;
- a read-only handle opened on the store then shows exactly the writer's state.

The seed is printed; ``PAGEDKV_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import pagedkv
from pagedkv import PoolExhausted, StoreFull
from pagedkv.geometry import Geometry
from pagedkv.pages import persist
from pagedkv.pages.directory import HAS_TOKENS, NOWHERE, REC_NONE, SPILLED
from pagedkv.pages.manager import BlockManager
from pagedkv.storage.metarecord import TAG_SEQS, TAG_TOKENS, seal
from pagedkv.storage.spill import uid_key

from tests.kits.content import get_seed
from tests.kits.draws import Draws

GEOM = Geometry(layers=2, kv_heads=1, head_dim=4, page_size=4, dtype="float16")
PS = GEOM.page_size
VOCAB = 5  # prompts from few token ids share prefixes, so cached pages are found and reused


class Rollback(Exception):
    """Raised inside a step to make the store roll it back."""


# -- the oracle: what the old full-scan commit computed, and what the disk must hold -------------

def full_scan_changed(mgr: BlockManager) -> np.ndarray:
    """The rows the old commit wrote: every live row marked changed, found by scanning the column."""
    return np.flatnonzero(mgr.chg & mgr.live)


def differs_from_committed(mgr: BlockManager) -> np.ndarray:
    """Live rows whose current entry is not the committed one (each must be written by the next commit)."""
    where = np.where(mgr.slot >= 0, mgr.slot, SPILLED)
    return np.flatnonzero(mgr.live & ((where != mgr.c_where) | (mgr.fill != mgr.c_fill)
                                      | (mgr.flags != mgr.c_flags) | (mgr.csum_ok & (mgr.csum != mgr.c_csum))))


def check_spare_rows(mgr: BlockManager) -> None:
    """Every spare row holds every column's default: a new page takes one as it is."""
    spare = np.frombuffer(mgr.free_pids, np.int64)
    for column, default in mgr._defaults:
        assert column[spare].tobytes() == np.full(len(spare), default, column.dtype).tobytes(), \
            "a spare directory row holds a value a new page would inherit"


def check_before_commit(mgr: BlockManager) -> None:
    check_spare_rows(mgr)
    noted = mgr.changed.rows()
    written = noted[mgr.chg[noted] & mgr.live[noted]]
    assert np.array_equal(written, full_scan_changed(mgr)), "a row marked changed was not noted"
    assert set(differs_from_committed(mgr).tolist()) <= set(written.tolist()), \
        "a page changed without being marked for the next commit"
    moved = set(mgr.refs_moved.rows().tolist())
    assert set(np.flatnonzero(mgr.ref != mgr.c_ref).tolist()) <= moved, "a refcount moved unnoted"


def check_after_commit(store: pagedkv.KVStore) -> None:
    """The incremental commit left what the full-scan commit left, in memory and in LMDB."""
    mgr = store._mgr
    live = np.flatnonzero(mgr.live)
    assert not mgr.chg.any() and len(mgr.changed) == 0 and len(mgr.refs_moved) == 0
    assert len(differs_from_committed(mgr)) == 0, "a live page's entry was left uncommitted"
    assert (mgr.c_where[live] != NOWHERE).all()
    assert np.array_equal(mgr.c_ref, mgr.ref), "c_ref differs from a full copy of ref"
    rebuilt = np.flatnonzero((mgr.slot_pid < 0) & (mgr.slot_cpid < 0) & (mgr.bg_pins == 0))
    assert sorted(mgr.free_slots) == rebuilt.tolist(), "the free list differs from one rebuilt from every slot"
    assert store.check() == []
    spill = mgr.spill
    with spill.begin_read() as txn:
        disk = {name: {bytes(k): bytes(v) for k, v in spill.iterate(txn, db)}
                for name, db in (("dir", spill.dir), ("seqs", spill.seqs), ("tokens", spill.tokens),
                                 ("pages", spill.pages))}
    want_dir = {uid_key(int(mgr.uid[pid])): mgr.committed_entry(pid, int(mgr.c_where[pid])) for pid in live.tolist()}
    assert disk["dir"] == want_dir, "the directory in LMDB is not the committed directory"
    seqs = list(store._seqs.values())
    tables = persist.pack_tables(mgr, seqs)
    want_seqs = {seq.key: seal(TAG_SEQS, seq.key, body, mgr.seed) for seq, body in zip(seqs, tables)}
    assert disk["seqs"] == want_seqs, "the block tables in LMDB are not the sequences in memory"
    with_ids = [pid for pid in live.tolist() if mgr.flags[pid] & HAS_TOKENS]
    assert set(disk["tokens"]) == {uid_key(int(mgr.uid[pid])) for pid in with_ids}
    for pid in with_ids:
        ids = mgr.page_tokens_of(pid)
        assert ids is not None and len(ids) == mgr.fill[pid]
        key = uid_key(int(mgr.uid[pid]))
        assert disk["tokens"][key] == seal(TAG_TOKENS, key, ids.astype("<u4").tobytes(), mgr.seed)
    with_record = [pid for pid in live.tolist() if mgr.rec[pid] != REC_NONE]
    assert {uid_key(int(mgr.uid[pid])): int(mgr.rec_bytes[pid]) for pid in with_record} == \
        {key: len(value) for key, value in disk["pages"].items()}, "spill records differ from the directory's"
    assert mgr.spill_bytes == sum(len(value) for value in disk["pages"].values())


def page_view(mgr: BlockManager) -> dict[int, tuple[Any, ...]]:
    """Every live page by uid: its committed placement, fill, checksum, flags, codec, hashes, refs, record."""
    return {int(mgr.uid[pid]): (int(mgr.c_where[pid]), int(mgr.c_fill[pid]), int(mgr.c_csum[pid]),
                                int(mgr.c_flags[pid]), int(mgr.codec[pid]), bytes(mgr.hash[pid]),
                                int(mgr.parent[pid]), int(mgr.chain[pid]), int(mgr.c_ref[pid]),
                                int(mgr.rec_bytes[pid]))
            for pid in np.flatnonzero(mgr.live).tolist()}


def table_view(store: pagedkv.KVStore) -> dict[Any, tuple[int, list[int]]]:
    mgr = store._mgr
    return {seq.seq_id: (seq.length, mgr.uid[seq.table].tolist()) for seq in store._seqs.values()}


def check_reopened(store: pagedkv.KVStore, path: Path, scratch: Path) -> None:
    """The store's files as they are now, opened read-only, show exactly the writer's state.

    LMDB refuses a second handle on one environment in one process, so the files
    are copied first: between write transactions they are what a reopen reads.
    """
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "spill").mkdir(mode=0o700, parents=True)
    scratch.chmod(0o700)
    for name in ("LOCK", "pool.bin", "spill/data.mdb"):
        shutil.copy2(path / name, scratch / name)
    reader = pagedkv.open(scratch, readonly=True)
    try:
        assert reader.check() == []
        assert page_view(reader._mgr) == page_view(store._mgr)
        assert table_view(reader) == table_view(store)
        assert np.array_equal(reader._mgr.stamp, store._mgr.stamp)
        assert reader._mgr.spill_bytes == store._mgr.spill_bytes
    finally:
        reader.close()


# -- the random run ---------------------------------------------------------------------------------

class Run:
    """Random operations on one store, with the checks above at every commit."""

    def __init__(self, path: Path, seed: int, pool_pages: int, **options: Any) -> None:
        self.path, self.pool_pages, self.options = path, pool_pages, options
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.draws = Draws(self.rng, self.np_rng, GEOM, VOCAB)
        self.store = pagedkv.open(path, GEOM, pool_pages=pool_pages, evict_batch=2, **options)
        self.next_id = 0
        self.counts: dict[str, int] = {}

    def kv(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.draws.kv(n)

    def ids(self, n: int) -> list[int]:
        return self.draws.ids(n)

    def seqs(self) -> list[Any]:
        return sorted(self.store.sequences(), key=repr)

    def run(self, operations: int) -> dict[str, int]:
        ops = [(self.create, 3), (self.append, 5), (self.step, 6), (self.fork, 2), (self.drop, 2),
               (self.truncate, 2), (self.clear_cache, 1), (self.read, 1), (self.commit, 4), (self.reopen, 1)]
        names, weights = [op for op, _ in ops], [w for _, w in ops]
        for _ in range(operations):
            op = self.rng.choices(names, weights)[0]
            try:
                op()
            except PoolExhausted:  # a step needing more slots than the pool has: nothing changed
                self.counts["refused"] = self.counts.get("refused", 0) + 1
            except StoreFull:  # over the spill cap: the handle is poisoned, reopened at its last commit
                self.counts["store_full"] = self.counts.get("store_full", 0) + 1
                self.store._abandon()
                self.reopen(close=False)
                assert self.store.check() == []
            self.counts[op.__name__] = self.counts.get(op.__name__, 0) + 1
        self.commit()
        self.store.close()
        return self.counts

    def create(self) -> None:
        if len(self.store.sequences()) >= 8:
            return
        self.next_id += 1
        seq = self.next_id if self.rng.random() < 0.5 else f"s{self.next_id}"
        if self.rng.random() < 0.5:  # a prompt: its cached prefix is shared, the rest appended with ids
            prompt = self.ids(self.rng.randint(1, 4 * PS))
            reused = self.store.create(seq, tokens=prompt)
            rest = prompt[reused:]
            self.store.append(seq, *self.kv(len(rest)), tokens=rest)
        else:
            self.store.create(seq)

    def append(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq, n, tokens = self.draws.append(seqs, PS)
            self.store.append(seq, *self.kv(n), tokens=tokens)

    def step(self) -> None:
        seqs = self.seqs()
        if not seqs:
            return
        counts, tokens, fail = self.draws.step(seqs, PS)
        try:
            with self.store.step(counts, tokens=tokens) as step:
                pool, mapping = self.store.pool, step.slot_mapping
                slots, offsets = np.divmod(mapping, PS)
                k, v = self.kv(len(mapping))
                pool[slots, :, 0, offsets] = k.transpose(1, 0, 2, 3)
                pool[slots, :, 1, offsets] = v.transpose(1, 0, 2, 3)
                if fail:
                    raise Rollback
        except Rollback:
            pass

    def fork(self) -> None:
        seqs = self.seqs()
        if seqs and len(seqs) < 8:
            self.next_id += 1
            self.store.fork(self.rng.choice(seqs), f"f{self.next_id}")

    def drop(self) -> None:
        seqs = self.seqs()
        if seqs:
            self.store.drop(self.rng.choice(seqs))

    def truncate(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq = self.rng.choice(seqs)
            self.store.truncate(seq, self.rng.randint(0, self.store.length(seq)))

    def clear_cache(self) -> None:
        self.store.clear_cache(self.rng.choice([None, 0, 2048]))

    def read(self) -> None:
        seqs = self.seqs()
        if seqs:
            seq = self.rng.choice(seqs)
            self.store.read(seq, 0, self.store.length(seq))  # verifies every page it serves

    def commit(self) -> None:
        check_before_commit(self.store._mgr)
        self.store.commit()
        check_after_commit(self.store)
        check_reopened(self.store, self.path, self.path.with_name('reopened'))

    def reopen(self, close: bool = True) -> None:
        if close:
            self.store.close()
        self.store = pagedkv.open(self.path, durability=self.rng.choice(["nosync", "durable"]), evict_batch=2,
                                  **{k: v for k, v in self.options.items() if k != "durability"})
        mgr = self.store._mgr
        assert len(mgr.changed) == 0 and not mgr.chg.any()
        assert np.array_equal(mgr.c_ref, mgr.ref)


@pytest.mark.parametrize("pool_pages, options", [
    (12, {"durability": "nosync"}),  # most operations evict or restore
    (64, {"durability": "durable"}),  # mostly resident: commits move pages between slots
    (12, {"durability": "nosync", "spill_limit_bytes": 6000}),  # cache pages dropped to stay under the cap
    (12, {"durability": "nosync", "spill_codec": "zstd"}),  # the record codec rides in each entry's flags
], ids=["small-pool", "roomy-pool", "spill-cap", "zstd-records"])
def test_incremental_commit_matches_full_scan(tmp_path: Path, pool_pages: int, options: dict[str, Any]) -> None:
    seed = get_seed("incremental commit")
    counts = Run(tmp_path / "s", seed, pool_pages, **options).run(250)
    assert counts.get("commit", 0) >= 20, counts


@pytest.mark.slow
@pytest.mark.parametrize("run", range(6))
def test_incremental_commit_matches_full_scan_long(tmp_path: Path, run: int) -> None:
    seed = get_seed(f"incremental commit, long run {run}")
    options: dict[str, Any] = {"durability": "nosync"}
    if run % 3 == 2:
        options["spill_limit_bytes"] = 6000
    Run(tmp_path / "s", seed, 10 + 8 * (run % 2), **options).run(1500)


def test_volatile_store_keeps_its_change_log_bounded(tmp_path: Path) -> None:
    """Without commits (volatile) the noted rows are compacted instead of growing with every step."""
    store = pagedkv.open(tmp_path / "v", GEOM, pool_pages=64, durability="volatile")
    try:
        batch = {seq: 1 for seq in range(16)}
        for seq in batch:
            store.create(seq)
        mgr = store._mgr
        for step in range(2000):  # 32,000 rows noted, most of them freed again soon after
            with store.step(batch):
                pass
            store.commit()  # a no-op: nothing is ever cleared
            if step % 8 == 7:
                for seq in batch:
                    store.truncate(seq, 0)
        assert len(mgr.changed) <= 4096 + len(batch) and len(mgr.refs_moved) <= 4096 + len(batch)
        assert set(mgr.changed.rows().tolist()) >= set(np.flatnonzero(mgr.chg).tolist())
        assert set(mgr.refs_moved.rows().tolist()) >= set(np.flatnonzero(mgr.ref != mgr.c_ref).tolist())
    finally:
        store.close()


def test_block_tables_decode_as_stored(tmp_path: Path) -> None:
    """pack_tables' values are what msgpack gives for [seq id, length, uids] (the oracle above relies on it)."""
    store = pagedkv.open(tmp_path / "t", GEOM, pool_pages=32, durability="nosync")
    try:
        store.create("a")
        k = np.ones((GEOM.layers, 9, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
        store.append("a", k, k)
        seq = store._seqs.find("a")
        body = persist.pack_tables(store._mgr, [seq])[0]
        assert msgpack.unpackb(body) == ["a", 9, store._mgr.uid[seq.table].astype("<u8").tobytes()]
    finally:
        store.close()
