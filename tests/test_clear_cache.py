"""``KVStore.clear_cache`` and a lowered ``spill_limit_bytes`` taking effect at open.

Geometry: ``kits.prefix.GEOM`` (8 tokens a page, 1 KiB pages). "Cache-only" pages are the hashed
full pages of dropped (and committed) sequences. What LMDB holds is measured by summing the
sizes of the values in its ``pages`` database, white-box through the handle's environment.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import pagedkv
from pagedkv import PagedKVError, ReadOnlyStore

from tests.kits.prefix import PS, assert_holds, extend, index_problems, prefill, prompt




def record_bytes(store: pagedkv.KVStore) -> int:
    """The bytes of every page record in the store's LMDB ``pages`` database."""
    spill = store._spill
    with spill.begin_read() as txn:
        return sum(len(value) for _, value in spill.iterate(txn, spill.pages))


def cache_record_bytes(store: pagedkv.KVStore) -> int:
    """White-box: record bytes of cache-only pages (refcount 0)."""
    mgr = store._mgr
    rows = np.flatnonzero(mgr.live & (mgr.ref == 0))
    return int(mgr.rec_bytes[rows].sum())


def consistent(store: pagedkv.KVStore) -> None:
    assert store.check() == []
    assert index_problems(store) == []


class World:
    """A live sequence ``L`` and two cached prompts, ``A`` older than ``B``, all spilled."""

    def __init__(self, store: pagedkv.KVStore, seed: int, pages: int = 4) -> None:
        rng = np.random.default_rng(seed)
        self.L = prompt(rng, 3 * PS + 5)
        self.A = prompt(rng, pages * PS + 1)
        self.B = prompt(rng, pages * PS + 1)
        prefill(store, "L", self.L)
        for name in ("A", "B"):
            prefill(store, name, getattr(self, name))
            store.drop(name)  # its full pages stay as cache
        # Newer traffic pushes A's and B's pages out to spill, A's first.
        prefill(store, "push", prompt(rng, store.pool_pages * PS))
        store.drop("push")
        store.commit()
        self.pages = pages

    def check_live(self, store: pagedkv.KVStore) -> None:
        assert_holds(store, "L", self.L)


def test_clear_cache_drops_every_cache_page(pstores, seed) -> None:
    store = pstores.open(pool_pages=8)
    world = World(store, seed)
    before = store.stats()
    on_disk = record_bytes(store)
    cached = cache_record_bytes(store)
    assert before["cached_pages"] >= 2 * world.pages and cached > 0
    dropped = store.clear_cache()
    assert dropped["pages"] == before["cached_pages"]
    assert dropped["bytes"] == cached
    assert record_bytes(store) == on_disk - cached  # the records left LMDB
    st = store.stats()
    assert st["cached_pages"] == 0 and st["cached_bytes"] == 0
    assert st["spill_bytes"] == before["spill_bytes"] - cached
    assert st["cache_drops"] == before["cache_drops"] + dropped["pages"]
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == 0
    assert store.lookup(world.L) == 3 * PS  # a live sequence's pages are never dropped
    world.check_live(store)
    consistent(store)
    store = pstores.reopen(store)
    assert store.stats()["cached_pages"] == 0
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == 0
    world.check_live(store)
    consistent(store)


