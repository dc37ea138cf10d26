"""Handle hygiene: open/close cycles return every fd and mapping; a closed or inherited handle refuses.

A closed handle raises ``StoreClosed`` for every call, a pool view kept past close never
crashes the process, and a handle carried into a forked child is refused there while the
parent's keeps working.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import GeometryMismatch, StoreClosed, StoreLocked

from tests.kits.child import describe, in_child
from tests.kits.faults import fd_count, maps_count, scales
from tests.kits.model import Model, build_committed
from tests.kits.store import GEOM



SEQS = {"a": 21, "b": 30, "c": 9}  # 17 pages through an 8-slot pool: some spilled


def build(path: Path, seed: int, **kwargs: Any) -> Model:
    """A closed store at ``path`` holding ``SEQS`` (one commit); its model."""
    return build_committed(path, SEQS, seed, 8, chunks=1, **kwargs)


# -- T15: handle hygiene -------------------------------------------------------------------------


def _cycle(path: Path, kind: int, model: Model, token: list[int]) -> None:
    if kind == 0:  # a writer that appends and commits
        store = pagedkv.open(path, durability="nosync")
        k, v = model.next_kv("a", 1)
        store.append("a", k, v)
        store.commit()
        store.close()
    elif kind == 1:  # a reader
        store = pagedkv.open(path, readonly=True)
        store.read("b")
        store.close()
    elif kind == 2:  # a refused geometry
        with pytest.raises(GeometryMismatch):
            pagedkv.open(path, pagedkv.Geometry(1, 1, 8, 4, "float32"))
    elif kind == 3:  # a refused second writer
        store = pagedkv.open(path, durability="nosync")
        with pytest.raises(StoreLocked):
            pagedkv.open(path)
        store.close()
    token[0] += 1


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_open_close_cycles_return_fds_and_maps(fast_tmp: Path, scale: str) -> None:
    path = fast_tmp / "store"
    model = build(path, 14)
    count = [0]
    for kind in range(4):  # warm up every path once (imports, caches)
        _cycle(path, kind, model, count)
    # Garbage an earlier test of this worker left (a file object, a pipe) would close its fds
    # whenever the collector runs in the loop, and read as fds this loop gave back.
    gc.collect()
    fds, maps = fd_count(), maps_count()
    total = {"ci": 1000, "soak": 100000}[scale]
    samples = []
    for index in range(total):
        _cycle(path, index % 4, model, count)
        if index % 250 == 249:
            samples.append((fd_count(), maps_count()))
    print(f"T15: {total} open/close cycles; fds {fds} -> {fd_count()}, maps {maps} -> {maps_count()}, "
          f"samples {samples}")
    assert fd_count() == fds, samples
    # A leak per cycle would add hundreds of mappings; the allocator may add an arena or two.
    assert maps_count() <= maps + 2, samples
    assert max(count for _, count in samples) - min(count for _, count in samples) <= 2, samples
    model.verify_reopened(path)


def test_closed_handles_release_their_mappings(tmp_path: Path) -> None:
    """close() unmaps pool.bin and the LMDB map even while the handle object lives on."""
    path = tmp_path / "store"
    build(path, 15)
    pagedkv.open(path).close()
    # Only the store's files count: a thread's first allocation may map a malloc arena.
    assert maps_count(path) == 0
    kept = []
    for _ in range(20):
        store = pagedkv.open(path)
        store.read("a")
        assert maps_count(path) > 0  # the count sees the maps of an open handle
        store.close()
        kept.append(store)
    leaked = maps_count(path)
    assert leaked == 0, f"{leaked} mappings outlive close() while 20 closed handles are referenced"


def test_use_after_close_raises_store_closed(tmp_path: Path) -> None:
    """Every call on a closed handle (writer or reader; closed twice) is StoreClosed; the store is intact."""
    path = tmp_path / "store"
    model = build(path, 16)
    for readonly in (False, True):
        store = pagedkv.open(path, readonly=readonly)
        store.close()
        store.close()  # idempotent
        k = np.zeros((GEOM.layers, 1, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
        calls = {
            "create": lambda: store.create("z"), "append": lambda: store.append("a", k, k),
            "read": lambda: store.read("a"), "fork": lambda: store.fork("a", "f"),
            "drop": lambda: store.drop("a"), "length": lambda: store.length("a"),
            "sequences": lambda: store.sequences(), "commit": lambda: store.commit(),
            "stats": lambda: store.stats(), "check": lambda: store.check(),
            "pool": lambda: store.pool, "can_step": lambda: store.can_step({"a": 1}),
            "step": lambda: store.step({"a": 1}).__enter__(),
        }
        for name, call in calls.items():
            with pytest.raises(StoreClosed):
                call()
                pytest.fail(f"{name} worked on a closed handle")
    model.verify_reopened(path)


def touch_view_after_close(path: str) -> float:
    store = pagedkv.open(path)
    view = store.pool
    first = float(view[0].astype(np.float64).sum())
    store.close()
    return float(view[0].astype(np.float64).sum()) + first * 0  # must not SIGSEGV/SIGBUS


def test_pool_view_kept_past_close_never_crashes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path, 17)
    result = in_child(touch_view_after_close, str(path), timeout=30)
    assert result.status in ("ok", "raised"), str(result)
    if result.status == "raised":
        assert "pagedkv.errors" in result.value, result.value


def use_in_forked_child(store: pagedkv.KVStore) -> str:
    try:
        store.read("a")
    except StoreClosed as exc:
        return f"StoreClosed: {exc}"
    except BaseException as exc:  # noqa: BLE001
        return f"other: {describe(exc)}"
    return "worked"


def test_handle_used_in_a_forked_child_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path, 18)
    store = pagedkv.open(path)
    try:
        result = in_child(use_in_forked_child, store, timeout=30)
        assert result.status == "ok" and result.value.startswith("StoreClosed"), str(result)
        store.read("a")  # the parent's handle is unharmed
        store.commit()
    finally:
        store.close()
