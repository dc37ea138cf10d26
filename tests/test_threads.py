"""Threads sharing one store: every byte a read returns is a byte written to that sequence.

Workers append, step (the engine writes outside the lock), read, fork, drop and commit,
for a bounded number of operations; then everything is bit-exact. Each worker owns its
sequences, so the expected bytes are known; workers also read each other's sequences
(which only grow) and commit. The stress test reads while the owner is inside a step,
rolls one back, spills or drops the sequence: content is a pure function of (sequence,
position) (``kits.content.kv``), so whatever length a read returns, its expected bytes
are known. No sleeps: a barrier starts the workers together and joins with a deadline
detect a deadlock.
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

from tests.kits.content import get_seed, kv, same_bits
from tests.kits.model import Model
from tests.kits.store import GEOM, engine_write



PS = GEOM.page_size
WORKERS = 4
OPS = 400
OWN = 3  # sequences per worker
MAX_LEN = 10 * PS  # per sequence: 4 x 3 x 10 = 120 pages for a pool of 56
POOL_PAGES = 56


# -- workers on their own sequences ------------------------------------------------------------------


class Worker:
    def __init__(self, index: int, store: pagedkv.KVStore, seed: int, barrier: threading.Barrier,
                 everyone: list[Worker]) -> None:
        self.index = index
        self.store = store
        self.rng = np.random.default_rng(seed + index)
        self.model = Model(seed)
        self.barrier = barrier
        self.everyone = everyone
        self.seqs = [f"w{index}-{i}" for i in range(OWN)]
        self.lengths = {seq: 0 for seq in self.seqs}  # published after each append/step
        self.keys: dict[str, object] = {}
        self.errors: list[BaseException] = []
        self.counts = {"steps": 0, "appends": 0, "reads": 0, "foreign_reads": 0, "commits": 0,
                       "forks": 0, "exhausted": 0}

    def setup(self) -> None:
        for seq in self.seqs:
            self.store.create(seq)
            self.model.create(seq)
            self.keys[seq] = self.model.keys[seq]

    def run(self) -> None:
        try:
            self.barrier.wait(timeout=60)
            for op in range(OPS):
                try:
                    self.one(op)
                except PoolExhausted:
                    # Legitimate under contention: other workers' steps pin every slot a
                    # read or an append would need. Nothing of the operation took effect
                    # (appends resynchronise their model below).
                    self.counts["exhausted"] += 1
        except BaseException as exc:  # reported by the test thread
            self.errors.append(exc)

    def one(self, op: int) -> None:
        r = self.rng.random()
        store, model = self.store, self.model
        if r < 0.3:
            seq = self.seqs[int(self.rng.integers(OWN))]
            n = min(int(self.rng.integers(1, 3 * PS)), MAX_LEN - model.lens[seq])
            if n <= 0:
                return
            k, v = model.next_kv(seq, n)
            try:
                store.append(seq, k, v)
            except PoolExhausted:  # every other slot pinned by other workers' steps right now
                # the pages written before the error stay: they are a prefix of k/v
                model.undo(seq, store.length(seq))
                self.lengths[seq] = model.lens[seq]
                raise
            self.lengths[seq] = model.lens[seq]
            self.counts["appends"] += 1
        elif r < 0.6:
            chosen = [self.seqs[i] for i in self.rng.choice(OWN, size=int(self.rng.integers(1, 3)), replace=False)]
            counts = {s: min(MAX_LEN - model.lens[s], int(self.rng.integers(2, 10))
                             if self.rng.random() < 0.2 else 1) for s in chosen}
            kvs = [model.next_kv(s, counts[s]) for s in chosen]
            try:
                step = store.step(counts)
                step.__enter__()
            except PoolExhausted:  # refused before anything changed
                for s in chosen:
                    model.undo(s, self.lengths[s])
                raise
            try:
                assert step.seq_lens.tolist() == [model.lens[s] for s in chosen]
                engine_write(store, step, kvs)  # outside the store lock, like a real engine
            finally:
                step.__exit__(None, None, None)
            for s in chosen:
                self.lengths[s] = model.lens[s]
            self.counts["steps"] += 1
        elif r < 0.8:
            seq = self.seqs[int(self.rng.integers(OWN))]
            n = model.lens[seq]
            start = int(self.rng.integers(0, n + 1))
            model.verify(store, seq, start, int(self.rng.integers(start, n + 1)))
            self.counts["reads"] += 1
        elif r < 0.9:
            other = self.everyone[int(self.rng.integers(len(self.everyone)))]
            seq = other.seqs[int(self.rng.integers(OWN))]
            n = other.lengths[seq]  # a length the owner has published: those tokens exist
            if n:
                k, v = store.read(seq, 0, n)
                ek, ev = kv(model.seed, other.keys[seq], 0, n)
                assert same_bits(k, ek) and same_bits(v, ev), f"{seq} read by worker {self.index}"
            self.counts["foreign_reads"] += 1
        elif r < 0.95:
            src = self.seqs[int(self.rng.integers(OWN))]
            dst = f"w{self.index}-fork{op}"
            store.fork(src, dst)
            model.fork(src, dst)
            if self.rng.random() < 0.5:
                k, v = model.next_kv(dst, int(self.rng.integers(1, PS + 2)))
                try:
                    store.append(dst, k, v)
                except PoolExhausted:
                    model.undo(dst, store.length(dst))
                    store.drop(dst)
                    model.drop(dst)
                    raise
            model.verify(store, dst)
            store.drop(dst)
            model.drop(dst)
            self.counts["forks"] += 1
        else:
            store.commit()
            self.counts["commits"] += 1


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("durability", ["durable", "nosync"])
def test_threads_shared_store_bit_exact(stores, seed: int, durability: str) -> None:
    store = stores.open(pool_pages=POOL_PAGES, durability=durability, evict_batch=4)
    barrier = threading.Barrier(WORKERS)
    workers: list[Worker] = []
    for i in range(WORKERS):
        workers.append(Worker(i, store, seed, barrier, workers))
    for w in workers:
        w.setup()
    threads = [threading.Thread(target=w.run, name=f"worker-{w.index}", daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"deadlock or livelock: {stuck} still running"
    for w in workers:
        if w.errors:
            raise w.errors[0]
    totals = {key: sum(w.counts[key] for w in workers) for key in workers[0].counts}
    print("totals:", totals, "stats:", {k: store.stats()[k] for k in ("evictions", "restores", "commits")})
    assert sum(len(w.errors) for w in workers) == 0
    assert totals["steps"] > 0 and totals["appends"] > 0 and totals["commits"] > 0
    assert store.stats()["pool_pinned"] == 0
    st = store.stats()
    assert st["evictions"] > 0 and st["restores"] > 0
    for w in workers:
        for seq in w.seqs:
            assert store.length(seq) == w.model.lens[seq]
            w.model.verify(store, seq)
    assert sorted(store.sequences()) == sorted(s for w in workers for s in w.seqs)
    assert store.check() == []
    store = stores.reopen(store, durability=durability)
    for w in workers:
        for seq in w.seqs:
            w.model.verify(store, seq)
    assert store.check() == []


@pytest.mark.timeout(60)
def test_threads_commit_waits_for_other_threads_step(stores) -> None:
    """A commit from another thread waits until a step ends, then commits the step's tokens."""
    store = stores.open(pool_pages=8)
    model = Model(7)
    store.create("a")
    model.create("a")
    entered, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def committer() -> None:
        try:
            assert entered.wait(30)
            store.commit()  # blocks until the step below has ended
            done.set()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=committer, daemon=True)
    t.start()
    with store.step({"a": 5}) as s:
        entered.set()
        engine_write(store, s, [model.next_kv("a", 5)])
        # whenever the committer got to commit(), it cannot have finished inside the step
        assert not done.is_set()
    t.join(timeout=30)
    assert not t.is_alive() and not errors and done.is_set()
    store._abandon()  # a crash right after: the committed state includes the step's tokens
    store = stores.open(geom=None, pool_pages=None)
    model.verify_all(store)
    assert store.check() == []


