"""I/O fault loops (docs/reliability.md T5): every I/O op of a workload fails in turn, once or for ever.

SQLite style: each workload is run once to count the I/O ops it performs
(``pagedkv.faults.io``: fallocate, flush, put, commit, set_mapsize); then, for every
k, it is run again with op k failing once, and with op k and every later op failing.
Each run must raise a typed error (``StoreIOError``/``StoreFull``), leave the handle
poisoned (``StoreClosed``), and leave on disk exactly the last returned commit or,
when the failing call was itself a commit, the one it was making; after a fail-once
the store reopens and the rest of the workload completes. A fault may also strike the
reopen that follows a crash, or a volatile re-creation.

Real exhaustion (a file size limit, a full disk, a full LMDB map): tests/test_exhaustion.py.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import PagedKVError, StoreClosed

from tests.kits.child import describe
from tests.kits.content import get_seed
from tests.kits.faults import ABSENT, PROBE, TYPED_IO, Injector, disk_state, model_state, scales, soak
from tests.kits.files import copy_store
from tests.kits.model import Model, build_committed
from tests.kits.store import GEOM



POOL_PAGES = 8
SMALL_MAP = 64 << 10  # small enough that the workloads grow the LMDB map (set_mapsize ops)

# -- workloads ----------------------------------------------------------------------------
# A step is a tuple: ("open", kwargs) | ("create", seq) | ("append", seq, tokens) |
# ("read", seq) | ("fork", src, dst) | ("drop", seq) | ("commit",) | ("verify",) | ("close",)

OPEN_CREATE = ("open", dict(geometry=GEOM, pool_pages=POOL_PAGES, map_size=SMALL_MAP))
OPEN = ("open", dict(map_size=SMALL_MAP))

APPEND_HEAVY = [
    OPEN_CREATE,
    ("create", "a"), ("append", "a", 6), ("create", "b"), ("append", "b", 9), ("commit",),
    ("append", "a", 5), ("fork", "a", "c"), ("append", "c", 3), ("commit",),
    ("drop", "b"), ("append", "a", 7), ("append", "c", 10), ("commit",),
    ("read", "a"), ("append", "a", 2), ("close",),
]
EVICT_HEAVY = [
    OPEN,
    ("create", "n"), ("append", "n", 20), ("commit",),
    ("append", "x", 6), ("commit",),
    ("create", "m"), ("append", "m", 16), ("drop", "y"), ("commit",),
    ("append", "n", 9), ("close",),
]
RESTORE_HEAVY = [
    OPEN,
    ("read", "x"), ("read", "y"), ("commit",),
    ("read", "z"), ("append", "x", 3), ("commit",),
    ("read", "y"), ("read", "x"), ("drop", "z"), ("commit",),
    ("read", "y"), ("close",),
]


def _template(root: Path, seqs: dict[str, int], seed: int) -> tuple[Path, Model]:
    """A closed store holding ``seqs`` (id -> tokens), one commit per sequence."""
    path = root / "template"
    return path, build_committed(path, seqs, seed, POOL_PAGES, map_size=SMALL_MAP)


@dataclass
class Workload:
    name: str
    steps: list[tuple[Any, ...]]
    seqs: dict[str, int] | None  # template content; None: the workload creates the store


WORKLOADS = {
    "append": Workload("append", APPEND_HEAVY, None),
    "evict": Workload("evict", EVICT_HEAVY, {"x": 12, "y": 12, "z": 8}),
    "restore": Workload("restore", RESTORE_HEAVY, {"x": 20, "y": 20, "z": 20}),
}


def committing(step: tuple[Any, ...]) -> bool:
    """Whether a step, if it returns, makes a new commit durable."""
    return step[0] in ("commit", "close") or (step[0] == "open" and "geometry" in step[1])


@dataclass
class Ctx:
    path: Path
    model: Model
    store: pagedkv.KVStore | None = None


def apply(ctx: Ctx, step: tuple[Any, ...]) -> None:
    op, args = step[0], step[1:]
    store, model = ctx.store, ctx.model
    if op == "open":
        ctx.store = pagedkv.open(ctx.path, **args[0])
    elif op == "create":
        model.create(args[0])
        store.create(args[0])
    elif op == "append":
        k, v = model.next_kv(args[0], args[1])
        store.append(args[0], k, v)
    elif op == "read":
        model.verify(store, args[0])
    elif op == "verify":
        model.verify_all(store)
    elif op == "fork":
        store.fork(*args)
        model.fork(*args)
    elif op == "drop":
        store.drop(args[0])
        model.drop(args[0])
    elif op == "commit":
        store.commit()
    elif op == "close":
        store.close()
    else:
        raise ValueError(op)


# -- states on disk -------------------------------------------------------------------------

@dataclass
class Reference:
    """The fault-free run: its op names and the state after every commit."""

    ops: list[str]
    models: list[Model | None]  # models[j]: the model of the j-th durable state
    states: list[Any]
    after_step: list[int]  # index of the step that made state j (-1: the starting state)
    seed: int

    def model(self, j: int) -> Model:
        """A fresh copy of the model of state j (an empty model for the absent state)."""
        found = self.models[j]
        return copy.deepcopy(found) if found is not None else Model(self.seed)


def reference_run(path: Path, steps: list[tuple[Any, ...]], start: Model | None, seed: int) -> Reference:
    ctx = Ctx(path, copy.deepcopy(start) if start is not None else Model(seed))
    models: list[Model | None] = [copy.deepcopy(start) if start is not None else None]
    after = [-1]
    with Injector() as counter:
        for index, step in enumerate(steps):
            apply(ctx, step)
            if committing(step):
                models.append(copy.deepcopy(ctx.model))
                after.append(index)
    assert ctx.store is not None and ctx.store._closed, "a workload ends with close"
    states = [model_state(m) for m in models]
    assert disk_state(path) == states[-1]
    return Reference(counter.names, models, states, after, seed)


# -- one faulted run ---------------------------------------------------------------------------


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    runs: int = 0
    retries: int = 0
    by_type: dict[str, int] = field(default_factory=dict)

    def add(self, where: str, problem: str) -> None:
        self.problems.append(f"{where}: {problem}")

    def check(self, figures: str = "") -> None:
        print(f"{figures}runs={self.runs} retries={self.retries} errors={self.by_type}")
        if self.problems:
            shown = "\n  ".join(self.problems[:25])
            more = f"\n  ... and {len(self.problems) - 25} more" if len(self.problems) > 25 else ""
            raise AssertionError(f"{len(self.problems)} violations:\n  {shown}{more}")


def run_faulted(path: Path, steps: list[tuple[Any, ...]], ref: Reference, k: int, forever: bool,
                report: Report, label: str, reopen: tuple[Any, ...]) -> None:
    """Run ``steps`` from the reference's starting state with op ``k`` failing; check everything."""
    code = errno.ENOSPC if k % 3 == 0 else errno.EIO
    where = f"{label} k={k} ({ref.ops[k - 1]}) {'forever' if forever else 'once'}"
    report.runs += 1
    ctx = Ctx(path, ref.model(0))
    done = 0  # durable states reached after the start
    failed: tuple[int, BaseException] | None = None
    with Injector(fail_at=k, forever=forever, code=code) as injector:
        for index, step in enumerate(steps):
            try:
                apply(ctx, step)
            except AssertionError as exc:
                report.add(where, f"WRONG DATA at step {index} {step}: {exc}")
                failed = (index, exc)
                break
            except BaseException as exc:  # noqa: BLE001 - classified below
                failed = (index, exc)
                break
            if committing(step):
                done += 1
        fired = injector.fired
        if fired is None:
            report.add(where, f"the workload performed only {injector.count} ops; op {k} never ran "
                              "(op sequence is not deterministic)")
        if failed is None:
            if fired is not None:
                report.add(where, f"the injected fault at op {fired[0]} ({fired[1]}) was swallowed")
            return
        index, exc = failed
        step = steps[index]
        name = type(exc).__name__
        report.by_type[name] = report.by_type.get(name, 0) + 1
        if not isinstance(exc, TYPED_IO):
            report.add(where, f"step {index} {step} raised {describe(exc)}, not StoreIOError/StoreFull")
        # The handle must be poisoned: the next write raises StoreClosed and does nothing.
        store = ctx.store
        if store is not None:
            try:
                store.create(PROBE)
            except StoreClosed:
                pass
            except BaseException as probe_exc:  # noqa: BLE001
                report.add(where, f"after the fault a write raised {describe(probe_exc)}, not StoreClosed")
            else:
                report.add(where, f"handle not poisoned after {name} in step {index} {step}")
                store._abandon()
            try:
                store.close()  # a poisoned handle closes without committing or raising
            except BaseException as close_exc:  # noqa: BLE001
                report.add(where, f"close() of the poisoned handle raised {describe(close_exc)}")
                store._abandon()
        # On disk: the last returned commit, or (a commit step) the one being made. A
        # read-only open performs no I/O op at all, so it works even under fail-forever.
        allowed = [done] + ([done + 1] if committing(step) else [])
        before = injector.count
        try:
            state = disk_state(path)
        except BaseException as open_exc:  # noqa: BLE001
            report.add(where, f"read-only reopen failed: {describe(open_exc)}")
            return
        if injector.count != before:
            report.add(where, f"a read-only open and read performed {injector.count - before} I/O ops")
        matched = [j for j in allowed if ref.states[j] == state]
        if not matched:
            report.add(where, f"after a fault in step {index} {step} the store is neither commit "
                              f"{allowed} of the reference (partial or lost commit)")
            return
        leftovers = [n for n in os.listdir(path.parent) if n != path.name]
        if leftovers:
            report.add(where, f"files left beside the store: {leftovers}")
        if forever:
            return
        # Fail-once: reopen and finish the workload from the state found.
        report.retries += 1
        j = matched[-1]
        ctx = Ctx(path, ref.model(j))
        rest = steps[ref.after_step[j] + 1:]
        if state != ABSENT:
            rest = [reopen, ("verify",), *[s for s in rest if s[0] != "open"]]
            if rest[-1] != ("close",):
                rest.append(("close",))
        try:
            for step in rest:
                apply(ctx, step)
        except BaseException as retry_exc:  # noqa: BLE001
            report.add(where, f"retry after reopen failed at {step}: {describe(retry_exc)}")
            if ctx.store is not None:
                ctx.store._abandon()
            return
    final = disk_state(path)
    if final != ref.states[-1]:
        report.add(where, "after the retry the store differs from the fault-free run's")
    store = pagedkv.open(path)
    try:
        problems = store.check()
    finally:
        store.close()
    if problems:
        report.add(where, f"check() after the retry: {problems[:3]}")


