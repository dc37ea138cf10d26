"""A ``with`` block that raises rolls back; a pool write outside a step never reads back as committed data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv import PageCorrupt
from support import GEOM, engine_write, get_seed, kv


@pytest.mark.parametrize("durability", ["durable", "nosync"])
def test_with_block_commits_on_success_and_rolls_back_on_error(tmp_path: Path, durability: str) -> None:
    seed = get_seed("with")
    path = tmp_path / "s"
    with pagedkv.open(path, GEOM, 8, durability=durability) as store:
        store.create("kept")
        store.append("kept", *kv(seed, "kept", 0, 9))
    with pytest.raises(RuntimeError):
        with pagedkv.open(path, durability=durability) as store:
            store.append("kept", *kv(seed, "kept", 9, 30))  # spills: eviction transactions land
            store.create("lost")
            store.append("lost", *kv(seed, "lost", 0, 5))
            raise RuntimeError("the caller's block failed")
    assert store._closed
    with pagedkv.open(path, durability=durability) as store:
        assert store.sequences() == ["kept"] and store.length("kept") == 9
        k, v = store.read("kept")
        ek, ev = kv(seed, "kept", 0, 9)
        assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes()
        assert store.check() == []


def _slot_of(store: pagedkv.KVStore, seq: str, page: int) -> int:
    with store.step({seq: 0}) as step:
        return int(step.block_tables[0, page])


@pytest.mark.parametrize("when", ["outside any step", "inside another sequence's step"])
def test_pool_write_through_a_stale_slot_is_page_corrupt(tmp_path: Path, when: str) -> None:
    seed = get_seed("pool-write")
    store = pagedkv.open(tmp_path / "s", GEOM, 8)
    for seq in ("a", "b"):
        store.create(seq)
        store.append(seq, *kv(seed, seq, 0, 6))
    store.commit()
    slot = _slot_of(store, "a", 1)  # a slot mapping the engine keeps past its step
    pool = store.pool
    if when == "outside any step":
        pool[slot, 0, 0, 0] = 12345.0
    else:
        with store.step({"b": 1}) as step:
            engine_write(store, step, [kv(seed, "b", 6, 1)])
            pool[slot, 1, 1, 1] = -1.0
    with pytest.raises(PageCorrupt):
        store.read("a")
    with pytest.raises(PageCorrupt):
        store.read_pages("a")
    ek, ev = kv(seed, "a", 0, 4)  # the untouched first page still reads
    k, v = store.read("a", 0, 4)
    assert k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes()
    assert any("pool slot" in line for line in store.check())
    store._abandon()
