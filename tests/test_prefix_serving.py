"""The prefix cache against a model, as an engine uses it: batched prefill, repeats, resumed chats.

Here the K/V of position ``i`` is a function of ``tokens[0..i]`` (the prefix, not
the token alone), as in a real model, so a page served after the wrong prefix
has the wrong bytes. The model is the set of full-page prefixes ever written
with their token ids; after every commit, reopen and SIGKILL, ``lookup(P)`` must
be the longest run of those pages that starts ``P``, ``create(tokens=P)`` must
reuse ``min(that, (len(P) - 1) // page * page)`` tokens, and the reused bytes must
be exactly the predicted ones.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import Geometry

from tests.kits import content

from tests.kits.child import Channel, Child
from tests.kits.content import get_seed
from tests.kits.store import engine_write


GEOM = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=8, dtype="float32")
PS = GEOM.page_size
POOL = 40


def prefix_kv(ids: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """K, V of positions ``[start, stop)`` of ``ids``: each a function of ``ids[:position + 1]``."""
    return content.prefix_kv(ids, start, stop, GEOM)


class PrefixModel:
    """Which full-page prefixes were ever written with their token ids."""

    def __init__(self) -> None:
        self.pages: set[bytes] = set()

    def wrote(self, ids: np.ndarray) -> None:
        for end in range(PS, len(ids) + 1, PS):
            self.pages.add(np.asarray(ids[:end], np.int64).tobytes())

    def cached(self, ids: np.ndarray) -> int:
        """The longest run of written full pages that starts ``ids``, in tokens."""
        end = 0
        while end + PS <= len(ids) and np.asarray(ids[:end + PS], np.int64).tobytes() in self.pages:
            end += PS
        return end

    def copy(self) -> PrefixModel:
        other = PrefixModel()
        other.pages = set(self.pages)
        return other


def make_plan(seed: int, rounds: int) -> list[tuple[Any, ...]]:
    """A serving workload: admitted batches, decode steps, finishes, commits and reopens.

    Batches mix new requests on shared system prompts (some exactly page
    multiples), retries of earlier prompts, n>1 sampling (one prompt twice in a
    batch), resumed chats (a finished chat's prompt and answer plus a new turn)
    and page-multiple cuts of cached prompts.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(n)] for n in (2 * PS, PS + 3, 3 * PS)]
    seen: list[list[int]] = []
    finished: list[list[int]] = []
    running: dict[str, list[int]] = {}
    plan: list[tuple[Any, ...]] = []
    names = iter(range(10**9))
    for _ in range(rounds):
        batch: list[tuple[str, list[int]]] = []
        for _ in range(rng.randint(1, 3 - min(len(running), 2))):
            kind = rng.random()
            if kind < 0.35 or not seen:
                ids = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randint(0, 2 * PS))]
            elif kind < 0.5:
                ids = list(rng.choice(seen))  # a retry
            elif kind < 0.65 and finished:
                ids = rng.choice(finished) + [rng.randrange(50_000) for _ in range(rng.randint(1, PS + 4))]
            elif kind < 0.8:
                ids = list(rng.choice(seen))
                ids = ids[:max(PS, len(ids) // PS * PS)]  # exactly a page multiple
            else:
                ids = list(rng.choice(seen))
                batch.append((f"r{next(names)}", ids))  # n>1 sampling: twice in one batch
            ids = ids[:6 * PS]
            if ids:
                batch.append((f"r{next(names)}", ids))
                seen.append(ids)
        plan.append(("admit", batch))
        for rid, ids in batch:
            running[rid] = list(ids)
        for _ in range(rng.randint(0, 2 * PS)):
            new = {rid: rng.randrange(50_000) for rid in running if len(running[rid]) < 7 * PS}
            if not new:
                break
            plan.append(("decode", new))
            for rid, token in new.items():
                running[rid].append(token)
        done = [rid for rid in running if rng.random() < 0.6 or len(running[rid]) >= 7 * PS]
        plan.append(("finish", done))
        for rid in done:
            finished.append(running.pop(rid))
        roll = rng.random()
        plan.append(("commit",) if roll < 0.35 else ("reopen",) if roll < 0.45 else ("check",))
    return plan


class Runner:
    """Plays a plan against a store, checking every reuse against the model as it goes."""

    def __init__(self, path: Path, commits: list[PrefixModel] | None = None) -> None:
        self.path = path
        self.store = pagedkv.open(path, GEOM, POOL, durability="nosync")
        self.model = PrefixModel()
        self.running: dict[str, np.ndarray] = {}
        self.prompts: list[np.ndarray] = []
        self.commits = commits  # the model as of each commit, when recorded

    def play(self, plan: list[tuple[Any, ...]], on_commit: Any = None) -> None:
        for op in plan:
            getattr(self, f"op_{op[0]}")(*op[1:])
            if op[0] in ("commit", "reopen") and on_commit is not None:
                on_commit()

    def op_admit(self, batch: list[tuple[str, list[int]]]) -> None:
        store, reuse = self.store, {}
        for rid, raw in batch:
            ids = np.asarray(raw, np.int64)
            cached = self.model.cached(ids)
            assert store.lookup(ids) == cached, (rid, store.lookup(ids), cached)
            reused = store.create(rid, tokens=ids)
            assert reused == min(cached, (len(ids) - 1) // PS * PS), (rid, reused, cached, len(ids))
            if reused:
                k, v = store.read(rid, 0, reused)
                ek, ev = prefix_kv(ids, 0, reused)
                assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes(), \
                    f"{rid}: reused pages hold another prefix's K/V"
            reuse[rid] = (ids, reused)
            self.prompts.append(ids)
        counts = {rid: len(ids) - reused for rid, (ids, reused) in reuse.items()}
        with store.step(counts, tokens={rid: ids[reused:] for rid, (ids, reused) in reuse.items()}) as step:
            engine_write(store, step, [prefix_kv(ids, reused, len(ids)) for ids, reused in reuse.values()])
        for rid, (ids, _) in reuse.items():
            self.running[rid] = ids
            self.model.wrote(ids)

    def op_decode(self, new: dict[str, int]) -> None:
        grown = {rid: np.append(self.running[rid], token) for rid, token in new.items()}
        with self.store.step({rid: 1 for rid in new}, tokens={rid: [t] for rid, t in new.items()}) as step:
            engine_write(self.store, step, [prefix_kv(ids, len(ids) - 1, len(ids)) for ids in grown.values()])
        for rid, ids in grown.items():
            self.running[rid] = ids
            self.model.wrote(ids)

    def op_finish(self, done: list[str]) -> None:
        for rid in done:
            self.store.drop(rid)
            del self.running[rid]

    def op_commit(self) -> None:
        self.store.commit()
        self.committed()

    def op_reopen(self) -> None:
        self.store.close()
        self.store = pagedkv.open(self.path, durability="nosync")
        self.committed()
        self.check_lookups()

    def op_check(self) -> None:
        self.check_lookups(sample=8)

    def committed(self) -> None:
        if self.commits is not None:
            self.commits.append(self.model.copy())
        self.check_lookups(sample=8)

    def check_lookups(self, sample: int | None = None) -> None:
        prompts = self.prompts if sample is None else self.prompts[-sample:]
        for ids in prompts:
            assert self.store.lookup(ids) == self.model.cached(ids)


def test_same_system_prompt_twice_in_one_step(tmp_path: Path) -> None:
    """Two requests on one system prompt, prefilled in one step: both chains are found after reopen."""
    rng = np.random.default_rng(get_seed("batched"))
    sys_ids = rng.integers(0, 50_000, 2 * PS)
    a = np.concatenate([sys_ids, rng.integers(0, 50_000, 2 * PS + 3)])
    b = np.concatenate([sys_ids, rng.integers(0, 50_000, 3 * PS + 1)])
    runner = Runner(tmp_path / "s")
    runner.op_admit([("r1", a.tolist()), ("r2", b.tolist())])
    runner.op_reopen()
    assert runner.store.lookup(a) == 4 * PS and runner.store.lookup(b) == 5 * PS
    more = np.concatenate([b, rng.integers(0, 50_000, 5)])
    runner.op_admit([("r3", more.tolist())])  # reuses all of b's full pages, bytes checked
    assert runner.store.check() == []


def test_recomputed_last_page_of_a_cached_prompt_keeps_the_chain(tmp_path: Path) -> None:
    """A retry of a page-multiple prompt recomputes its last page; what is decoded after it is found."""
    rng = np.random.default_rng(get_seed("retry"))
    ids = rng.integers(0, 50_000, 3 * PS)
    runner = Runner(tmp_path / "s")
    runner.op_admit([("first", ids.tolist())])
    runner.op_finish(["first"])
    runner.op_admit([("retry", ids.tolist())])  # reuses 2 pages, recomputes the third
    for token in rng.integers(0, 50_000, PS + 2).tolist():
        runner.op_decode({"retry": token})
    answer = runner.running["retry"]
    runner.op_reopen()
    assert runner.store.lookup(answer) == 4 * PS
    runner.op_admit([("resumed", np.append(answer, 7).tolist())])
    assert runner.store.check() == []


def test_serving_loop_matches_the_prefix_model(tmp_path: Path) -> None:
    seed = get_seed("serving")
    runner = Runner(tmp_path / "s")
    runner.play(make_plan(seed, 40))
    runner.op_reopen()
    runner.check_lookups()
    assert runner.store.check() == []
    runner.store.close()


def _child(chan: Channel, path: Path, plan: list[tuple[Any, ...]]) -> None:
    runner = Runner(path)
    runner.play(plan, on_commit=lambda: chan.send("committed"))
    chan.send("done")


@pytest.mark.slow
@pytest.mark.parametrize("cycle", range(3))
def test_serving_loop_survives_sigkill(tmp_path: Path, cycle: int) -> None:
    """Killed at a random point: every prompt's lookup lies between the last acked commit and the next."""
    seed = get_seed(f"sigkill-{cycle}")
    plan = make_plan(seed, 30)
    history: list[PrefixModel] = [PrefixModel()]
    planner = Runner.__new__(Runner)  # the model of each commit, without a store
    planner.model, planner.running, planner.prompts = PrefixModel(), {}, []
    for op in plan:
        if op[0] == "admit":
            for _, raw in op[1]:
                planner.model.wrote(np.asarray(raw, np.int64))
                planner.prompts.append(np.asarray(raw, np.int64))
            planner.running.update((rid, np.asarray(raw, np.int64)) for rid, raw in op[1])
        elif op[0] == "decode":
            for rid, token in op[1].items():
                planner.running[rid] = np.append(planner.running[rid], token)
                planner.model.wrote(planner.running[rid])
        elif op[0] in ("commit", "reopen"):
            history.append(planner.model.copy())
    history.append(planner.model.copy())
    target = random.Random(seed).randrange(1, max(2, len(history) - 1))
    path = tmp_path / "s"
    acked = 0
    with Child(_child, path, plan) as child:
        while acked < target:
            message = child.recv(timeout=120)
            assert not isinstance(message, tuple), f"the child raised {message[1]}\n{message[2]}"
            if message == "done":
                break
            acked += 1
        child.kill(reap=False)
        acked += child.collect().count("committed")  # acks sent before it died, not yet read
    low, high = history[acked], history[min(acked + 1, len(history) - 1)]
    with pagedkv.open(path, durability="nosync") as store:
        assert store.check() == []
        for number, ids in enumerate(planner.prompts):
            found = store.lookup(ids)
            assert low.cached(ids) <= found <= high.cached(ids), (number, found, acked)
            reused = store.create(f"after-{number}", tokens=ids)
            if reused:
                k, v = store.read(f"after-{number}", 0, reused)
                ek, ev = prefix_kv(ids, 0, reused)
                assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes()
            store.drop(f"after-{number}")
