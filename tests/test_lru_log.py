"""The LRU stamps are committed as a base record and a log of deltas (format 3).

What a commit writes of them grows with the slots it stamped, not with the pool,
and every reopen, writer or read-only, sees exactly the stamps of the last
commit. A format-2 store becomes format 3 at its first writer open, its stamps
kept; a read-only open leaves it as it is.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv import Geometry
from pagedkv.bench.records import recording
from pagedkv.compact import compact
from pagedkv.pages import lrulog

from tests.kits.content import get_seed
from tests.kits.files import spill_dbs, spill_env
from tests.kits.store import GEOM, ROOT

PS = GEOM.page_size
POOL = 32
MAX_PAGES = 6  # pages per sequence: three sequences of a step always fit the pool


def _small_log(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A log short enough that base rewrites come from both limits within a few commits.

    Returns the number of base rewrites so far by cause (its count of deltas, its size).
    """
    monkeypatch.setattr(lrulog, "MAX_DELTAS", 4)
    monkeypatch.setattr(lrulog, "MAX_LOG_SHARE", 0.8)
    causes = {"count": 0, "size": 0}
    plan = lrulog.plan

    def counted(log: lrulog.StampLog, *args: object) -> lrulog.StampWrites:
        writes = plan(log, *args)  # type: ignore[arg-type]
        if log.based and writes.log.first != log.first:
            causes["count" if log.next - log.first == lrulog.MAX_DELTAS else "size"] += 1
        return writes

    monkeypatch.setattr(lrulog, "plan", counted)
    return causes


def test_every_reopen_sees_the_last_commits_stamps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random creates, steps, reads, drops, commits and reopens; the stamps a reopen finds are the model's."""
    causes = _small_log(monkeypatch)
    seed = get_seed("lru log")
    rng = random.Random(seed)
    path = tmp_path / "store"
    store = pagedkv.open(path, GEOM, POOL, durability="nosync", evict_batch=2)
    committed = store._mgr.stamp.copy()
    seqs: list[int] = []
    names = iter(range(1 << 20))

    def same(handle: pagedkv.KVStore, why: str) -> None:
        assert np.array_equal(handle._mgr.stamp, committed), f"{why} (PAGEDKV_SEED={seed})"
        assert handle.check() == [], f"{why} (PAGEDKV_SEED={seed})"

    for _ in range(600):
        roll = rng.random()
        if roll < 0.12 and len(seqs) < 8:
            seqs.append(next(names))
            store.create(seqs[-1])
        elif roll < 0.5 and seqs:
            chosen = rng.sample(seqs, min(len(seqs), rng.randint(1, 3)))
            grow = {seq: rng.randint(1, 3) for seq in chosen
                    if store.length(seq) + 3 <= MAX_PAGES * PS}
            if grow and store.can_step(grow):
                with store.step(grow):
                    pass
        elif roll < 0.62 and seqs:
            seq = rng.choice(seqs)
            length = store.length(seq)
            start = rng.randint(0, length)
            store.read(seq, start, rng.randint(start, min(length, start + PS)))
        elif roll < 0.68 and seqs:
            store.drop(seqs.pop(rng.randrange(len(seqs))))
        elif roll < 0.85:
            # Now and then a run of one-token steps of one sequence, each committed: short deltas.
            for _ in range(rng.choice((1, 1, 1, 6))):
                seq = rng.choice(seqs) if seqs else None
                if seq is not None and store.length(seq) < MAX_PAGES * PS and store.can_step({seq: 1}):
                    with store.step({seq: 1}):
                        pass
                store.commit()
            committed = store._mgr.stamp.copy()
        elif roll < 0.92:
            if rng.random() < 0.5:
                store.close()  # commits first
                committed = store._mgr.stamp.copy()
            else:
                store._abandon()  # a crash: what was stamped since the last commit is lost
            store = pagedkv.open(path, durability="nosync", evict_batch=2)
            same(store, "a writer reopened")
            seqs = sorted(store.sequences())
        else:
            # LMDB refuses a second handle on one environment in one process: the reader opens a copy.
            scratch = tmp_path / "reader"
            shutil.rmtree(scratch, ignore_errors=True)
            (scratch / "spill").mkdir(mode=0o700, parents=True)
            scratch.chmod(0o700)
            for name in ("LOCK", "pool.bin", "spill/data.mdb"):
                shutil.copy2(path / name, scratch / name)
            with pagedkv.open(scratch, readonly=True) as reader:
                same(reader, "a reader beside the writer")
    store.close()
    committed = store._mgr.stamp.copy()
    with pagedkv.open(path, readonly=True) as reader:
        same(reader, "the closed store")
    assert causes["count"] and causes["size"], (causes, seed)


