"""``pagedkv.open(..., lock_timeout=s)``: wait for another process's writer lock instead of failing.

The holder is a real second process that opens the store as a writer, says so on its
stdout and releases the lock (closing the store) when a line arrives on its stdin; the
waiting side learns that it is waiting from the lock-wait log record. No sleeps.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import PagedKVError, StoreLocked

from tests.kits.store import GEOM



HOLDER = r"""
import sys
import pagedkv
store = pagedkv.open(sys.argv[1])
store.create("held")
print("locked", flush=True)
sys.stdin.readline()
store.close()
print("released", flush=True)
"""


class Holder:
    """A child process holding the store's writer lock until ``release()``."""

    def __init__(self, path: Path) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line == "locked\n", f"the holder did not take the lock: {line!r}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        self.proc.stdin.write("\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def finish(self) -> None:
        if self.proc.poll() is None:
            try:
                self.release()
            except BrokenPipeError:
                pass
        assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    pagedkv.open(path, GEOM, 8).close()
    return path


@pytest.fixture
def holder(store_path: Path):
    held = Holder(store_path)
    yield held
    held.finish()


class Waiting(logging.Handler):
    """Sets ``event`` when the lock-wait record is emitted (the opener is now polling)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = threading.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if "waiting" in record.getMessage():
            self.event.set()


@pytest.fixture
def waiting():
    handler = Waiting()
    logger = logging.getLogger("pagedkv")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("timeout", [None, 0, 0.0])
def test_without_a_timeout_a_held_lock_fails_at_once(store_path: Path, holder: Holder, waiting: Waiting,
                                                     timeout: Any) -> None:
    with pytest.raises(StoreLocked, match=f"pid {holder.pid}"):
        pagedkv.open(store_path, lock_timeout=timeout)
    assert not waiting.event.is_set()


def test_a_timeout_that_runs_out_names_the_holder(store_path: Path, holder: Holder, waiting: Waiting) -> None:
    started = time.monotonic()
    with pytest.raises(StoreLocked, match=f"pid {holder.pid}") as info:
        pagedkv.open(store_path, lock_timeout=0.25)
    waited = time.monotonic() - started
    assert 0.25 <= waited < 10, waited
    assert "0.25" in str(info.value)
    assert waiting.event.is_set()  # it did wait, and said so


def test_open_waits_for_the_holder_to_release(store_path: Path, holder: Holder, waiting: Waiting) -> None:
    result: dict[str, Any] = {}

    def opener() -> None:
        try:
            result["store"] = pagedkv.open(store_path, lock_timeout=120)
        except BaseException as exc:  # reported below, not lost in the thread
            result["error"] = exc

    thread = threading.Thread(target=opener)
    thread.start()
    try:
        assert waiting.event.wait(60), "the opener never started waiting"
        assert thread.is_alive(), f"open returned while the lock was held: {result}"
        holder.release()
        assert holder.proc.stdout.readline() == "released\n"  # type: ignore[union-attr]
    finally:
        thread.join(120)
    assert "error" not in result, result.get("error")
    store = result["store"]
    try:
        assert store.sequences() == ["held"]  # the holder's commit at close is there
        store.create("mine")
    finally:
        store.close()
    messages = [r.getMessage() for r in waiting.records if r.name.startswith("pagedkv.")]
    assert any(str(holder.pid) in m and "waiting" in m for m in messages), messages
    assert any("after waiting" in m for m in messages), messages


def test_a_free_lock_is_taken_at_once_with_a_timeout(store_path: Path, waiting: Waiting) -> None:
    store = pagedkv.open(store_path, lock_timeout=math.inf)
    store.close()
    assert not waiting.event.is_set()


@pytest.mark.parametrize("bad", [-1, -0.5, True, "1", math.nan])
def test_lock_timeout_is_validated(store_path: Path, bad: Any) -> None:
    with pytest.raises(PagedKVError, match="lock_timeout"):
        pagedkv.open(store_path, lock_timeout=bad)


def test_waiting_polls_with_backoff_not_a_busy_loop(store_path: Path, holder: Holder,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedkv.storage.lockfile as lockfile

    tries = []
    real = lockfile.fcntl.flock

    def counting(fd: int, op: int) -> None:
        tries.append(op)
        real(fd, op)

    monkeypatch.setattr(lockfile.fcntl, "flock", counting)
    with pytest.raises(StoreLocked):
        pagedkv.open(store_path, lock_timeout=0.5)
    # 1 ms doubling to 50 ms: about 15 tries in half a second; a busy loop makes thousands
    assert 5 <= len(tries) <= 30, len(tries)
