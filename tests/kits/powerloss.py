"""Simulated power loss, in-process: only what was flushed survives, unflushed blocks torn at 512 B.

``PowerLossRig`` keeps a durable image of ``pool.bin`` through the library's flush
recorder (every msync of a slot range), arms crashes (before the j-th I/O seam call, or
right after the j-th flush) and builds the crashed file: each 4 KiB block changed since
its last flush is kept, reverted or torn sector by sector. ``power_loss_loop`` runs the
random workload, crashes it, rebuilds ``pool.bin``, reopens and verifies against the last
commit that returned.

LMDB needs no image: in durable mode every write transaction (commit and eviction alike)
is synced before it returns and a crashed one is aborted unwritten (writemap is off), so
the environment on disk *is* the latest completed transaction.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pagedkv
from pagedkv import faults
from pagedkv.storage.pool import PagePool

from .model import Model
from .verdict import LoopResult, fresh_store, save_artifact, verify_contents
from .workload import POWER_PARAMS, Params, Workload

# 4 KiB pages (one slot per 4 KiB block, eight 512 B sectors per slot) and 1 KiB pages (four
# slots share a block, so one slot's msync and another's unflushed bytes meet).
GEOM_POWER = pagedkv.Geometry(layers=4, kv_heads=2, head_dim=32, page_size=4, dtype="float16")
GEOM_POWER_SHARED = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=16, page_size=4, dtype="float16")
BLOCK, SECTOR = 4096, 512


class SimulatedCrash(BaseException):
    """Raised from an I/O seam or the flush recorder: the process 'loses power' right there."""


class PowerLossRig:
    """A durable image of ``pool.bin`` kept by the flush recorder, crash triggers, and the
    builder of the crashed file (each unflushed 4 KiB block kept, reverted or torn at 512 B).
    """

    def __init__(self, pool_path: Path, rng: random.Random) -> None:
        self.pool_path = pool_path
        self.rng = rng
        self.durable = bytearray(pool_path.read_bytes())
        self.flushes = 0
        self.arm_io: int | None = None  # raise at this many I/O seam calls from now on
        self.arm_flush: int | None = None  # raise after this many recorded flushes

    def record(self, pool: PagePool, start: int, end: int) -> None:
        """The flush recorder: bytes ``[start, end)`` of the pool are durable now."""
        self.durable[start:end] = pool._mm[start:end]
        self.flushes += 1
        if self.arm_flush is not None:
            self.arm_flush -= 1
            if self.arm_flush <= 0:
                self.arm_flush = None
                raise SimulatedCrash("after a flush")

    def inject(self, op: str) -> None:
        """The I/O seam: lose power before the armed call."""
        if self.arm_io is not None:
            self.arm_io -= 1
            if self.arm_io <= 0:
                self.arm_io = None
                raise SimulatedCrash(f"before I/O op {op}")

    def install(self) -> None:
        """Become the library's flush recorder."""
        faults.set_flush_recorder(self.record)

    def crash_image(self, figures: Counter[str]) -> None:
        """Rewrite ``pool.bin`` as it could be after the power loss; that becomes durable."""
        current = bytearray(self.pool_path.read_bytes())
        old = self.durable
        for start in range(0, len(current), BLOCK):
            end = start + BLOCK
            if current[start:end] == old[start:end]:
                continue
            figures["blocks_unflushed"] += 1
            choice = self.rng.random()
            if choice < 1 / 3:
                figures["blocks_kept"] += 1
            elif choice < 2 / 3:
                figures["blocks_reverted"] += 1
                current[start:end] = old[start:end]
            else:
                figures["blocks_torn"] += 1
                for sector in range(start, min(end, len(current)), SECTOR):
                    if self.rng.random() < 0.5:
                        current[sector:sector + SECTOR] = old[sector:sector + SECTOR]
        with open(self.pool_path, "r+b") as handle:
            handle.write(current)
        self.durable = current