def test_a_decode_commit_writes_its_stamps_not_the_pools(tmp_path: Path) -> None:
    """At a 1,000,000-slot pool (8 MB of stamps), a one-token step's commit puts a few hundred bytes."""
    geom = Geometry(layers=1, kv_heads=1, head_dim=8, page_size=16, dtype="float16")
    store = pagedkv.open(tmp_path / "store", geom, pool_pages=1_000_000, durability="nosync")
    try:
        for seq in range(4):
            store.create(seq)
        with store.step({seq: 1 for seq in range(4)}):
            pass
        store.commit()  # the first commit writes the base
        for _ in range(3):
            with store.step({seq: 1 for seq in range(4)}):
                pass
            with recording(store) as txns:
                store.commit()
            put = sum(log.put_bytes for log in txns)
            assert put < 4096, f"a decode step's commit put {put} bytes"
        stamps = store._mgr.stamp.copy()
    finally:
        store.close()
    with pagedkv.open(tmp_path / "store", readonly=True) as reader:
        assert np.array_equal(reader._mgr.stamp, stamps)


def _stepped(path: Path, commits: int) -> np.ndarray:
    """Open the store at ``path``, run and commit ``commits`` steps of two sequences; its stamps."""
    with pagedkv.open(path, durability="nosync") as store:
        for seq in ("x", "y"):
            if seq not in store.sequences():
                store.create(seq)
        for _ in range(commits):
            with store.step({"x": 1, "y": 2}):
                pass
            store.commit()
        stamps: np.ndarray = store._mgr.stamp.copy()
    return stamps


def test_compaction_keeps_the_stamps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _small_log(monkeypatch)
    path = tmp_path / "store"
    pagedkv.open(path, GEOM, POOL).close()
    stamps = _stepped(path, 7)
    compact(path)
    with pagedkv.open(path, readonly=True) as store:
        assert np.array_equal(store._mgr.stamp, stamps) and store.check() == []


def test_a_format_2_store_becomes_format_3_at_its_first_writer(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    work = tmp_path / "sample-v2.kv"
    shutil.copytree(ROOT / "data" / "sample-v2.kv", work)
    with pagedkv.open(work, readonly=True) as store:
        assert store.superblock["format"] == 2
        stamps = store._mgr.stamp.copy()
    with pagedkv.open(work, readonly=True) as store:  # a reader changes nothing
        assert store.superblock["format"] == 2
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        with pagedkv.open(work) as store:
            assert store.superblock["format"] == 3
            assert np.array_equal(store._mgr.stamp, stamps)
    assert any("upgraded from format 2" in record.getMessage() for record in caplog.records)
    env = spill_env(work, readonly=True, lock=False)
    try:
        meta = spill_dbs(env)["meta"]
        with env.begin() as txn:
            assert not any(lrulog.is_delta_key(bytes(key)) for key, _ in txn.cursor(db=meta))
    finally:
        env.close()
    with pagedkv.open(work, readonly=True) as store:
        assert store.superblock["format"] == 3 and store.check() == []
        assert np.array_equal(store._mgr.stamp, stamps)
    stamps = _stepped(work, 3)  # the log starts on the format-2 base
    with pagedkv.open(work, readonly=True) as store:
        assert np.array_equal(store._mgr.stamp, stamps) and store.check() == []
        assert store._state["lru_log"][1] > 0
