"""After a crash: which commit the reopened store holds, what it lost, and a loop's figures.

* ``verify_contents(store, model)``: every sequence against the model: (problems, lost
  pages, wrong tokens). A page that raises ``PageCorrupt`` is a lost committed page; bytes
  that differ from the model are wrong data.
* ``judge(path, mode, history, acked)``: reopen and match the store with the last acked
  commit or the one after it (a commit that completed without its ack); anything else is
  a violation.
* ``LoopResult``: a crash loop's cycles, figures and violations; ``save_artifact`` copies
  a failing store aside. ``scratch_root`` / ``fresh_store``: where loops keep their stores.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pagedkv
from pagedkv.errors import PageCorrupt, PagedKVError
from pagedkv.storage.files import filesystem_type

from .model import Model


@dataclass
class Verdict:
    """What ``judge`` found."""

    outcome: str  # acked | acked+1 | lost-acked | mismatch | reopen-failed
    number: int  # the commit the store was matched (or compared) against
    model: Model
    problems: list[str]
    lost_pages: int = 0
    wrong_tokens: int = 0


def verify_contents(store: pagedkv.KVStore, model: Model) -> tuple[list[str], int, int]:
    """Compare every sequence of ``store`` with ``model``: (problems, lost pages, wrong tokens)."""
    page_size = store.geometry.page_size
    problems: list[str] = []
    lost = wrong = 0
    try:
        problems += [f"check(): {p}" for p in store.check()]
    except PagedKVError as exc:
        problems.append(f"check() raised {exc!r}")
    have, want = set(store.sequences()), set(model.lens)
    if have != want:
        problems.append(f"sequences differ: missing {sorted(want - have)}, unexpected {sorted(have - want)}")
    for sid in sorted(have & want):
        length = store.length(sid)
        if length != model.lens[sid]:
            problems.append(f"sequence {sid}: {length} tokens, expected {model.lens[sid]}")
            continue
        try:
            k, v = store.read(sid)
            bad = model.wrong_tokens(sid, 0, length, k, v)
        except PageCorrupt:
            bad = 0
            for first in range(0, length, page_size):  # count page by page
                last = min(length, first + page_size)
                try:
                    k, v = store.read(sid, first, last)
                    bad += model.wrong_tokens(sid, first, last, k, v)
                except PageCorrupt as exc:
                    lost += 1
                    problems.append(f"sequence {sid} page {first // page_size}: lost ({exc})")
        if bad:
            wrong += bad
            problems.append(f"sequence {sid}: {bad} tokens returned with wrong bytes")
    return problems, lost, wrong


def judge(path: Path, mode: str, history: dict[int, Model], acked: int) -> Verdict:
    """Reopen ``path`` and decide which commit it holds: acked, or acked+1 (a commit that
    completed without its ack); any other state, a reopen failure, a lost page or a wrong
    byte is a violation. Closes the store (a commit) when it opened.
    """
    problems: list[str] = []
    try:
        store = pagedkv.open(path, durability=mode)
    except pagedkv.StoreLocked as exc:
        # The writer was SIGKILLed and reaped, yet its lock is seen: a reopen failure. Find
        # out whether it is the kernel releasing the dead holder's flock late (diagnosis only).
        free_after_ms = _lock_free_after_ms(path / "LOCK")
        problems.append(f"reopen failed: {exc!r} although that writer is dead and reaped; "
                        f"the lock was free {free_after_ms:.1f} ms later" if free_after_ms is not None
                        else f"reopen failed: {exc!r}; the lock was still held 1 s later")
        try:
            store = pagedkv.open(path, durability=mode)
        except Exception as again:  # noqa: BLE001
            return Verdict("reopen-failed", acked, history[acked], problems + [f"and again: {again!r}"])
    except Exception as exc:  # noqa: BLE001 - any failure to reopen is the finding
        return Verdict("reopen-failed", acked, history[acked], [f"reopen failed: {exc!r}"])
    try:
        shape = {sid: store.length(sid) for sid in store.sequences()}
        number, outcome = acked, "mismatch"
        for candidate, label in ((acked + 1, "acked+1"), (acked, "acked")):
            if candidate in history and history[candidate].lengths() == shape:
                number, outcome = candidate, label
                break
        else:
            older = [n for n in sorted(history, reverse=True) if n < acked and history[n].lengths() == shape]
            if older:
                number, outcome = older[0], "lost-acked"
                problems.append(f"lost acked commit: the store holds commit {older[0]}, {acked} was acked")
            else:
                problems.append(f"the store holds no known commit (acked {acked}): {shape}")
        found, lost, wrong = verify_contents(store, history[number])
        problems += found
    except Exception as exc:  # noqa: BLE001
        problems.append(f"verification raised {exc!r}")
        number, outcome, lost, wrong = acked, "mismatch", 0, 0
        store._abandon()
    else:
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"close after verification raised {exc!r}")
    return Verdict(outcome, number, history[number], problems, lost, wrong)


def _lock_free_after_ms(lock_path: Path, limit_s: float = 1.0) -> float | None:
    """Milliseconds until an exclusive flock on ``lock_path`` succeeds (None: not within limit).

    Diagnosis only, after a violation: the lock offers nothing to wait on, so this polls.
    """
    started = time.monotonic()
    fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while time.monotonic() - started < limit_s:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(0.0002)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return (time.monotonic() - started) * 1e3
        return None
    finally:
        os.close(fd)


# -- results -------------------------------------------------------------------------------


@dataclass
class LoopResult:
    """A crash loop's cycles, figures and violations."""

    name: str
    seed: int
    cycles: int = 0
    figures: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    violation_cycles: int = 0
    elapsed_s: float = 0.0
    artifacts: list[str] = field(default_factory=list)
    artifact_root: Path | None = None  # where failing stores are copied (PAGEDKV_ARTIFACTS wins)

    def fail(self, cycle: int, problems: list[str], keep: int = 30) -> None:
        """Record a violating cycle (its first ``keep`` problems)."""
        self.violation_cycles += 1
        for problem in problems:
            if len(self.violations) < keep:
                self.violations.append(f"cycle {cycle}: {problem}")

    def summary(self) -> str:
        """A few lines: the figures, the violations, the artifacts."""
        figures = ", ".join(f"{key}={value}" for key, value in sorted(self.figures.items()))
        lines = [f"[{self.name}] seed={self.seed} cycles={self.cycles} "
                 f"violating_cycles={self.violation_cycles} time={self.elapsed_s:.1f}s", f"  {figures}"]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        lines += [f"  artifact: {a}" for a in self.artifacts]
        return "\n".join(lines)


