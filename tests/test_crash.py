"""Crash safety (docs/reliability.md T2, T3, T4): SIGKILL loops, named crash points, power loss.

The machinery lives in tests/kits/ (crash, crashpoints, powerloss, verdict, workload), shared
with tools/crashtest.py. Every randomised test prints its seed (``PAGEDKV_SEED=<n>`` replays
it). SIGKILL loops keep their stores in the test's tmp_path (a real filesystem), power-loss
loops on /dev/shm when it is a tmpfs (they simulate durability themselves);
``PAGEDKV_CRASH_DIR`` overrides both. A failing cycle's store directory is copied under
``PAGEDKV_ARTIFACTS`` (default: the test's ``tmp_path/artifacts``). Soak sizes:
``PAGEDKV_SOAK=1 pytest -m soak tests/test_crash.py`` (``PAGEDKV_SOAK_CYCLES`` overrides the
cycle counts); longer runs with figures: ``python -m tools.crashtest``.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

import pagedkv
from pagedkv import compact, faults
from pagedkv.storage.pool import PagePool
from pagedkv.storage.spill import SpillStore

from tests.kits.content import get_seed
from tests.kits.crash import library_crashpoints, sigkill_loop
from tests.kits.crashpoints import POINTS, crashpoint_run
from tests.kits.model import Model
from tests.kits.powerloss import GEOM_POWER, GEOM_POWER_SHARED, PowerLossRig, power_loss_loop
from tests.kits.verdict import LoopResult, fresh_store, scratch_root, verify_contents
from tests.kits.workload import POWER_PARAMS, Workload



T2_CYCLES = 1000  # per mode (bar: >= 1000)
T4_CYCLES = 500  # 4 KiB pages (bar: >= 500), plus T4_SHARED_CYCLES with 1 KiB pages
T4_SHARED_CYCLES = 200
MUTATION_CYCLES = 100  # bar: a loss flagged in >= 90 of 100

SOAK = os.environ.get("PAGEDKV_SOAK") == "1"
only_in_soak = pytest.mark.skipif(not SOAK, reason="soak run: PAGEDKV_SOAK=1 pytest -m soak")


def soak_cycles(default: int) -> int:
    return int(os.environ.get("PAGEDKV_SOAK_CYCLES", default))


@pytest.fixture(autouse=True)
def _clean_seams():
    """The parent must not be armed itself, and no hook may leak into or out of a test."""
    assert faults._crash_name is None, "unset PAGEDKV_CRASHPOINT before running the crash tests"
    faults.set_injector(None)
    faults.set_flush_recorder(None)
    yield
    faults.set_injector(None)
    faults.set_flush_recorder(None)


@pytest.fixture
def scratch(tmp_path: Path):
    """The directory of a power-loss loop's stores: tmpfs when available (``scratch_root``)."""
    yield from _scratch(tmp_path, power_loss=True)


@pytest.fixture
def killdir(tmp_path: Path):
    """The directory of a SIGKILL loop's stores: the test's tmp_path unless PAGEDKV_CRASH_DIR."""
    yield from _scratch(tmp_path, power_loss=False)


