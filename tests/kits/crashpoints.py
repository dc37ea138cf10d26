"""Named crash points: a writer child dies by SIGKILL at the k-th pass of each point.

``crashpoint_run`` builds a committed base store (some pages spilled), then for every
point of ``POINTS`` and every k copies it and runs a deterministic workload in a child
(``kits.crash.writer_child``: several open/work/close sessions) armed to die at the k-th
hit; the reopened store is judged like the SIGKILL loop's. The creation points run a
child that creates five stores in turn: at the path where it died there must be no
store, or a complete one, never a half-created one.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pagedkv
from pagedkv import faults
from pagedkv.errors import PagedKVError

from .child import Channel
from .crash import GEOM_SMALL, Run, arm_crashpoint, run_writer, writer_child
from .model import Model
from .verdict import LoopResult, fresh_store, history_of, judge, save_artifact
from .workload import Params, Workload

POINTS = (
    "append.after_write", "close.after_commit", "commit.after_commit", "commit.after_flush",
    "commit.before_flush", "create.after_pool", "create.after_superblock", "drop.after_free",
    "evict.after_commit", "evict.before_commit", "lmdb.before_commit", "open.after_lock",
    "restore.after_copy", "step.after_begin", "step.after_end",
)
CREATE_POINTS = ("create.after_pool", "create.after_superblock")


def build_base(path: Path, seed: int, geom: pagedkv.Geometry, pool_pages: int, params: Params) -> Model:
    """A committed store with some spilled pages, to copy before every crash-point run."""
    fresh_store(path, geom, pool_pages)
    store = pagedkv.open(path)
    ids = iter(range(1 << 20, 1 << 21))
    model = Model(seed, geom, finite=True)
    work = Workload(store, model, 0, random.Random(f"base-{seed}"), ids.__next__, params,
                    lambda n, m: None, lambda n: None)
    work.run(40)
    store.close()
    return model


def crashpoint_run(workdir: Path, mode: str, seed: int, points: tuple[str, ...] = POINTS,
                   hits: range = range(1, 6), *, geom: pagedkv.Geometry = GEOM_SMALL,
                   pool_pages: int = 8, sessions: int = 6, ops_per_session: int = 24,
                   params: Params | None = None, artifact_root: Path | None = None) -> LoopResult:
    """For every point and k in ``hits``, a child runs a deterministic workload (several
    open/work/close sessions) and dies by SIGKILL at the k-th hit; the store is judged.
    ``figures['fired:<point>']`` counts the runs in which the point fired.
    """
    params = params or Params()
    result = LoopResult(f"crashpoints-{mode}", seed, artifact_root=artifact_root)
    started = time.monotonic()
    base = workdir / "base"
    base_model = build_base(base, seed, geom, pool_pages, params)
    for point in points:
        result.figures[f"fired:{point}"] += 0
        for k in hits:
            label = f"{point}:{k}"
            if point in CREATE_POINTS:
                problems, fired = _create_point(workdir / f"create-{point}-{k}", mode, seed, point, k,
                                                geom, pool_pages, params, result)
            else:
                problems, fired = _regular_point(workdir / f"run-{point}-{k}", base, base_model, mode,
                                                 point, k, sessions, ops_per_session, params, result)
            result.cycles += 1
            result.figures[f"fired:{point}"] += fired
            if problems:
                result.fail(result.cycles, [f"[{label}] {p}" for p in problems])
    result.elapsed_s = time.monotonic() - started
    return result


def _classify(run: Run, point: str, k: int) -> tuple[list[str], bool]:
    """Did the point fire (SIGKILL), or did the child end normally having passed it < k times?"""
    problems = [f"child error:\n{text}" for text in run.errors()]
    if run.killed_by_us:
        problems.append("the child hung (killed by the safety timeout)")
    if run.sigkilled and not run.killed_by_us:
        return problems, True
    hit_frames = [f[1] for f in run.frames if f[0] == "H"]
    if run.exit_code == 0 and hit_frames:
        passed = hit_frames[-1].get(point, 0)
        if passed >= k:
            problems.append(f"the point was passed {passed} times but did not kill at hit {k}")
    elif not problems:
        problems.append(f"child ended with status {run.status}")
    return problems, False


def _regular_point(path: Path, base: Path, base_model: Model, mode: str, point: str, k: int,
                   sessions: int, ops_per_session: int, params: Params,
                   result: LoopResult) -> tuple[list[str], bool]:
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base, path)
    run = run_writer(writer_child, path, mode, base_model, 0, 2 << 20, params, sessions, ops_per_session,
                     crash=(point, k), safety_s=60.0)
    problems, fired = _classify(run, point, k)
    verdict = judge(path, mode, history_of(run.frames, {0: base_model}), run.acked(0))
    result.figures["state_" + verdict.outcome] += 1
    result.figures["reopen_locked"] += any("StoreLocked" in p for p in verdict.problems)
    problems += verdict.problems
    if problems:
        save_artifact(result, path, f"{point}-{k}")
    shutil.rmtree(path, ignore_errors=True)
    return problems, fired


def _create_point(workdir: Path, mode: str, seed: int, point: str, k: int, geom: pagedkv.Geometry,
                  pool_pages: int, params: Params, result: LoopResult) -> tuple[list[str], bool]:
    """A child creates stores s1..s5 in turn (one session each); the k-th creation dies.

    Stores before it must be complete with their acked state; at the k-th path there must
    be no store, or a complete one, never a half-created one: opening it either creates a
    fresh store or finds the finished one.
    """
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    paths = [workdir / f"s{i}" for i in range(1, 6)]
    run = run_writer(_create_child, paths, mode, seed, point, k, geom, pool_pages, params, safety_s=60.0)
    problems, fired = _classify(run, point, k)
    empty = Model(seed, geom, finite=True)
    per_store: dict[int, dict[int, Model]] = {}
    acked: dict[int, int] = {}
    for frame in run.frames:
        if frame[0] == "I":
            per_store.setdefault(frame[3], {0: empty})[frame[1]] = frame[2]
        elif frame[0] == "A":
            acked[frame[4]] = frame[1]
    attempted = max([f[1] for f in run.frames if f[0] == "S"], default=-1)
    for index, store_path in enumerate(paths):
        if index < attempted or (index == attempted and not fired):
            verdict = judge(store_path, mode, per_store.get(index, {0: empty}), acked.get(index, 0))
            result.figures["state_" + verdict.outcome] += 1
            problems += [f"store s{index + 1}: {p}" for p in verdict.problems]
            continue
        problems += _check_half_created(store_path, mode, geom, pool_pages)
    litter = [p.name for p in workdir.iterdir() if p.name.startswith(".") and ".creating-" in p.name]
    result.figures["create_litter_dirs"] += len(litter)
    if problems:
        save_artifact(result, workdir, f"{point}-{k}")
    shutil.rmtree(workdir, ignore_errors=True)
    return problems, fired


def _create_child(chan: Channel, paths: list[Path], mode: str, seed: int, point: str, k: int,
                  geom: pagedkv.Geometry, pool_pages: int, params: Params) -> None:
    arm_crashpoint(point, k)
    faults._hits.clear()
    for index, store_path in enumerate(paths):
        chan.send(("S", index))
        store = pagedkv.open(store_path, geom, pool_pages, durability=mode)
        ids = iter(range((index + 3) << 20, (index + 4) << 20))

        def intent(number: int, current: Model, index: int = index) -> None:
            chan.send(("I", number, current, index))

        def ack(number: int, index: int = index) -> None:
            chan.send(("A", number, 0, 0, index))

        work = Workload(store, Model(seed, geom, finite=True), 0, random.Random(f"{seed}-create-{index}"),
                        ids.__next__, params, intent, ack)
        work.run(12)
        work.close()
    chan.send(("H", faults.hits()))


def _check_half_created(path: Path, mode: str, geom: pagedkv.Geometry, pool_pages: int) -> list[str]:
    """After a crash during creation: no store (and opening creates a fresh, empty, working
    one) or a complete store. Never a directory that exists but does not open."""
    problems = []
    existed = path.exists() and any(path.iterdir())
    if not existed:
        try:
            pagedkv.open(path)
            problems.append(f"{path.name}: opening a missing store without geometry did not fail")
        except PagedKVError:
            pass
        if path.exists() and any(path.iterdir()):
            problems.append(f"{path.name}: a failed open left files behind: {sorted(os.listdir(path))}")
    try:
        store = pagedkv.open(path, geom, pool_pages, durability=mode)
    except Exception as exc:  # noqa: BLE001
        return problems + [f"{path.name}: {'existing' if existed else 'fresh'} store does not open: {exc!r}"]
    try:
        if not existed and store.sequences():
            problems.append(f"{path.name}: a freshly created store holds {store.sequences()}")
        problems += [f"{path.name}: check(): {p}" for p in store.check()]
        probe = Model(1, geom, finite=True)
        probe.create("probe", key=1)
        store.create("probe")
        store.append("probe", *probe.next_kv("probe", 5))
        store.close()
        store = pagedkv.open(path, durability=mode)
        k, v = store.read("probe")
        if probe.wrong_tokens("probe", 0, 5, k, v):
            problems.append(f"{path.name}: the probe sequence reads back wrong")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{path.name}: using the store after the crash raised {exc!r}")
    finally:
        store._abandon()
    return problems