def fault_loop(tmp_path: Path, workload: Workload, forever: bool, seed: int) -> tuple[Report, int]:
    start_model = None
    template = None
    if workload.seqs is not None:
        template, start_model = _template(tmp_path, workload.seqs, seed)
    steps = workload.steps
    reopen = OPEN

    def fresh(name: str) -> Path:
        root = tmp_path / name
        root.mkdir()
        if template is None:
            return root / "store"
        return copy_store(template, root / "store")

    ref = reference_run(fresh("reference"), steps, start_model, seed)
    report = Report()
    total = len(ref.ops)
    for k in range(1, total + 1):
        path = fresh(f"k{k}")
        run_faulted(path, steps, ref, k, forever, report, workload.name, reopen)
        shutil.rmtree(path.parent)
    return report, total


@pytest.mark.slow
@pytest.mark.parametrize("forever", [False, True], ids=["once", "forever"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_io_fault_every_op(fast_tmp: Path, name: str, forever: bool) -> None:
    seed = get_seed(f"T5 {name}")
    report, total = fault_loop(fast_tmp, WORKLOADS[name], forever, seed)
    assert total >= 20, f"the {name} workload performs only {total} I/O ops"
    report.check(f"T5 {name} {'fail-forever' if forever else 'fail-once'}: ops={total} ")


def random_workload(rng: random.Random, number: int) -> Workload:
    """A random workload for the soak run: creation or a template, then mixed steps."""
    seqs = None if rng.random() < 0.3 else {f"t{i}": rng.randrange(1, 30) for i in range(rng.randrange(1, 5))}
    steps: list[tuple[Any, ...]] = [OPEN_CREATE if seqs is None else OPEN]
    live = list(seqs or {})
    fresh = 0
    for _ in range(rng.randrange(10, 24)):
        roll = rng.random()
        if not live or roll < 0.15:
            fresh += 1
            live.append(f"n{fresh}")
            steps.append(("create", live[-1]))
        elif roll < 0.5:
            steps.append(("append", rng.choice(live), rng.randrange(1, 14)))
        elif roll < 0.65:
            steps.append(("read", rng.choice(live)))
        elif roll < 0.72:
            fresh += 1
            live.append(f"f{fresh}")
            steps.append(("fork", rng.choice(live[:-1]), live[-1]))
        elif roll < 0.8 and len(live) > 1:
            steps.append(("drop", live.pop(rng.randrange(len(live)))))
        else:
            steps.append(("commit",))
    steps += [("commit",), ("close",)]
    return Workload(f"random{number}", steps, seqs)


@pytest.mark.soak
@pytest.mark.timeout(0)
@pytest.mark.skipif(not soak(), reason="soak size: PAGEDKV_SOAK=1 pytest -m soak")
@pytest.mark.parametrize("number", range(7))
def test_io_fault_every_op_random_workloads(fast_tmp: Path, number: int) -> None:
    """Soak: seven more workloads (ten in all), every op failing once and forever."""
    seed = get_seed(f"T5 random workload {number}")
    workload = random_workload(random.Random(seed), number)
    for forever in (False, True):
        root = fast_tmp / ("forever" if forever else "once")
        root.mkdir()
        report, total = fault_loop(root, workload, forever, seed)
        report.check(f"T5 {workload.name} {'fail-forever' if forever else 'fail-once'}: ops={total} ")


def test_io_fault_ops_cover_every_seam(tmp_path: Path) -> None:
    """The three workloads together reach every I/O seam the loop is meant to fail."""
    seen: set[str] = set()
    for name, workload in WORKLOADS.items():
        root = tmp_path / name
        root.mkdir()
        template, model = (None, None)
        if workload.seqs is not None:
            template, model = _template(root, workload.seqs, 7)
            path = copy_store(template, root / "run")
        else:
            path = root / "run"
        seen |= set(reference_run(path, workload.steps, model, 7).ops)
    assert {"fallocate", "flush", "put", "commit", "set_mapsize"} <= seen, seen


# -- compound: a fault during the reopen that follows a crash --------------------------------


def compound_runs(tmp_path: Path, seed: int, runs: int) -> Report:
    rng = random.Random(seed)
    report = Report()
    names = list(WORKLOADS)
    templates: dict[str, tuple[Path | None, Model | None]] = {}
    for name in names:
        workload = WORKLOADS[name]
        if workload.seqs is not None:
            root = tmp_path / f"tpl-{name}"
            root.mkdir()
            templates[name] = _template(root, workload.seqs, seed)
        else:
            templates[name] = (None, None)
    for run in range(runs):
        name = names[run % len(names)]
        workload = WORKLOADS[name]
        template, start = templates[name]
        steps = workload.steps
        crash_at = rng.randrange(1, len(steps) - 1)  # the crash comes before this step
        root = tmp_path / f"run{run}"
        root.mkdir()
        path = root / "store" if template is None else copy_store(template, root / "store")
        # Run the prefix without faults, remember the last commit, then crash (_abandon).
        ctx = Ctx(path, copy.deepcopy(start) if start is not None else Model(seed))
        last = copy.deepcopy(ctx.model)
        last_step = -1
        for index, step in enumerate(steps[:crash_at]):
            apply(ctx, step)
            if committing(step):
                last, last_step = copy.deepcopy(ctx.model), index
        ctx.store._abandon()
        crashed = root / "crashed"
        shutil.move(str(path), str(crashed))
        # Recovery = reopen, read everything, finish the workload. Count its ops, then fail one.
        recovery = [OPEN, ("verify",),
                    *[s for s in steps[last_step + 1:] if s[0] != "open"]]
        ref_path = copy_store(crashed, root / "ref")
        ref = reference_run(ref_path, recovery, last, seed)
        if not ref.ops:
            continue
        k = rng.randrange(1, len(ref.ops) + 1)
        forever = rng.random() < 0.5
        path = copy_store(crashed, root / "faulted" / "store")
        run_faulted(path, recovery, ref, k, forever, report,
                    f"compound#{run} {name} crash-before-step-{crash_at}", recovery[0])
        shutil.rmtree(root)
    return report


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_io_fault_during_reopen_after_crash(fast_tmp: Path, scale: str) -> None:
    seed = get_seed("T5 compound")
    runs = {"ci": 100, "soak": 1000}[scale]
    compound_runs(fast_tmp, seed, runs).check(f"T5 compound (seed {seed}): ")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_io_fault_during_volatile_recreate(tmp_path: Path, k: int) -> None:
    """A volatile reopen recreates the store: a fault there is typed and a retry recovers."""
    path = tmp_path / "store"
    store = pagedkv.open(path, GEOM, POOL_PAGES, durability="volatile")
    store.create("a")
    store._abandon()  # a crash of the volatile user
    with Injector() as counter:
        pagedkv.open(path, durability="volatile").close()
    assert k <= len(counter.names), counter.names
    with Injector(fail_at=k) as injector:
        with pytest.raises(PagedKVError) as info:
            pagedkv.open(path, durability="volatile")
        assert injector.fired is not None
    assert isinstance(info.value, TYPED_IO), describe(info.value)
    again = pagedkv.open(path, durability="volatile")  # the retry starts an empty store
    try:
        assert again.sequences() == []
        assert again.check() == []
    finally:
        again.close()


def test_ops_counter_sees_no_io_in_readonly_open(tmp_path: Path) -> None:
    """Sanity of the T5 oracle: a read-only open and full read performs no injectable I/O op."""
    template, model = _template(tmp_path, {"x": 20, "y": 20, "z": 20}, 5)
    with Injector(fail_at=1, forever=True) as injector:
        store = pagedkv.open(template, readonly=True)
        try:
            model.verify_all(store)
        finally:
            store.close()
    assert injector.count == 0, injector.names