def _scratch(tmp_path: Path, power_loss: bool):
    root = scratch_root(power_loss)
    if root is None:
        yield tmp_path
        return
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="pagedkv-crash-", dir=root))
    print(f"stores under {path}; failing stores are copied to {tmp_path / 'artifacts'}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_clean(result: LoopResult) -> None:
    print(result.summary())
    assert result.violation_cycles == 0, result.summary()
    assert result.figures["lost_pages"] == 0 and result.figures["wrong_tokens"] == 0


# -- T2: black-box SIGKILL loop ----------------------------------------------------------------


def check_sigkill_result(result: LoopResult, cycles: int) -> None:
    assert_clean(result)
    figures = result.figures
    assert result.cycles == cycles
    assert figures["sigkilled"] == cycles  # every child died by SIGKILL, none ran out of work
    assert figures["state_acked"] + figures["state_acked+1"] == cycles  # no lost acked commit
    # The loop did what it claims: commits acked, pages evicted and restored, kills everywhere.
    assert figures["acked_commits"] >= cycles
    assert figures["evictions"] > cycles and figures["restores"] > cycles
    assert figures["killed_before_open"] > 0 and figures["state_acked+1"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["durable", "nosync"])
def test_sigkill_loop(tmp_path: Path, killdir: Path, mode: str) -> None:
    """>= 1000 SIGKILLs per mode at random moments: 0 wrong bytes, 0 lost pages, 0 lost acked
    commits, 0 reopen failures; the state is the last acked commit or the one after it."""
    seed = get_seed(f"T2 {mode}")
    result = sigkill_loop(killdir / "store", mode, T2_CYCLES, seed,
                          artifact_root=tmp_path / "artifacts")
    check_sigkill_result(result, T2_CYCLES)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_during_open_then_reopen_at_once(tmp_path: Path, killdir: Path) -> None:
    """A writer killed inside ``open()`` is dead and reaped: reopening at once must find the
    lock free. A helper process the library forks meanwhile is made to wait 300 ms before it
    opens LMDB, so one still holding the writer's LOCK descriptor would keep the dead writer's
    lock (without the delay the T2 loops above hit that by chance in ~1-2 % of cycles)."""
    seed = get_seed("T2 kill during open")
    result = sigkill_loop(killdir / "store", "durable", 20, seed, kill_min_ms=20.0,
                          kill_max_ms=120.0, time_share=1.0, helper_delay_ms=300.0,
                          name="T2-kill-in-open", artifact_root=tmp_path / "artifacts")
    assert result.figures["killed_before_open"] >= 10
    assert result.figures["reopen_locked"] == 0, result.summary()
    assert_clean(result)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_loop_catches_slot_reuse_before_commit(tmp_path: Path, killdir: Path) -> None:
    """The T2 oracle catches a P2 violation: with pending-free slots handed out before the
    freeing commit, a kill before that commit must surface as lost committed pages."""
    seed = get_seed("T2 mutation")
    result = sigkill_loop(killdir / "store", "nosync", 400, seed, mutation="reuse-pending",
                          name="T2-mutation", stop_after_lost=True,
                          artifact_root=tmp_path / "artifacts")
    print(result.summary())
    assert result.figures["lost_pages"] > 0, "the SIGKILL loop missed slot reuse before commit"


# -- T3: white-box crash points ------------------------------------------------------------------


def test_crash_point_list_is_the_library_list() -> None:
    """The points tested are exactly the ``faults.crashpoint`` calls in the library.

    Compaction's points are killed at by tests/test_compact.py, one SIGKILL each.
    """
    found = library_crashpoints() - set(compact.CRASH_POINTS)
    assert set(compact.CRASH_POINTS) <= library_crashpoints()
    assert set(POINTS) == found, f"untested: {sorted(found - set(POINTS))}, " \
                                 f"gone: {sorted(set(POINTS) - found)}"
    assert len(found) >= 12


def check_points_result(result: LoopResult, hits: range) -> None:
    print(result.summary())
    fired = {point: result.figures[f"fired:{point}"] for point in POINTS}
    print("fired (runs killed at the point, of %d):" % len(hits), fired)
    assert result.violation_cycles == 0, result.summary()
    assert all(fired.values()), f"points that never fired: {[p for p, n in fired.items() if not n]}"
    assert result.cycles == len(POINTS) * len(hits)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["durable", "nosync"])
def test_sigkill_at_every_crash_point(tmp_path: Path, killdir: Path, mode: str) -> None:
    """Every named point x hits 1..5: the child dies by SIGKILL at the k-th hit (or ends
    normally having passed it fewer times); reopen = last acked commit or the next, 0
    violations. Create points: no half-created store, ever."""
    seed = get_seed(f"T3 {mode}")
    hits = range(1, 6)
    result = crashpoint_run(killdir, mode, seed, POINTS, hits,
                            artifact_root=tmp_path / "artifacts")
    check_points_result(result, hits)
    # With this workload every point is passed at least five times, so all 75 runs kill.
    assert sum(result.figures[f"fired:{p}"] for p in POINTS) == len(POINTS) * len(hits)
    assert result.figures["state_acked+1"] > 0  # e.g. commit.after_commit: done, never acked


# -- T4: simulated power loss --------------------------------------------------------------------