def power_loss_loop(path: Path, cycles: int, seed: int, *, geom: pagedkv.Geometry = GEOM_POWER,
                    pool_pages: int = 24, params: Params | None = None, name: str = "powerloss-durable",
                    warmup: tuple[int, int] = (10, 30), ops_after_commit: tuple[int, int] = (0, 6),
                    artifact_root: Path | None = None,
                    progress: Callable[[LoopResult], None] | None = None) -> LoopResult:
    """Durable mode. Each cycle: run the workload; after its first commit arm a crash (between
    operations, before the j-th I/O seam call, or right after the j-th msync); ``_abandon()``;
    build the crashed ``pool.bin`` from the durable image; reopen and verify against the last
    returned commit (that reopened store runs the next cycle).
    ``figures['flagged_cycles']`` counts crashes after which any violation was found.
    """
    params = params or POWER_PARAMS
    result = LoopResult(name, seed, artifact_root=artifact_root)
    rng = random.Random(seed)
    started = time.monotonic()
    pool_path = path / "pool.bin"
    fresh_store(path, geom, pool_pages)
    committed, commit_no = Model(seed, geom, finite=True), 0
    ids = iter(range(1, 1 << 62))
    rig = PowerLossRig(pool_path, rng)
    rig.install()
    try:
        store = pagedkv.open(path, durability="durable")
        for cycle in range(cycles):
            result.cycles += 1
            problems, committed, commit_no = _power_cycle(store, rig, committed, commit_no, rng, ids, params,
                                                          warmup, ops_after_commit, result)
            rig.crash_image(result.figures)
            rig = PowerLossRig(pool_path, rng)
            rig.install()
            try:
                store = pagedkv.open(path, durability="durable")
            except Exception as exc:  # noqa: BLE001 - any failure to reopen is the finding
                problems.append(f"reopen failed: {exc!r}")
                result.figures["reopen_failures"] += 1
                store = None
            else:
                found, lost, wrong = verify_contents(store, committed)
                problems += found
                result.figures["lost_pages"] += lost
                result.figures["wrong_tokens"] += wrong
            if problems:
                result.fail(cycle, problems)
                result.figures["flagged_cycles"] += 1
                if store is not None:
                    store._abandon()
                save_artifact(result, path, f"cycle{cycle}")
                fresh_store(path, geom, pool_pages)
                committed, commit_no = Model(seed, geom, finite=True), 0
                rig = PowerLossRig(pool_path, rng)
                rig.install()
                store = pagedkv.open(path, durability="durable")
            if progress is not None:
                progress(result)
        store._abandon()
    finally:
        faults.set_injector(None)
        faults.set_flush_recorder(None)
    result.elapsed_s = time.monotonic() - started
    return result


def _power_cycle(store: pagedkv.KVStore, rig: PowerLossRig, committed: Model, commit_no: int,
                 rng: random.Random, ids: Any, params: Params, warmup_ops: tuple[int, int],
                 ops_after_commit: tuple[int, int], result: LoopResult) -> tuple[list[str], Model, int]:
    """Run the workload until the armed crash; return (problems, last returned commit)."""
    warm_commit = commit_no
    state: dict[str, Any] = {"committed": committed, "pending": None, "number": commit_no}

    def intent(number: int, current: Model) -> None:
        state["pending"] = current.copy()

    def ack(number: int) -> None:
        state["committed"], state["number"] = state["pending"], number
        result.figures["commits"] += 1

    work = Workload(store, committed.copy(), commit_no, rng, ids.__next__, params, intent, ack)
    kind = rng.choice(("between", "io", "flush", "between", "io", "flush", "close"))
    result.figures["armed_" + kind] += 1
    armed_at = None
    warmup = rng.randint(*warmup_ops)  # the crash is armed at the first commit after these ops
    more_ops = rng.randint(*ops_after_commit)
    problems: list[str] = []
    faults.set_injector(rig.inject)
    try:
        for op_index in range(400):
            if op_index == warmup:
                warm_commit = work.commit_no
            if armed_at is None and op_index > warmup and work.commit_no > warm_commit:
                armed_at = op_index
                if kind == "io":
                    rig.arm_io = rng.randint(1, 6)
                elif kind == "flush":
                    rig.arm_flush = rng.randint(1, 3)
            grace = 8 if kind in ("io", "flush") else 0  # ops for an armed seam to fire in
            if armed_at is not None and op_index >= armed_at + more_ops + grace:
                if kind == "close":  # close() = commit + full sync: power is lost after it
                    work.close()
                break
            work.one()
        result.figures["crash_after_close" if kind == "close" else "crash_between_ops"] += 1
    except SimulatedCrash:
        result.figures["crash_inside_op"] += 1
    except pagedkv.StoreClosed as exc:
        if "write-behind" not in str(exc):  # the crash fired in the background evictor
            problems.append(f"workload raised {exc!r}")
        result.figures["crash_inside_op"] += 1
    except Exception as exc:  # noqa: BLE001 - a failure of the live process is a finding too
        problems.append(f"workload raised {exc!r}")
    finally:
        faults.set_injector(None)
        faults.set_flush_recorder(None)
    store._abandon()
    result.figures["flushes"] += rig.flushes
    return problems, state["committed"], state["number"]


def noflush_mutation() -> Callable[[], None]:
    """Planted bug: ``PagePool.finish_flush`` (the msyncs) does nothing (write-ahead order broken).

    Returns undo.
    """
    original = PagePool.finish_flush
    PagePool.finish_flush = lambda self: None  # type: ignore[method-assign]

    def undo() -> None:
        PagePool.finish_flush = original  # type: ignore[method-assign]

    return undo