def save_artifact(result: LoopResult, path: Path, label: str, limit: int = 5) -> None:
    """Copy a failing store directory under ``PAGEDKV_ARTIFACTS`` (default: beside it)."""
    if len(result.artifacts) >= limit or not path.exists():
        return
    root = Path(os.environ.get("PAGEDKV_ARTIFACTS") or result.artifact_root or path.parent / "artifacts")
    dest = root / f"{result.name}-{label}"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(path, dest, ignore_dangling_symlinks=True)
    result.artifacts.append(str(dest))


def scratch_root(power_loss: bool) -> Path | None:
    """Where a loop keeps its stores: ``PAGEDKV_CRASH_DIR`` if set; else, for the simulated
    power loss only, /dev/shm when it is a writable tmpfs; else None (the caller's dir).

    The power-loss loop models durability itself (flush recorder, on-disk LMDB), so it needs
    no real disk and on tmpfs a cycle costs CPU only. The SIGKILL loops stay on the caller's
    (real) filesystem, where the kernel's handling of a killed writer's files is what users get.
    """
    forced = os.environ.get("PAGEDKV_CRASH_DIR")
    if forced:
        return Path(forced)
    shm = Path("/dev/shm")
    if power_loss and shm.is_dir() and filesystem_type(str(shm)) == "tmpfs" and os.access(shm, os.W_OK):
        return shm
    return None


def fresh_store(path: Path, geom: pagedkv.Geometry, pool_pages: int) -> None:
    """An empty store at ``path`` (whatever was there is removed), closed."""
    shutil.rmtree(path, ignore_errors=True)
    pagedkv.open(path, geom, pool_pages).close()


def history_of(frames: list[Any], start: dict[int, Model]) -> dict[int, Model]:
    """``start`` plus the model of every commit a child announced (``("I", n, model)`` frames)."""
    history = dict(start)
    for frame in frames:
        if frame[0] == "I":
            history[frame[1]] = frame[2]
    return history