def test_power_loss_image_keeps_reverts_or_tears_only_unflushed_blocks(tmp_path: Path) -> None:
    """The rig itself: unchanged blocks stay; a changed block becomes new, old, or a 512 B mix."""
    pool = tmp_path / "pool.bin"
    old = bytes(range(256)) * 16 * 8  # 8 blocks
    pool.write_bytes(old)
    rig = PowerLossRig(pool, random.Random(3))
    new = bytearray(old)
    for block in (1, 2, 3, 5, 6, 7):
        new[block * 4096:(block + 1) * 4096] = bytes([block]) * 4096
    figures: Counter[str] = Counter()
    outcomes = Counter()
    for _ in range(60):
        pool.write_bytes(new)
        rig.durable = bytearray(old)
        rig.crash_image(figures)
        after = pool.read_bytes()
        for block in range(8):
            got, was, now = (x[block * 4096:(block + 1) * 4096] for x in (after, old, new))
            if was == now:
                assert got == was
                continue
            for sector in range(0, 4096, 512):
                assert got[sector:sector + 512] in (was[sector:sector + 512], now[sector:sector + 512])
            outcomes["kept" if got == now else "reverted" if got == was else "torn"] += 1
        assert rig.durable == bytearray(after)
    assert figures["blocks_unflushed"] == 360 and min(outcomes.values()) > 60, outcomes


def test_flush_recorder_sees_every_commit_flush(tmp_path: Path) -> None:
    """The seam T4 rests on: a durable commit msyncs each written slot before its LMDB txn."""
    path = tmp_path / "store"
    fresh_store(path, GEOM_POWER, 8)
    rig = PowerLossRig(path / "pool.bin", random.Random(1))
    faults.set_flush_recorder(rig.record)
    store = pagedkv.open(path)
    try:
        geom = store.geometry
        store.create(1)
        model = Model(1, geom, finite=True)
        model.create(1)
        store.append(1, *model.next_kv(1, 9))
        assert rig.flushes == 0
        store.commit()
        assert rig.flushes >= 1
        current = (path / "pool.bin").read_bytes()
        for slot in store._mgr.slot[store._seqs[next(iter(store._seqs))].table].tolist():
            start = 4096 + slot * geom.page_nbytes
            assert rig.durable[start:start + geom.page_nbytes] == current[start:start + geom.page_nbytes]
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape", ["4k-pages", "1k-pages-shared-blocks"])
def test_power_loss(tmp_path: Path, scratch: Path, shape: str) -> None:
    """Durable mode, >= 500 simulated power losses: unflushed pool blocks kept, reverted or
    torn at 512 B; LMDB at its last completed transaction: 0 lost committed pages, 0 wrong
    bytes, 0 reopen failures against the last returned commit."""
    seed = get_seed(f"T4 {shape}")
    if shape == "4k-pages":
        result = power_loss_loop(scratch / "store", T4_CYCLES, seed,
                                 artifact_root=tmp_path / "artifacts")
        cycles = T4_CYCLES
    else:
        result = power_loss_loop(scratch / "store", T4_SHARED_CYCLES, seed,
                                 geom=GEOM_POWER_SHARED, name="T4-shared",
                                 artifact_root=tmp_path / "artifacts")
        cycles = T4_SHARED_CYCLES
    assert_clean(result)
    figures = result.figures
    assert result.cycles == cycles and figures["flagged_cycles"] == 0
    # Crashes landed inside operations and between them, with unflushed blocks of every fate.
    assert figures["crash_inside_op"] > cycles // 10 and figures["crash_between_ops"] > cycles // 10
    assert min(figures["blocks_kept"], figures["blocks_reverted"], figures["blocks_torn"]) > cycles // 10
    assert figures["commits"] > cycles and figures["flushes"] > cycles


