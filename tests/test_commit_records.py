"""What a commit writes, built in batches, is byte for byte what the one-record forms give; B7's floors replay it.

The directory entries (``entries.dir_entries``) against ``metarecord.dir_value``
of each page, over hashed, spilled and partial pages; ``seal_many`` against
``seal`` over keys of several lengths; the distinct noted rows
(``PendingRows.rows``) against ``np.unique``; and B7's durable row against its
like-for-like floor: the ranges a durable commit msyncs cover every slot it
wrote, and the floor row is there beside the rows older readers know.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

import pagedkv
from pagedkv.bench.meta import b7_commit, decode_commit
from pagedkv.bench.records import flushes
from pagedkv.bench.util import Ctx
from pagedkv.pages.directory import CODEC_SHIFT, SPILLED
from pagedkv.pages.entries import dir_entries
from pagedkv.pages.pending import PendingRows
from pagedkv.storage.metarecord import TAG_SEQS, dir_value, seal, seal_many
from pagedkv.storage.pool import HEADER_NBYTES
from pagedkv.storage.spill import uid_key

from tests.kits.content import get_seed
from tests.kits.draws import Draws
from tests.kits.store import GEOM


def test_dir_entries_match_dir_value(tmp_path: Path) -> None:
    seed = get_seed("dir entries")
    draws = Draws(random.Random(seed), np.random.default_rng(seed), GEOM, vocab=50)
    # A small pool spills most pages; token ids hash the full ones (hash, parent and chain set).
    # Every sequence has a full page and at least two pages: six of them always outgrow the
    # 8-slot pool (with 1-token sequences a draw could fit in it, spilling nothing).
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=8, durability="nosync", spill_codec="int8")
    try:
        for seq in range(6):
            count = draws.rng.randint(GEOM.page_size + 1, 13)
            k, v = draws.kv(count)
            store.create(seq)
            store.append(seq, k, v, tokens=draws.ids(count))
        mgr = store._mgr
        pids = np.flatnonzero(mgr.live)
        resident = mgr.slot[pids] >= 0
        assert resident.any() and not resident.all() and (mgr.chain[pids] != 0).any()
        assert (mgr.codec[pids] != 0).any()
        mgr.csum[pids] = np.random.default_rng(seed).integers(0, 1 << 63, len(pids), dtype=np.uint64)
        got, where = dir_entries(mgr, pids)
        want = []
        for pid in pids.tolist():
            place = int(mgr.slot[pid]) if mgr.slot[pid] >= 0 else SPILLED
            key = uid_key(int(mgr.uid[pid]))
            want.append((key, dir_value(key, place, int(mgr.fill[pid]), int(mgr.csum[pid]),
                                        int(mgr.flags[pid]) | int(mgr.codec[pid]) << CODEC_SHIFT,
                                        bytes(mgr.hash[pid]), int(mgr.parent[pid]), int(mgr.chain[pid]),
                                        mgr.seed)))
        assert got == want
        assert where.tolist() == [int(slot) if slot >= 0 else SPILLED for slot in mgr.slot[pids].tolist()]
        assert dir_entries(mgr, pids[:0])[0] == []
    finally:
        store.close()


def test_seal_many_matches_seal() -> None:
    keys = [b"", b"a", b"\x01" * 8, b"bc", b"\xff" * 300, b"d"]
    bodies = [bytes([index]) * index for index in range(len(keys))]
    assert seal_many(TAG_SEQS, keys, bodies, 77) == [seal(TAG_SEQS, key, body, 77) for key, body in zip(keys, bodies)]
    assert seal_many(TAG_SEQS, [], [], 77) == []


def test_pending_rows_are_distinct_and_ascending() -> None:
    seed = get_seed("pending rows")
    rng = np.random.default_rng(seed)
    log = PendingRows(lambda rows: rows)
    assert log.rows().tolist() == []
    log.add(5)
    assert log.rows().tolist() == [5]
    noted = [5]
    for _ in range(20):
        batch = rng.integers(0, 300, int(rng.integers(0, 50)))
        log.add_many(batch)
        noted += batch.tolist()
        row = int(rng.integers(0, 300))
        log.add(row)
        noted.append(row)
        assert log.rows().tolist() == sorted(set(noted))


def test_durable_commit_flushes_cover_the_written_slots(tmp_path: Path) -> None:
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=64, durability="durable")
    try:
        for seq in range(8):
            store.create(seq)
        with store.step({seq: 3 + 5 * seq for seq in range(8)}):
            pass
        store.commit()
        token = np.ones((GEOM.layers, 2, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
        wrote: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        with flushes(store) as ranges:
            decode_commit(store, {seq: 1 for seq in range(8)}, token, wrote)
        ((slots, _, _),) = wrote
        assert ranges, "a durable commit after a step flushes the pool"
        for slot in slots.tolist():
            first = HEADER_NBYTES + slot * GEOM.page_nbytes
            assert any(start <= first and first + GEOM.page_nbytes <= end for start, end in ranges)
        with flushes(store) as ranges:
            store.commit()  # nothing written since: nothing flushed
        assert ranges == []
    finally:
        store.close()


def test_b7_durable_row_has_its_two_sync_floor(tmp_path: Path) -> None:
    rows = b7_commit(Ctx(str(tmp_path), quick=True, seed=3))
    by_name = {row["name"]: row for row in rows}
    durable = by_name["commit after decode step durable"]
    assert {"sync_floor_ms", "sync_floor_ratio", "bare_nosync_commit_ms"} <= set(durable["metrics"])
    floor = by_name["commit after decode step durable vs its two-sync floor"]
    metrics = floor["metrics"]
    assert floor["target"] == "<= 1.2x" and floor["pagedkv"] == durable["pagedkv"]
    assert floor["reference"] == metrics["two_sync_floor_ms"] and floor["ratio"] > 0
    assert metrics["flush_ms"] > 0 and metrics["synced_commit_ms"] > 0
    assert metrics["flushed_ranges"] >= 1 and metrics["flushed_bytes"] >= 256 * durable["params"]["page_nbytes"]
    assert metrics["records"] >= 512  # a directory entry and a block table per sequence
    nosync = by_name["commit after decode step nosync vs the same records"]
    assert metrics["records"] == nosync["metrics"]["records"]
