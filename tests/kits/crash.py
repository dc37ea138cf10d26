"""The SIGKILL loop: a writer child runs the random workload and is killed at a random moment.

``sigkill_loop`` forks a child (``kits.child.Child``) that opens the store and runs
``kits.workload.Workload``, announcing every commit before it starts (``("I", n, model)``)
and acking it once it returned (``("A", n, evictions, restores)``); the parent SIGKILLs it
after a random delay or a little after a random frame, reopens the store and judges it
(``kits.verdict.judge``): the last acked commit or the one after it, never less, never a
wrong byte. The next child continues from the reopened store.

``writer_child`` is the child's body, shared with the crash points of ``kits.crashpoints``;
``library_crashpoints`` lists every named crash point of the library; ``reuse_pending_slots``
and ``slow_helper_processes`` are the planted bug and the race widener the tests use.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lmdb
import numpy as np

import pagedkv
from pagedkv import faults
from pagedkv.pages.manager import BlockManager

from .child import Channel, Child
from .model import Model
from .verdict import LoopResult, fresh_store, history_of, judge, save_artifact
from .workload import Params, Workload

# 256-byte pages (2 layers x K/V x 4 tokens x 1 head x 8 dims x fp16): cheap kill cycles.
GEOM_SMALL = pagedkv.Geometry(layers=2, kv_heads=1, head_dim=8, page_size=4, dtype="float16")


def library_crashpoints() -> set[str]:
    """Every ``faults.crashpoint("name")`` call in the pagedkv sources."""
    root = Path(pagedkv.__file__).parent
    found: set[str] = set()
    for source in root.rglob("*.py"):
        found |= set(re.findall(r"crashpoint\(\s*[\"']([^\"']+)[\"']\s*\)", source.read_text()))
    return found


# -- the child --------------------------------------------------------------------------------


def reuse_pending_slots() -> None:
    """Planted bug: a slot freed since the last commit is reused before that commit."""
    original = BlockManager.take_slots

    def take_slots(self: BlockManager, count: int) -> list[int]:
        pending = np.flatnonzero((self.slot_pid < 0) & (self.slot_cpid >= 0)).tolist()
        self.free_slots.extend(s for s in pending if s not in self.free_slots)
        return original(self, count)

    BlockManager.take_slots = take_slots  # type: ignore[method-assign]


def slow_helper_processes(delay_ms: float) -> None:
    """Widen a race window: a helper process the library forks (any process but this one)
    waits ``delay_ms`` before it opens the LMDB environment.

    Whatever such a helper still holds from its parent at that point (the writer's LOCK
    descriptor, say) then outlives a SIGKILL of the parent deterministically, not by chance.
    """
    writer_pid, real_open = os.getpid(), lmdb.open

    def slow_open(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() != writer_pid:
            time.sleep(delay_ms / 1e3)  # the delay is the point: a window held open on purpose
        return real_open(*args, **kwargs)

    lmdb.open = slow_open


def arm_crashpoint(point: str, hit: int) -> None:
    """Make this process die by SIGKILL at the ``hit``-th pass of crash point ``point``."""
    os.environ["PAGEDKV_CRASHPOINT"] = f"{point}:{hit}"
    faults._load_crashpoint()


def writer_child(chan: Channel, path: Path, mode: str, model: Model, commit_no: int, id_base: int,
                 params: Params, sessions: int, ops_per_session: int, crash: tuple[str, int] | None = None,
                 mutation: str | None = None, map_size: int | None = None, helper_delay_ms: float = 0.0) -> None:
    """The body of a forked writer. Frames: ``("R",)`` store open, ``("I", n, model)`` before
    commit n, ``("A", n, evictions, restores)`` after it returned, ``("H", hits)`` at a
    normal end (an exception comes back through the harness).
    """
    if helper_delay_ms:
        slow_helper_processes(helper_delay_ms)
    if crash is not None:
        arm_crashpoint(*crash)
    faults._hits.clear()
    if mutation == "reuse-pending":
        reuse_pending_slots()
    ids = iter(range(id_base, id_base + (1 << 30)))
    rng = random.Random(f"{model.seed}-{id_base}")
    stats = [0, 0]

    def intent(number: int, current: Model) -> None:
        chan.send(("I", number, current))

    def ack(number: int) -> None:
        chan.send(("A", number, *stats))

    for _ in range(sessions):
        store = pagedkv.open(path, durability=mode, map_size=map_size)
        chan.send(("R",))
        work = Workload(store, model, commit_no, rng, ids.__next__, params, intent, ack)
        for _ in range(ops_per_session):
            work.one()
            counts = store._stats.counts
            stats[:] = counts["evictions"], counts["restores"]
        work.close()
        commit_no = work.commit_no
    chan.send(("H", faults.hits()))


@dataclass
class Run:
    """How a writer child ended: its wait status, its frames, whether the parent killed it."""

    status: int
    frames: list[Any]
    killed_by_us: bool

    @property
    def sigkilled(self) -> bool:
        return os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == signal.SIGKILL

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.status) if os.WIFEXITED(self.status) else None

    def acked(self, default: int) -> int:
        """The last commit the child acked (``default`` if none)."""
        return max([f[1] for f in self.frames if f[0] == "A"], default=default)

    def errors(self) -> list[str]:
        """The tracebacks of what the child raised."""
        return [f"{f[1]}\n{f[2]}" for f in self.frames if f[0] == "crashed"]


def run_writer(body: Callable[..., None], *args: Any, kill_after_s: float | None = None,
               kill_after: int | None = None, extra_s: float = 0.0, safety_s: float = 60.0,
               **kwargs: Any) -> Run:
    """Fork ``body(channel, *args, **kwargs)``; collect its frames until it ends or is SIGKILLed
    (see ``Child.collect``)."""
    child = Child(lambda chan: body(chan, *args, **kwargs))
    try:
        frames = child.collect(kill_after_s=kill_after_s, kill_after=kill_after, extra_s=extra_s,
                               safety_s=safety_s)
    except BaseException:
        child.kill()  # interrupted (a test timeout, say): never leave a child running
        raise
    return Run(child.wait(), frames, child.killed)


# -- the loop ---------------------------------------------------------------------------------


def sigkill_loop(path: Path, mode: str, cycles: int, seed: int, *, geom: pagedkv.Geometry = GEOM_SMALL,
                 pool_pages: int = 12, kill_min_ms: float = 1.0, kill_max_ms: float = 50.0,
                 time_share: float = 0.4, params: Params | None = None, mutation: str | None = None,
                 helper_delay_ms: float = 0.0, name: str | None = None, stop_after_lost: bool = False,
                 artifact_root: Path | None = None,
                 progress: Callable[[LoopResult], None] | None = None) -> LoopResult:
    """Fork a child that opens the store and runs the random workload, acking every returned
    commit; SIGKILL it at a random moment; reopen and judge. The next child continues from
    the reopened store. The parent never holds the store open across ``fork``.
    A share ``time_share`` of the kills land U(``kill_min_ms``, ``kill_max_ms``) ms after the
    fork, the others a little after a random frame (a random point of the commit stream).
    """
    assert faults._crash_name is None, "PAGEDKV_CRASHPOINT is set in the test process"
    params = params or Params()
    result = LoopResult(name or f"sigkill-{mode}", seed, artifact_root=artifact_root)
    rng = random.Random(seed)
    started = time.monotonic()
    fresh_store(path, geom, pool_pages)
    model, commit_no = Model(seed, geom, finite=True), 0
    for cycle in range(cycles):
        id_base = (cycle + 1) << 20
        # Half the children open with a tiny LMDB map, so map growth happens under the kills.
        map_size = 1 << 15 if rng.random() < 0.5 else None
        args = (writer_child, path, mode, model, commit_no, id_base, params, 1, 20000)
        options = dict(mutation=mutation, map_size=map_size, helper_delay_ms=helper_delay_ms)
        if rng.random() < time_share:  # a random moment after the fork
            result.figures["kill_by_time"] += 1
            run = run_writer(*args, kill_after_s=rng.uniform(kill_min_ms, kill_max_ms) / 1e3, **options)
        else:  # a random point in the commit stream, a little later
            result.figures["kill_by_frames"] += 1
            run = run_writer(*args, kill_after=rng.randint(1, 14), extra_s=rng.uniform(0.0, 3.0) / 1e3,
                             safety_s=30.0, **options)
        result.cycles += 1
        history = history_of(run.frames, {commit_no: model})
        acked = run.acked(commit_no)
        acks = [f for f in run.frames if f[0] == "A"]
        result.figures["acked_commits"] += acked - commit_no
        if acks:
            result.figures["evictions"] += acks[-1][2]
            result.figures["restores"] += acks[-1][3]
        if not any(f[0] == "R" for f in run.frames):
            result.figures["killed_before_open"] += 1
        problems = [f"child error:\n{text}" for text in run.errors()]
        if run.sigkilled:
            result.figures["sigkilled"] += 1
        elif not problems:
            problems.append(f"child ended without SIGKILL (status {run.status})")
        verdict = judge(path, mode, history, acked)
        result.figures["state_" + verdict.outcome] += 1
        result.figures["reopen_locked"] += any("StoreLocked" in p for p in verdict.problems)
        result.figures["lost_pages"] += verdict.lost_pages
        result.figures["wrong_tokens"] += verdict.wrong_tokens
        problems += verdict.problems
        if problems:
            result.fail(cycle, problems)
            save_artifact(result, path, f"cycle{cycle}")
            fresh_store(path, geom, pool_pages)
            model, commit_no = Model(seed, geom, finite=True), 0
        else:
            model, commit_no = verdict.model, verdict.number
        if progress is not None:
            progress(result)
        if stop_after_lost and result.figures["lost_pages"]:
            break
    result.elapsed_s = time.monotonic() - started
    return result
