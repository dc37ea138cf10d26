"""A batch's decode step may leave its pins for the batch's next step: nothing else may see them.

``stepplan.end`` keeps the pins of a decode step whose table changed by new pages
only (``PageTable.keep_pins``); the batch's next step takes them over, and any other
operation gives them back first (``core._op``). This runs one random workload twice,
once as it is and once with every kept pin given back at once, and requires the same
observable run: each step's outputs, every read, every refusal, the counters and the
committed state. Between operations no pin is held but the kept ones, and after any
operation other than a step none at all.

The seed is printed; ``PAGEDKV_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import PoolExhausted
from pagedkv.pages.directory import ONE
from pagedkv.pages.table import PageTable

from tests.kits.content import get_seed
from tests.kits.store import GEOM

PS = GEOM.page_size


def _pins_settled(store: pagedkv.KVStore, after_step: bool) -> None:
    mgr = store._mgr
    kept = np.bincount(mgr.kept, minlength=mgr.pool_pages) if len(mgr.kept) else np.zeros(mgr.pool_pages)
    assert np.array_equal(mgr.pins, kept), "a slot is pinned with no step active, beyond the kept pins"
    if not after_step:
        assert not len(mgr.kept) and mgr.kept_for is None, "an operation other than a step saw kept pins"


def _run(path: Path, seed: int, width: int) -> list[Any]:
    rng = random.Random(seed)
    # Foreground spilling only: a write-behind thread's timing would make two runs differ anyway
    # (between steps it sees the kept pins as pins, and leaves the batch's slots alone).
    store = pagedkv.open(path, GEOM, pool_pages=36, evict_batch=4, write_behind=False)
    seen: list[Any] = []
    names = iter(range(10_000))
    batch = []
    for _ in range(width):  # the Python-int plan (up to 4 rows) and the vectorised one both keep pins
        seq = next(names)
        store.create(seq)
        batch.append(seq)
    idle: list[int] = []
    ids = rng.random() < 0.5
    for _ in range(400):
        action = rng.random()
        try:
            if action < 0.55:
                mapping = {seq: 1 for seq in batch}
                tokens = {seq: [rng.randrange(1000)] for seq in batch} if ids else None
                with store.step(mapping, tokens=tokens) as step:
                    kv = np.full((GEOM.layers, 2, GEOM.kv_heads, GEOM.head_dim), len(seen) % 7, GEOM.np_dtype)
                    slots, offsets = np.divmod(step.slot_mapping, PS)
                    store.pool[slots, :, :, offsets] = kv
                    seen.append(("step", step.block_tables.tolist(), step.slot_mapping.tolist(),
                                 step.seq_lens.tolist()))
                _pins_settled(store, after_step=True)
                continue
            if action < 0.65:
                seq = rng.choice(batch + idle)
                if store.length(seq):
                    start = rng.randrange(store.length(seq))
                    k, v = store.read(seq, start, store.length(seq))
                    seen.append(("read", seq, start, k.tobytes(), v.tobytes()))
            elif action < 0.75:
                if len(idle) < 4:
                    seq = next(names)
                    store.create(seq)
                    idle.append(seq)
                seq = rng.choice(idle)
                n = rng.randrange(1, 3 * PS)
                k = np.full((GEOM.layers, n, GEOM.kv_heads, GEOM.head_dim), seq % 5, GEOM.np_dtype)
                store.append(seq, k, k)
            elif action < 0.80 and idle:
                store.drop(idle.pop(rng.randrange(len(idle))))
            elif action < 0.85:  # a batch sequence forked: its next step copies a shared page
                src = rng.choice(batch)
                seq = next(names)
                store.fork(src, seq)
                idle.append(seq)
            elif action < 0.90:
                seq = rng.choice(batch)
                store.truncate(seq, rng.randrange(store.length(seq) + 1))
            elif action < 0.93:
                store.commit()
            elif action < 0.96:  # another batch: the kept pins are not its to take over
                rng.shuffle(batch)
                continue  # no operation: the last step's pins may still be kept
            else:
                seen.append(("can_step", store.can_step({seq: 1 for seq in batch})))
        except PoolExhausted as exc:
            seen.append(("refused", str(exc)))
        _pins_settled(store, after_step=False)
    stats = {key: value for key, value in store.stats().items() if "ms" not in key and "bytes_on_disk" not in key}
    seen.append(("stats", sorted(stats.items())))
    store.close()
    with pagedkv.open(path) as reopened:
        for seq in sorted(reopened.sequences()):
            k, v = reopened.read(seq)
            seen.append(("committed", seq, k.tobytes(), v.tobytes()))
    return seen


@pytest.mark.parametrize("width", [2, 6])
@pytest.mark.parametrize("run", range(3))
def test_kept_pins_change_nothing_observable(tmp_path: Path, run: int, width: int, monkeypatch) -> None:
    seed = get_seed(f"kept pins, run {run}, {width} rows")
    kept = _run(tmp_path / "kept", seed, width)

    def give_back(self: PageTable, slots: np.ndarray, owner: object) -> None:
        self.release_kept()
        np.subtract.at(self.pins, slots, ONE)

    monkeypatch.setattr(PageTable, "keep_pins", give_back)
    given_back = _run(tmp_path / "given-back", seed, width)
    assert len(kept) == len(given_back)
    for index, (a, b) in enumerate(zip(kept, given_back)):
        assert a == b, f"PAGEDKV_SEED={seed}: entry {index} ({a[0]}) differs with pins kept"


@pytest.mark.parametrize("width", [1, 4, 6])
def test_a_step_keeps_its_pins_only_until_the_next_operation(tmp_path: Path, width: int) -> None:
    store = pagedkv.open(tmp_path / "s", GEOM, pool_pages=32)
    batch = {seq: 1 for seq in range(width)}
    for seq in batch:
        store.create(seq)
    with store.step({seq: PS + 1 for seq in batch}):
        pass
    for _ in range(2):
        with store.step(batch):
            pass
    mgr = store._mgr
    pinned = 2 * width  # two pages per sequence
    assert mgr.kept_for is store._seqs.batch and int(mgr.pins.sum()) == pinned
    with store.step(batch):  # taken over, and kept again
        assert int(mgr.pins.sum()) == pinned and not len(mgr.kept)
    assert int(mgr.pins.sum()) == pinned
    store.stats()
    assert int(mgr.pins.sum()) == 0 and mgr.kept_for is None
    with store.step(batch):
        pass
    with pytest.raises(ZeroDivisionError):  # a failed step keeps nothing
        with store.step(batch):
            1 / 0
    assert int(mgr.pins.sum()) == 0 and mgr.kept_for is None
    store.close()
