"""A one-page read's restore: it checks what it restores, counts it, and leaves the seams it passes.

The restore of a one-page read is also the page's verification (a page spilled
before its first check after reopen is caught there), its latency lands in the
store's window, and each restore passes its crash point once.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import PageCorrupt, faults
from pagedkv.counters import Stats
from pagedkv.storage.pool import HEADER_NBYTES

from tests.kits.content import assert_same_bits
from tests.kits.model import Model
from tests.kits.store import GEOM

PS = GEOM.page_size


def test_a_page_spilled_before_its_first_check_is_checked_by_its_restore(stores, seed) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    for seq, pages in (("a", 1), ("b", 3)):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, pages * PS))
    store.commit()
    mgr = store._mgr
    slot = int(mgr.slot[store._seqs.find("a").pids[0]])
    store.close()
    with open(stores.path() / "pool.bin", "r+b") as pool:  # one bit of a committed token of "a"
        pool.seek(HEADER_NBYTES + slot * GEOM.page_nbytes + 4)
        byte = pool.read(1)[0]
        pool.seek(-1, 1)
        pool.write(bytes([byte ^ 0x04]))
    store = stores.open(pool_pages=4)
    mgr = store._mgr
    unchecked = [int(pid) for seq in map(store._seqs.find, ("a", "b")) for pid in seq.pids[:seq.npages]]
    assert not mgr.verified[unchecked].any() and (mgr.slot[unchecked] >= 0).all()
    store.create("c")
    model.create("c")
    store.append("c", *model.next_kv("c", 4 * PS))  # evicts every page of "a" and "b", none read
    assert (mgr.slot[unchecked] < 0).all()
    before = store.stats()
    with pytest.raises(PageCorrupt) as err:
        store.read("a", 0, 1)
    assert err.value.uid == int(mgr.uid[unchecked[0]]) and mgr.corrupt[unchecked[0]]
    for page in range(3):  # undamaged and restored: read right, then resident hits
        for _ in range(2):
            k, v = store.read("b", page * PS, page * PS + 1)
            want_k, want_v = model.expected("b", page * PS, page * PS + 1)
            assert_same_bits(k, want_k, f"K of page {page} of b")
            assert_same_bits(v, want_v, f"V of page {page} of b")
    after = store.stats()
    assert {name: after[name] - before[name] for name in ("restores", "spill_hits", "resident_hits", "misses")} \
        == {"restores": 3, "spill_hits": 3, "resident_hits": 3, "misses": 1}


def test_restore_latency_window_summarises_the_last_latencies() -> None:
    stats = Stats(window=4)
    assert stats.snapshot()["restore_ms_p50"] == 0.0
    seconds = [0.001, 0.002, 0.010, 0.003, 0.004, 0.005]
    for value in seconds:
        stats.restore_latency(value)
    last = np.array(seconds[-4:]) * 1e3  # the window keeps the last four
    summary = stats.snapshot()
    assert summary["restore_ms_mean"] == pytest.approx(float(last.mean()))
    assert summary["restore_ms_p50"] == pytest.approx(float(np.percentile(last, 50)))
    assert summary["restore_ms_p99"] == pytest.approx(float(np.percentile(last, 99)))


def test_each_one_page_restore_passes_its_crash_point_once(stores, seed) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    for seq in ("a", "b"):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, (3 if seq == "a" else 4) * PS))
    assert (store._mgr.slot[store._seqs.find("a").pids[:3]] < 0).all()
    before = faults.hits().get("restore.after_copy", 0)
    for page in range(3):
        store.read("a", page * PS, page * PS + 1)
    store.read("a", 0, 1)  # resident now: no restore
    assert faults.hits()["restore.after_copy"] == before + 3
