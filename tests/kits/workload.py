"""A random workload on an open store, checked against a ``kits.model.Model`` as it runs.

``Workload`` drives a store at random: create, append spanning pages, engine steps that
write K/V into ``store.pool`` via ``slot_mapping`` (some aborted midway), fork, drop,
checked reads and commits. Every commit is announced through ``intent`` (before it
starts) and ``ack`` (after it returned), so a crash loop knows which commits the store
may hold after a crash. Sequence ids and content keys come from ``next_id`` (never
reused). The crash loops (``kits.crash``, ``kits.powerloss``) and the write-behind tests
run it.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import pagedkv

from .content import join_kv
from .model import Model


class WrongData(AssertionError):
    """The live store returned bytes that differ from what was written."""


class _EngineFailure(Exception):
    """Raised inside a step to make the store roll the step back."""


@dataclass
class Params:
    """Workload shape: small bounds keep the pool under constant eviction and restore."""

    max_seqs: int = 6  # sequences alive at once
    max_len: int = 24  # tokens per sequence (6 pages of 4)
    max_append: int = 9  # tokens per append (spans up to 3 pages)
    weights: dict[str, float] = field(default_factory=lambda: {
        "create": 8, "append": 24, "step": 18, "step_abort": 3, "fork": 7, "drop": 7,
        "read": 14, "commit": 15,
    })


# Power loss: sequences accumulate (few drops), so every crash has committed pages at risk.
POWER_PARAMS = Params(max_seqs=6, max_len=28, weights={
    "create": 6, "append": 30, "step": 20, "step_abort": 2, "fork": 5, "drop": 3, "read": 12,
    "commit": 14})


def crash_model(store: pagedkv.KVStore, seed: int) -> Model:
    """An empty model of the content a crash-loop workload writes into ``store`` (finite values)."""
    return Model(seed, store.geometry, finite=True)


class Workload:
    """Random operations on an open store, checked against ``model`` as they run.

    ``intent(n, model)`` is called before commit ``n`` starts and ``ack(n)`` after it returned;
    ``next_id()`` hands out sequence ids and content keys (never reused).
    """

    def __init__(self, store: pagedkv.KVStore, model: Model, commit_no: int, rng: random.Random,
                 next_id: Callable[[], int], params: Params,
                 intent: Callable[[int, Model], None], ack: Callable[[int], None]) -> None:
        self.store, self.model, self.commit_no = store, model, commit_no
        self.rng, self.next_id, self.params = rng, next_id, params
        self.intent, self.ack = intent, ack
        self._ops = list(params.weights)
        self._cum = np.cumsum([params.weights[name] for name in self._ops]).tolist()
        self.counts: Counter[str] = Counter()

    def run(self, count: int) -> None:
        """``count`` random operations."""
        for _ in range(count):
            self.one()

    def one(self, name: str | None = None) -> None:
        """One operation: ``name``, or one drawn by the weights."""
        name = name or self.rng.choices(self._ops, cum_weights=self._cum)[0]
        self.counts[name] += 1
        getattr(self, "op_" + name)()

    # -- operations
    def op_create(self) -> None:
        if len(self.model.lens) >= self.params.max_seqs:
            return self.op_drop()
        sid = self.next_id()
        self.store.create(sid)
        self.model.create(sid, key=self.next_id())

    def _pick(self, room: bool = False) -> int | None:
        sids = [s for s, length in self.model.lens.items() if not room or length < self.params.max_len]
        return self.rng.choice(sids) if sids else None

    def op_append(self) -> None:
        sid = self._pick(room=True)
        if sid is None:
            return self.op_create() if len(self.model.lens) < self.params.max_seqs else self.op_drop()
        length = self.model.lens[sid]
        count = self.rng.randint(1, min(self.params.max_append, self.params.max_len - length))
        self.store.append(sid, *self.model.next_kv(sid, count))

    def op_step(self, abort: bool = False) -> None:
        model, lens = self.model, self.model.lens
        sids = list(lens)
        if not sids:
            return self.op_create()
        chosen = self.rng.sample(sids, self.rng.randint(1, min(3, len(sids))))
        mapping = {sid: self.rng.randint(0, min(5, self.params.max_len - lens[sid])) for sid in chosen}
        if not self.store.can_step(mapping):
            mapping = {chosen[0]: mapping[chosen[0]]}
            if not self.store.can_step(mapping):
                self.counts["step_skipped"] += 1
                return
        page_size = self.store.geometry.page_size
        tokens = np.concatenate([join_kv(*model.upcoming(sid, count)) for sid, count in mapping.items()])
        try:
            with self.store.step(mapping) as step:
                pool = self.store.pool
                for row, sid in enumerate(mapping):  # what an attention kernel sees: old tokens
                    if step.seq_lens[row] != lens[sid] + mapping[sid]:
                        raise WrongData(f"step seq_lens[{row}]={step.seq_lens[row]}, expected "
                                        f"{lens[sid] + mapping[sid]}")
                    if lens[sid]:
                        pos = np.arange(lens[sid])
                        seen = pool[step.block_tables[row, pos // page_size], :, :, pos % page_size]
                        if seen.tobytes() != join_kv(*model.expected(sid)).tobytes():
                            raise WrongData(f"step: pool bytes of sequence {sid} differ from the model")
                slots, offsets = step.slot_mapping // page_size, step.slot_mapping % page_size
                if len(slots) != len(tokens):
                    raise WrongData(f"slot_mapping has {len(slots)} entries for {len(tokens)} tokens")
                upto = self.rng.randint(0, len(tokens)) if abort else len(tokens)
                pool[slots[:upto], :, 0, offsets[:upto]] = tokens[:upto, :, 0]
                pool[slots[:upto], :, 1, offsets[:upto]] = tokens[:upto, :, 1]
                del pool
                if abort:
                    raise _EngineFailure
        except _EngineFailure:
            for sid in mapping:
                if self.store.length(sid) != lens[sid]:
                    raise WrongData(f"aborted step left {sid} at {self.store.length(sid)} tokens") from None
            return
        for sid, count in mapping.items():
            if count:
                model.grow(sid, count)

    def op_step_abort(self) -> None:
        self.op_step(abort=True)

    def op_fork(self) -> None:
        src = self._pick()
        if src is None or len(self.model.lens) >= self.params.max_seqs:
            return self.op_drop() if src is not None else self.op_create()
        dst = self.next_id()
        self.store.fork(src, dst)
        self.model.fork(src, dst, key=self.next_id())

    def op_drop(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        self.store.drop(sid)
        self.model.drop(sid)

    def op_read(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        length = self.model.lens[sid]
        if self.store.length(sid) != length:
            raise WrongData(f"length of {sid} is {self.store.length(sid)}, expected {length}")
        start = self.rng.randint(0, length)
        stop = self.rng.randint(start, length)
        k, v = self.store.read(sid, start, stop)
        bad = self.model.wrong_tokens(sid, start, stop, k, v)
        if bad:
            raise WrongData(f"read({sid}, {start}, {stop}) returned {bad} wrong tokens")

    def op_commit(self, close: bool = False) -> None:
        number = self.commit_no + 1
        self.intent(number, self.model)
        if close:
            self.store.close()
        else:
            self.store.commit()
        self.commit_no = number
        self.ack(number)

    def close(self) -> None:
        """``close()`` commits: it is announced and acknowledged like a commit."""
        self.op_commit(close=True)