def test_clear_cache_frees_the_slots_of_resident_cache_pages(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    store = pstores.open(pool_pages=16)
    ids = prompt(rng, 3 * PS + 2)
    prefill(store, "a", ids)
    store.drop("a")
    store.commit()
    st = store.stats()
    assert (st["cached_pages"], st["spilled_pages"], st["pool_used"]) == (3, 0, 3)
    dropped = store.clear_cache()
    assert dropped == {"pages": 3, "bytes": 0, "slots": 3}
    st = store.stats()
    assert (st["cached_pages"], st["pool_used"], st["pool_free"]) == (0, 0, 16)
    assert store.lookup(ids) == 0
    consistent(store)
    store = pstores.reopen(store)
    assert store.lookup(ids) == 0 and store.stats()["pages"] == 0


def test_clear_cache_to_a_budget_drops_the_least_recently_used(pstores, seed) -> None:
    store = pstores.open(pool_pages=8)
    world = World(store, seed)
    mgr = store._mgr
    by_prompt = {}
    for name in ("A", "B"):
        ids = getattr(world, name)
        pids = mgr.prefix.match(ids, world.pages, mgr)
        assert len(pids) == world.pages and (mgr.slot[pids] < 0).all()  # spilled, all of them
        by_prompt[name] = int(mgr.rec_bytes[pids].sum())
    on_disk = record_bytes(store)
    budget = cache_record_bytes(store) - by_prompt["A"]
    dropped = store.clear_cache(max_bytes=budget)
    assert dropped["pages"] == world.pages and dropped["bytes"] == by_prompt["A"]
    assert cache_record_bytes(store) <= budget
    assert record_bytes(store) == on_disk - by_prompt["A"]
    assert store.lookup(world.A) == 0  # the older prompt went
    assert store.lookup(world.B) == world.pages * PS  # the newer one stays
    assert store.clear_cache(max_bytes=budget) == {"pages": 0, "bytes": 0, "slots": 0}
    assert prefill(store, "b2", world.B) == world.pages * PS
    assert_holds(store, "b2", world.B)
    world.check_live(store)
    consistent(store)
    store = pstores.reopen(store)
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == world.pages * PS
    world.check_live(store)
    consistent(store)


def test_the_drop_is_committed_at_once_and_alone(pstores, seed) -> None:
    """A crash right after clear_cache: the pages stay dropped, other uncommitted work is gone."""
    store = pstores.open(pool_pages=8)
    world = World(store, seed)
    store.create("uncommitted")
    extend(store, "L", world.A[:3])  # an uncommitted append to a live sequence
    assert store.clear_cache()["pages"] > 0
    store._abandon()
    store = pstores.open(geom=None, pool_pages=None)
    assert sorted(store.sequences()) == ["L"]
    assert store.stats()["cached_pages"] == 0
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == 0
    world.check_live(store)
    consistent(store)


def test_pages_a_committed_sequence_still_references_are_kept(pstores, seed) -> None:
    """Dropped but not yet committed: a crash brings the sequence back, so its pages must stay."""
    rng = np.random.default_rng(seed)
    store = pstores.open(pool_pages=4)
    ids = prompt(rng, 4 * PS + 1)
    prefill(store, "a", ids)
    store.commit()
    store.drop("a")
    assert store.stats()["cached_pages"] == 4
    assert store.clear_cache()["pages"] == 0
    store._abandon()
    store = pstores.open(geom=None, pool_pages=None)
    assert_holds(store, "a", ids)
    store.drop("a")
    store.commit()
    assert store.clear_cache()["pages"] == 4
    assert store.lookup(ids) == 0
    consistent(store)


@pytest.mark.parametrize("write_behind", [False, True], ids=["foreground", "write-behind"])
def test_clear_cache_beside_ongoing_work(pstores, seed, write_behind: bool) -> None:
    rng = np.random.default_rng(seed)
    store = pstores.open(pool_pages=8, write_behind=write_behind)
    live = {}
    for r in range(12):
        ids = prompt(rng, int(rng.integers(PS, 5 * PS)))
        prefill(store, r, ids)
        if r % 3:
            store.drop(r)
        else:
            live[r] = ids
        if r % 4 == 3:
            store.commit()
            store.clear_cache(max_bytes=int(rng.integers(0, 4)) * 1100)
        consistent(store)
    for seq, ids in live.items():
        assert_holds(store, seq, ids)
        assert store.lookup(ids) >= (len(ids) // PS) * PS
    store = pstores.reopen(store)
    for seq, ids in live.items():
        assert_holds(store, seq, ids)
    consistent(store)


def test_clear_cache_arguments(pstores) -> None:
    store = pstores.open()
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(PagedKVError, match="max_bytes"):
            store.clear_cache(max_bytes=bad)  # type: ignore[arg-type]
    assert store.clear_cache(max_bytes=0) == {"pages": 0, "bytes": 0, "slots": 0}
    store.close()
    reader = pagedkv.open(store.path, readonly=True)
    try:
        with pytest.raises(ReadOnlyStore):
            reader.clear_cache()
    finally:
        reader.close()


# -- a lowered spill cap at open ------------------------------------------------------------


def build_uncapped(pstores, seed) -> tuple[World, int, dict[str, int]]:
    store = pstores.open(pool_pages=8)
    world = World(store, seed)
    mgr = store._mgr
    sizes = {name: int(mgr.rec_bytes[mgr.prefix.match(getattr(world, name), world.pages, mgr)].sum())
             for name in ("A", "B")}
    total = record_bytes(store)
    store.close()
    return world, total, sizes


def test_a_lowered_cap_drops_the_oldest_cache_pages_at_open(pstores, seed, caplog) -> None:
    world, total, sizes = build_uncapped(pstores, seed)
    cap = total - sizes["A"]
    caplog.set_level(logging.INFO, logger="pagedkv")
    store = pstores.open(geom=None, pool_pages=None, spill_limit_bytes=cap)
    assert store.stats()["spill_bytes"] <= cap
    assert record_bytes(store) <= cap
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == world.pages * PS
    drops = [r for r in caplog.records if r.name.startswith("pagedkv") and "spill_limit_bytes" in r.getMessage()]
    assert drops and drops[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
    consistent(store)
    # (reading L here would restore its spilled pages, and the evictions that makes room
    # for them drop more cache pages under the cap: B's)
    store._abandon()  # committed at open: a crash keeps the drop
    store = pstores.open(geom=None, pool_pages=None)
    assert record_bytes(store) <= cap
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == world.pages * PS
    world.check_live(store)
    consistent(store)


def test_a_cap_below_the_live_set_opens_with_a_warning(pstores, seed, caplog) -> None:
    world, total, sizes = build_uncapped(pstores, seed)
    live_bytes = total - sizes["A"] - sizes["B"]
    assert live_bytes > 0  # some of L's pages are spilled
    caplog.set_level(logging.INFO, logger="pagedkv")
    store = pstores.open(geom=None, pool_pages=None, spill_limit_bytes=live_bytes // 2)
    assert record_bytes(store) == live_bytes  # every spilled cache page went; the live ones stay
    assert store.stats()["cached_bytes"] == 0
    assert store.lookup(world.A) == 0 and store.lookup(world.B) == 0
    warnings = [r for r in caplog.records if r.name.startswith("pagedkv") and r.levelno == logging.WARNING]
    assert warnings and "live" in warnings[0].getMessage(), [r.getMessage() for r in caplog.records]
    store.close()
    store = pstores.open(geom=None, pool_pages=None)
    world.check_live(store)
    consistent(store)


def test_a_cap_the_store_already_meets_changes_nothing_at_open(pstores, seed, caplog) -> None:
    world, total, sizes = build_uncapped(pstores, seed)
    caplog.set_level(logging.DEBUG, logger="pagedkv")
    store = pstores.open(geom=None, pool_pages=None, spill_limit_bytes=total)
    assert record_bytes(store) == total
    assert store.lookup(world.A) == world.pages * PS and store.lookup(world.B) == world.pages * PS
    assert not [r for r in caplog.records if "spill_limit_bytes" in r.getMessage()]
    consistent(store)


def test_read_only_open_drops_nothing(pstores, seed) -> None:
    world, total, sizes = build_uncapped(pstores, seed)
    reader = pagedkv.open(pstores.path(), readonly=True, spill_limit_bytes=1)
    try:
        assert record_bytes(reader) == total
        assert reader.lookup(world.A) == world.pages * PS
    finally:
        reader.close()