def test_nosync_close_is_a_full_sync(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/reliability.md, durability modes: "In every mode: close() = commit + full sync". After a
    nosync store is closed, every committed pool slot must have been msynced (reported to the
    flush recorder) and the LMDB environment synced, so a power loss then loses nothing."""
    seed = get_seed("T4 nosync close")
    path = scratch / "store"
    fresh_store(path, GEOM_POWER, 24)
    spill_syncs: list[int] = []
    original_sync = SpillStore.sync
    monkeypatch.setattr(SpillStore, "sync", lambda self: (spill_syncs.append(1), original_sync(self))[1])
    rig = PowerLossRig(path / "pool.bin", random.Random(seed))
    faults.set_flush_recorder(rig.record)
    store = pagedkv.open(path, durability="nosync")
    model = Model(seed, store.geometry, finite=True)
    ids = iter(range(1, 1 << 30))
    work = Workload(store, model, 0, random.Random(seed), ids.__next__, POWER_PARAMS,
                    lambda number, current: None, lambda number: None)
    work.run(40)
    store.close()
    faults.set_flush_recorder(None)
    current = (path / "pool.bin").read_bytes()
    store = pagedkv.open(path, readonly=True)
    try:
        nbytes = store.geometry.page_nbytes
        slots = store._mgr.c_where[store._mgr.c_where >= 0].tolist()
    finally:
        store.close()
    unsynced = [slot for slot in slots if rig.durable[4096 + slot * nbytes:4096 + (slot + 1) * nbytes]
                != current[4096 + slot * nbytes:4096 + (slot + 1) * nbytes]]
    figures: Counter[str] = Counter()
    rig.crash_image(figures)
    store = pagedkv.open(path, durability="nosync")
    try:
        problems, lost, wrong = verify_contents(store, model)
    finally:
        store._abandon()
    print(f"{len(unsynced)} of {len(slots)} committed slots unflushed after close(); "
          f"{len(spill_syncs)} spill syncs; after a power loss: {lost} lost pages, {wrong} wrong tokens")
    assert wrong == 0  # nosync may lose data, never return wrong bytes
    assert not unsynced and spill_syncs, (
        f"close() in nosync mode is not a full sync: {len(unsynced)} of {len(slots)} committed pool "
        f"slots never msynced, SpillStore.sync called {len(spill_syncs)} times; a power loss after "
        f"close() lost {lost} committed pages")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_power_loss_loop_catches_a_missing_flush(tmp_path: Path, scratch: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same loop with ``PagePool.finish_flush`` (the msyncs) a no-op must flag a loss in >= 90
    of 100 cycles: proof that T4 catches a commit that is not preceded by its flush."""
    seed = get_seed("T4 mutation")
    monkeypatch.setattr(PagePool, "finish_flush", lambda self: None)
    result = power_loss_loop(scratch / "store", MUTATION_CYCLES, seed, name="T4-mutation",
                             artifact_root=tmp_path / "artifacts")
    print(result.summary().splitlines()[0:2])
    assert result.figures["flushes"] == 0
    assert result.figures["flagged_cycles"] >= 90, result.summary()
    assert result.figures["lost_pages"] > 0


# -- soak sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["durable", "nosync"])
@pytest.mark.soak
@only_in_soak
@pytest.mark.timeout(0)
def test_soak_sigkill_loop(tmp_path: Path, killdir: Path, mode: str) -> None:
    seed = get_seed(f"T2 soak {mode}")
    cycles = soak_cycles(100_000)
    result = sigkill_loop(killdir / "store", mode, cycles, seed,
                          artifact_root=tmp_path / "artifacts")
    check_sigkill_result(result, cycles)


@pytest.mark.parametrize("mode", ["durable", "nosync"])
@pytest.mark.soak
@only_in_soak
@pytest.mark.timeout(0)
def test_soak_crash_points(tmp_path: Path, killdir: Path, mode: str) -> None:
    seed = get_seed(f"T3 soak {mode}")
    hits = range(1, 51)
    result = crashpoint_run(killdir, mode, seed, POINTS, hits, sessions=12, ops_per_session=40,
                            artifact_root=tmp_path / "artifacts")
    check_points_result(result, hits)


@pytest.mark.parametrize("shape", ["4k-pages", "1k-pages-shared-blocks"])
@pytest.mark.soak
@only_in_soak
@pytest.mark.timeout(0)
def test_soak_power_loss(tmp_path: Path, scratch: Path, shape: str) -> None:
    seed = get_seed(f"T4 soak {shape}")
    geom = GEOM_POWER if shape == "4k-pages" else GEOM_POWER_SHARED
    result = power_loss_loop(scratch / "store", soak_cycles(50_000), seed, geom=geom,
                             artifact_root=tmp_path / "artifacts")
    assert_clean(result)

