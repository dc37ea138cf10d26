"""Threads share one store: every byte a read returns is a byte written to that sequence.

Content is a pure function of (sequence, position) (``support.kv``), so whatever
length a read returns, its expected bytes are known, even while the owner
thread is inside a step, rolls one back, spills or drops the sequence.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import PoolExhausted, SequenceBusy, SequenceNotFound
from support import GEOM, engine_write, get_seed, kv

PS = GEOM.page_size


def _expect(seed: int, seq: Any, k: np.ndarray, v: np.ndarray) -> None:
    length = k.shape[1]
    ek, ev = kv(seed, seq, 0, length)
    if k.tobytes() != ek.tobytes() or v.tobytes() != ev.tobytes():
        bad = np.flatnonzero((k.view(np.uint32) != ek.view(np.uint32)).any(axis=(0, 2, 3))
                             | (v.view(np.uint32) != ev.view(np.uint32)).any(axis=(0, 2, 3)))
        raise AssertionError(f"{seq!r}: {length} tokens read, wrong bytes at {bad[:8].tolist()}")


def test_read_during_another_threads_open_step_sees_only_written_tokens(tmp_path: Path) -> None:
    """The reproduction: a recycled slot's leftovers must never be read as the step's tokens."""
    seed = get_seed("open-step")
    store = pagedkv.open(tmp_path / "s", GEOM, 8)
    store.create("old")
    store.append("old", *kv(seed, "old", 0, 4 * PS))
    store.drop("old")  # its slots are recycled with their bytes still in them
    store.create("a")
    store.append("a", *kv(seed, "a", 0, 2 * PS))  # 2 full pages: the step opens a third
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def engine() -> None:
        try:
            with store.step({"a": 3}) as step:
                inside.set()
                release.wait()
                engine_write(store, step, [kv(seed, "a", 2 * PS, 3)])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=engine)
    thread.start()
    assert inside.wait(10)
    try:
        k, v = store.read("a")
        assert k.shape[1] == 2 * PS  # the step's 3 tokens are not written yet
        _expect(seed, "a", k, v)
        assert store.read_pages("a").shape[0] == 2
        for call in (lambda: store.read("a", 0, 2 * PS + 1), lambda: store.read_pages("a", 0, 3)):
            with pytest.raises(SequenceBusy):
                call()
    finally:
        release.set()
        thread.join()
    assert not errors, errors
    k, v = store.read("a")
    assert k.shape[1] == 2 * PS + 3
    _expect(seed, "a", k, v)
    store.close()


def test_threaded_stress_returns_no_wrong_bytes(tmp_path: Path) -> None:
    """Writers append, step (writing the pool), roll back, prefetch and drop; readers read everything."""
    seed = get_seed("thread-stress")
    store = pagedkv.open(tmp_path / "s", GEOM, 24, durability="nosync")
    names = [f"t{t}-{i}" for t in range(3) for i in range(3)]
    stop = threading.Event()
    failures: list[str] = []
    reads = [0]

    def writer(index: int) -> None:
        rng = random.Random(seed + index)
        mine = [name for name in names if name.startswith(f"t{index}-")]
        lengths: dict[str, int] = {}
        try:
            for _ in range(400):
                name = rng.choice(mine)
                roll = rng.random()
                try:
                    if name not in lengths:
                        store.create(name)
                        lengths[name] = 0
                    elif roll < 0.3:
                        n = rng.randint(1, 2 * PS)
                        store.append(name, *kv(seed, name, lengths[name], n))
                        lengths[name] += n
                    elif roll < 0.75:
                        n, fail = rng.randint(1, PS + 2), rng.random() < 0.2
                        try:
                            with store.step({name: n}) as step:
                                engine_write(store, step, [kv(seed, name, lengths[name], n)])
                                if fail:
                                    raise RuntimeError("engine failed")
                            lengths[name] += n
                        except RuntimeError:
                            assert fail
                    elif roll < 0.85:
                        store.prefetch([name]).wait()
                    elif roll < 0.92:
                        store.commit()
                    else:
                        store.drop(name)
                        del lengths[name]
                except PoolExhausted:
                    pass  # other threads' steps pin the pool for now
        except BaseException as exc:
            failures.append(f"writer {index}: {type(exc).__name__}: {exc}")

    def reader(index: int) -> None:
        rng = random.Random(seed - index - 1)
        try:
            while not stop.is_set():
                name = rng.choice(names)
                try:
                    k, v = store.read(name)
                except (SequenceNotFound, PoolExhausted):
                    continue
                _expect(seed, name, k, v)
                reads[0] += 1
        except BaseException as exc:
            failures.append(f"reader {index}: {type(exc).__name__}: {exc}")

    writers = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    readers = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    assert not failures, failures[:3]
    assert reads[0] > 50, reads  # the readers really ran beside the writers
    assert store.check() == []
    for name in store.sequences():
        _expect(seed, name, *store.read(name))
    store.close()
