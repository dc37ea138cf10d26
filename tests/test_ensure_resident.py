"""``BlockManager.ensure_resident`` on a step's few pages (sorted out in Python) and on many (with numpy).

Both ways must do the same: every page asked for is resident afterwards and
holds its own bytes, each spilled page is restored once however often it is
asked for, the resident ones count as hits (once per time asked), no pin is
left behind, and the slots returned are the pages' own.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv.pages.manager import _FEW

from tests.kits.content import get_seed
from tests.kits.store import GEOM


def _store(tmp_path: Path, pool: int, seqs: int) -> tuple[pagedkv.KVStore, dict[int, np.ndarray]]:
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=pool, evict_batch=4, durability="nosync")
    rng = np.random.default_rng(0)
    shape = (GEOM.layers, GEOM.page_size * 3, GEOM.kv_heads, GEOM.head_dim)
    written = {}
    for seq in range(seqs):
        k, v = rng.standard_normal(shape).astype(GEOM.np_dtype), rng.standard_normal(shape).astype(GEOM.np_dtype)
        store.create(seq)
        store.append(seq, k, v)
        written[seq] = np.stack([k, v], axis=1)  # (layers, K/V, tokens, heads, dim)
    store.commit()
    return store, written


@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_ensure_resident_restores_each_page_once(tmp_path: Path, many: bool) -> None:
    seed = get_seed()
    rng = random.Random(seed)
    store, written = _store(tmp_path, pool=64, seqs=40)  # 120 pages: most of them spilled
    mgr = store._mgr
    try:
        for _ in range(20):
            count = rng.randint(_FEW + 1, 40) if many else rng.randint(1, _FEW)
            rows = [(seq, index) for seq in range(40) for index in range(3)]
            asked = [rng.choice(rows) for _ in range(count)]  # repeats on purpose
            pids = np.array([int(store._seqs.find(seq).pids[index]) for seq, index in asked], np.int64)
            spilled = {int(pid) for pid in pids.tolist() if mgr.slot[pid] < 0}
            resident = sum(1 for pid in pids.tolist() if int(pid) not in spilled)
            before = dict(store.stats())
            pins = mgr.pins.copy()
            slots = mgr.ensure_resident(pids)
            after = store.stats()
            assert after["restores"] - before["restores"] == len(spilled)
            assert after["resident_hits"] - before["resident_hits"] == resident
            assert np.array_equal(mgr.pins, pins)
            assert slots.tolist() == mgr.slot[pids].tolist() and (slots >= 0).all()
            for (seq, index), slot in zip(asked, slots.tolist()):
                page = written[seq][:, :, index * GEOM.page_size:(index + 1) * GEOM.page_size]
                assert np.array_equal(store.pool[slot], page), (seq, index)
        assert store.check() == []
    finally:
        store.close()
