"""Commits: batched helpers match their one-page forms, the flush precedes its transaction, rollback.

The commit side's batched helpers (checksum refresh, record writes) give what their
one-page reference forms give; the pool flush precedes the LMDB transaction that
references it; a ``with`` block that raises rolls back; and a pool write outside a step
never reads back as committed data.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest

import pagedkv
from pagedkv import PageCorrupt, faults
from pagedkv.pages import persist
from pagedkv.storage.codec import page_checksum
from pagedkv.geometry import Geometry
from pagedkv.storage.spill import SpillStore

from tests.kits.content import get_seed, kv
from tests.kits.store import GEOM, engine_write



# -- batched commit helpers and the write order ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("gather_bytes", [1, 300, 16 << 20])
def test_refresh_checksums_matches_page_checksum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 dtype: str, gather_bytes: int) -> None:
    geom = Geometry(layers=3, kv_heads=2, head_dim=4, page_size=8, dtype=dtype)
    monkeypatch.setattr(persist, "_GATHER_BYTES", gather_bytes)  # small: many batches
    store = pagedkv.open(str(tmp_path / "s"), geom, pool_pages=64, durability="nosync")
    try:
        rng = np.random.default_rng(7)
        for seq in range(12):
            store.create(seq)
            count = int(rng.integers(1, 40))
            k = rng.standard_normal((geom.layers, count, geom.kv_heads, geom.head_dim)).astype(geom.np_dtype)
            store.append(seq, k, -k)
        mgr = store._mgr
        pids = np.flatnonzero(mgr.live & (mgr.slot >= 0))
        first_fill = int(mgr.fill[pids[0]])
        mgr.fill[pids[0]] = 0  # an empty page hashes its identity alone
        assert set(mgr.fill[pids].tolist()) >= {0, geom.page_size} and len(set(mgr.fill[pids].tolist())) > 3
        want = [page_checksum(mgr.pool[mgr.slot[pid]], int(mgr.fill[pid]), int(mgr.uid[pid]), mgr.seed)
                for pid in pids]
        mgr.csum[pids], mgr.csum_ok[pids] = 0, False
        persist.refresh_checksums(mgr, pids[::-1])  # any order of pages
        assert mgr.csum[pids].tolist() == want
        assert mgr.csum_ok[pids].all()
        mgr.fill[pids[0]] = first_fill  # consistent again for close
        mgr.csum_ok[pids[0]] = False
        assert store.check() == []
    finally:
        store.close()


def test_pack_tables_matches_msgpack(tmp_path: Path) -> None:
    geom = Geometry(layers=1, kv_heads=1, head_dim=2, page_size=1, dtype="float16")
    store = pagedkv.open(str(tmp_path / "s"), geom, pool_pages=512, durability="nosync")
    try:
        # Lengths straddle msgpack's int and bin size classes; ids are ints and strs.
        for seq_id, length in [(0, 0), ("a", 1), (-5, 127), ("ü" * 40, 128), (1 << 40, 33), ("b", 300)]:
            store.create(seq_id)
            if length:
                k = np.zeros((1, length, 1, 2), np.float16)
                store.append(seq_id, k, k)
        mgr = store._mgr
        seqs = list(store._seqs.values())
        want = [msgpack.packb([seq.seq_id, seq.length, mgr.uid[seq.table].astype("<u8").tobytes()])
                for seq in seqs]
        assert persist.pack_tables(mgr, seqs) == want
        assert persist.pack_tables(mgr, []) == []
    finally:
        store.close()


def test_durable_commit_flushes_before_its_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    geom = Geometry(layers=1, kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    store = pagedkv.open(str(tmp_path / "s"), geom, pool_pages=32)
    events: list[str] = []
    write = SpillStore.write
    monkeypatch.setattr(SpillStore, "write", lambda self, body, what="commit": (events.append(what),
                                                                               write(self, body, what))[1])
    faults.set_flush_recorder(lambda target, start, end: events.append("flush"))
    try:
        store.create("a")
        k = np.ones((1, 6, 2, 8), np.float16)
        store.append("a", k, k)
        events.clear()
        store.commit()
        assert "flush" in events and events.index("flush") < events.index("commit")
    finally:
        faults.set_flush_recorder(None)
        store.close()


# -- rollback, and pool writes outside a step --------------------------------------------------------


@pytest.mark.parametrize("durability", ["durable", "nosync"])
def test_with_block_commits_on_success_and_rolls_back_on_error(tmp_path: Path, durability: str) -> None:
    seed = get_seed("with")
    path = tmp_path / "s"
    with pagedkv.open(path, GEOM, 8, durability=durability) as store:
        store.create("kept")
        store.append("kept", *kv(seed, "kept", 0, 9))
    with pytest.raises(RuntimeError):
        with pagedkv.open(path, durability=durability) as store:
            store.append("kept", *kv(seed, "kept", 9, 30))  # spills: eviction transactions land
            store.create("lost")
            store.append("lost", *kv(seed, "lost", 0, 5))
            raise RuntimeError("the caller's block failed")
    assert store._closed
    with pagedkv.open(path, durability=durability) as store:
        assert store.sequences() == ["kept"] and store.length("kept") == 9
        k, v = store.read("kept")
        ek, ev = kv(seed, "kept", 0, 9)
        assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes()
        assert store.check() == []


def _slot_of(store: pagedkv.KVStore, seq: str, page: int) -> int:
    with store.step({seq: 0}) as step:
        return int(step.block_tables[0, page])


@pytest.mark.parametrize("when", ["outside any step", "inside another sequence's step"])
def test_pool_write_through_a_stale_slot_is_page_corrupt(tmp_path: Path, when: str) -> None:
    seed = get_seed("pool-write")
    store = pagedkv.open(tmp_path / "s", GEOM, 8)
    for seq in ("a", "b"):
        store.create(seq)
        store.append(seq, *kv(seed, seq, 0, 6))
    store.commit()
    slot = _slot_of(store, "a", 1)  # a slot mapping the engine keeps past its step
    pool = store.pool
    if when == "outside any step":
        pool[slot, 0, 0, 0] = 12345.0
    else:
        with store.step({"b": 1}) as step:
            engine_write(store, step, [kv(seed, "b", 6, 1)])
            pool[slot, 1, 1, 1] = -1.0
    with pytest.raises(PageCorrupt):
        store.read("a")
    with pytest.raises(PageCorrupt):
        store.read_pages("a")
    ek, ev = kv(seed, "a", 0, 4)  # the untouched first page still reads
    k, v = store.read("a", 0, 4)
    assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes()
    assert any("pool slot" in line for line in store.check())
    store._abandon()