def test_a_waiting_commit_wakes_once_at_the_last_open_step_and_sees_no_kept_pins(stores) -> None:
    """A commit already waiting when steps end waits through the first, wakes at the last, and then
    commits with no step's pins kept.

    The commit's wait is observed (its condition wait is wrapped to count), so both
    ends below happen while it waits: an end that fails to wake it hangs the join,
    and an end that wakes it while a step is still open makes it wait twice. The
    steps keep their pins for their batches' next steps as they end; the commit
    must give them back before it looks at the pool, as every other operation does.
    """
    store = stores.open(pool_pages=8)
    for seq in ("a", "b"):
        store.create(seq)
    waits = threading.Semaphore(0)  # one release per wait the commit starts
    real_wait = store._no_steps.wait

    def observed_wait(timeout: float | None = None) -> bool:
        waits.release()
        return real_wait(timeout)

    store._no_steps.wait = observed_wait  # type: ignore[method-assign]
    seen: list[tuple[bool, int]] = []
    real_commit = store._commit

    def observed_commit(*args: Any, **kwargs: Any) -> Any:
        seen.append((store._mgr.kept_for is None, int(store._mgr.pins.sum())))
        return real_commit(*args, **kwargs)

    store._commit = observed_commit  # type: ignore[method-assign]
    b_open, b_close, errors = threading.Event(), threading.Event(), []
    done = threading.Event()

    def other_step() -> None:
        try:
            with store.step({"b": 1}):
                b_open.set()
                assert b_close.wait(30)
        except BaseException as exc:
            errors.append(exc)

    def committer() -> None:
        try:
            store.commit()
            done.set()
        except BaseException as exc:
            errors.append(exc)

    stepper = threading.Thread(target=other_step, daemon=True)
    stepper.start()
    assert b_open.wait(30)
    waiter = threading.Thread(target=committer, daemon=True)
    with store.step({"a": 1}):
        waiter.start()
        assert waits.acquire(timeout=30), "the commit did not wait for the open steps"
    assert not done.is_set()  # "b" is still open
    b_close.set()
    stepper.join(timeout=30)
    waiter.join(timeout=30)
    assert not waiter.is_alive() and done.is_set() and not errors
    assert not waits.acquire(blocking=False), "the commit was woken while a step was still open"
    assert seen == [(True, 0)], f"the commit ran with pins kept by a step (no kept pins, pins held): {seen}"
    assert store._step_waiters == 0
    store.close()


# -- reads racing steps, rollbacks, spills and drops -------------------------------------------------


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
