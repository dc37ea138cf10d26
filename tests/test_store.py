"""The public API of KVStore: sequences, append/read, fork, drop, step, persistence, stats, errors."""

from __future__ import annotations

import os
import stat
import struct

import lmdb
import numpy as np
import pytest

import pagedkv
from pagedkv import (Geometry, GeometryMismatch, PageCorrupt, PagedKVError, PoolExhausted, ReadOnlyStore,
                     SequenceBusy, SequenceExists, SequenceNotFound, StoreClosed, StoreCorrupt)

from tests.kits.content import assert_same_bits, kv
from tests.kits.files import flip_bit
from tests.kits.model import Model
from tests.kits.store import GEOM, check_step_outputs, engine_write



PS = GEOM.page_size
REQUIRED_STATS = ("resident_hits", "spill_hits", "misses", "evictions", "restores", "bytes_spilled",
                  "bytes_restored", "restore_ms_mean", "restore_ms_p50", "restore_ms_p99",
                  "pool_used", "pool_free", "pool_pinned", "spilled_pages")


def filled(store: pagedkv.KVStore, model: Model, seq, n: int) -> None:
    """Create ``seq`` (in both) and append ``n`` tokens."""
    store.create(seq)
    model.create(seq)
    if n:
        store.append(seq, *model.next_kv(seq, n))


# -- create / append / read ------------------------------------------------------------


def test_create_empty_sequence(store) -> None:
    assert store.create("a") == 0
    assert store.length("a") == 0
    assert store.sequences() == ["a"]
    k, v = store.read("a")
    assert k.shape == v.shape == (GEOM.layers, 0, GEOM.kv_heads, GEOM.head_dim)
    assert k.dtype == v.dtype == GEOM.np_dtype
    assert store.check() == []


@pytest.mark.parametrize("n", range(1, 3 * PS + 1))
def test_append_spans_pages_read_every_range(store, n: int) -> None:
    model = Model(n)
    filled(store, model, "a", n)
    assert store.length("a") == n
    for start in range(n + 1):
        for stop in range(start, n + 1):
            model.verify(store, "a", start, stop)
    model.verify(store, "a")  # stop=None
    assert store.stats()["pages"] == -(-n // PS)
    assert store.check() == []


@pytest.mark.parametrize("chunks", [[1] * 13, [3, 1, 4, 1, 5], [4, 4, 4], [2, 7, 1, 9], [12, 1, 1]])
def test_append_chunks_across_boundaries(store, chunks: list[int]) -> None:
    model = Model(sum(chunks))
    filled(store, model, "a", 0)
    for n in chunks:
        store.append("a", *model.next_kv("a", n))
        model.verify(store, "a")
    total = sum(chunks)
    for start in range(0, total, 3):
        model.verify(store, "a", start, min(total, start + 5))
    assert store.check() == []


def test_append_accepts_noncontiguous_input(store) -> None:
    k, v = kv(1, "nc", 0, 10)
    kt = np.asfortranarray(k)
    vt = np.concatenate([v, v], axis=1)[:, ::2]  # strided view
    store.create("a")
    store.append("a", kt, vt)
    rk, rv = store.read("a")
    assert_same_bits(rk, k)
    assert_same_bits(rv, np.ascontiguousarray(vt))
    assert store.check() == []


def test_read_returns_copies(store) -> None:
    model = Model(3)
    filled(store, model, "a", 6)
    k, v = store.read("a")
    k[...] = 0
    v[...] = 0
    model.verify(store, "a")
    assert store.check() == []


@pytest.mark.parametrize("start,stop", [(-1, None), (0, 7), (5, 4), (7, 7), (-3, -1), (0, -1),
                                        (1.0, 3), (0, 2.5), (True, 3), (0, False), ("0", 3),
                                        (None, 3), (0, 10**30), (-(10**30), 2)])
def test_read_bad_range_raises(store, start, stop) -> None:
    model = Model(1)
    filled(store, model, "a", 6)
    with pytest.raises(PagedKVError):
        store.read("a", start, stop)
    model.verify(store, "a")
    assert store.check() == []


def test_read_numpy_int_bounds(store) -> None:
    model = Model(2)
    filled(store, model, "a", 9)
    k, _ = store.read("a", np.int64(2), np.int32(7))
    assert_same_bits(k, model.expected("a", 2, 7)[0])
    assert store.check() == []


@pytest.mark.parametrize("make", [
    lambda: (np.zeros((2, 3, 2, 4), np.float16), np.zeros((2, 3, 2, 4), np.float16)),
    lambda: (np.zeros((2, 3, 2, 4), np.float64), np.zeros((2, 3, 2, 4), np.float64)),
    lambda: (np.zeros((2, 3, 2, 4), np.float32), np.zeros((2, 3, 2, 4), np.float16)),
    lambda: (np.zeros((2, 3, 2, 4), ">f4"), np.zeros((2, 3, 2, 4), ">f4")),
    lambda: (np.zeros((3, 3, 2, 4), np.float32), np.zeros((3, 3, 2, 4), np.float32)),
    lambda: (np.zeros((2, 3, 4, 2), np.float32), np.zeros((2, 3, 4, 2), np.float32)),
    lambda: (np.zeros((2, 3, 2), np.float32), np.zeros((2, 3, 2), np.float32)),
    lambda: (np.zeros((2, 3, 2, 4, 1), np.float32), np.zeros((2, 3, 2, 4, 1), np.float32)),
    lambda: (np.zeros((2, 0, 2, 4), np.float32), np.zeros((2, 0, 2, 4), np.float32)),
    lambda: (np.zeros((2, 3, 2, 4), np.float32), np.zeros((2, 2, 2, 4), np.float32)),
    lambda: (np.zeros((2, 3, 2, 4), np.float32).tolist(), np.zeros((2, 3, 2, 4), np.float32)),
    lambda: (None, None),
    lambda: (np.zeros((2, 3, 2, 4), np.float32), "v"),
])
def test_append_wrong_dtype_or_shape_raises(store, make) -> None:
    model = Model(4)
    filled(store, model, "a", 5)
    k, v = make()
    with pytest.raises(PagedKVError):
        store.append("a", k, v)
    assert store.length("a") == 5
    model.verify(store, "a")
    assert store.stats()["tokens_appended"] == 5
    assert store.check() == []


def test_sequence_ids_str_and_int_distinct(store) -> None:
    model = Model(5)
    ids = ["a", 1, "1", 0, -5, 2**63 - 1, -(2**63), "", "ünï", "x" * 200]
    for i, seq in enumerate(ids):
        filled(store, model, seq, i + 1)
    assert store.sequences() == ids
    for seq in ids:
        model.verify(store, seq)
    assert store.check() == []


def test_sequence_id_str_subclass_is_the_same_id(store) -> None:
    """An id the store accepts names that sequence in every call (numpy.str_ is a str)."""
    sub = np.str_("b")
    model = Model(42)
    store.create(sub)
    model.create("b")
    store.append(sub, *model.next_kv("b", 3))
    assert store.length(sub) == store.length("b") == 3
    model.verify(store, "b")
    k, _ = store.read(sub)
    assert k.tobytes() == model.expected("b")[0].tobytes()
    with pytest.raises(SequenceExists):
        store.create("b")
    store.drop(sub)
    assert store.sequences() == []
    assert store.check() == []


def test_sequence_ids_survive_reopen(stores) -> None:
    store = stores.open()
    model = Model(6)
    ids = ["a", 1, "1", 0, -7, 2**63 - 1, "ünï"]
    for i, seq in enumerate(ids):
        filled(store, model, seq, i + 2)
    store = stores.reopen(store)
    assert sorted(map(repr, store.sequences())) == sorted(map(repr, ids))
    model.verify_all(store)
    assert store.check() == []


@pytest.mark.parametrize("bad", [1.5, None, b"a", ("a",), ["a"], True, 2**63, -(2**63) - 1, "x" * 300,
                                 "\ud800"])
def test_sequence_id_invalid_raises(store, bad) -> None:
    with pytest.raises(PagedKVError):
        store.create(bad)
    assert store.sequences() == []
    assert store.check() == []


def test_create_existing_raises_sequence_exists(store) -> None:
    store.create("a")
    with pytest.raises(SequenceExists):
        store.create("a")
    assert issubclass(SequenceExists, PagedKVError)
    assert store.sequences() == ["a"]
    assert store.check() == []


@pytest.mark.parametrize("call", [
    lambda s, k, v: s.append("nope", k, v),
    lambda s, k, v: s.read("nope"),
    lambda s, k, v: s.length("nope"),
    lambda s, k, v: s.drop("nope"),
    lambda s, k, v: s.fork("nope", "b"),
    lambda s, k, v: s.step({"nope": 1}).__enter__(),
    lambda s, k, v: s.step({"a": 1, "nope": 1}).__enter__(),
    lambda s, k, v: s.can_step({"nope": 1}),
    lambda s, k, v: s.read(1),  # int 1 is not "1"
])
def test_missing_sequence_raises_sequence_not_found(store, call) -> None:
    model = Model(7)
    filled(store, model, "a", 3)
    k, v = kv(0, "x", 0, 2)
    with pytest.raises(SequenceNotFound) as info:
        call(store, k, v)
    assert isinstance(info.value, PagedKVError)
    assert "nope" in str(info.value) or "1" in str(info.value)
    model.verify_all(store)
    assert store.stats()["pool_pinned"] == 0
    assert store.check() == []


def test_errors_form_one_tree() -> None:
    for cls in (pagedkv.SequenceNotFound, pagedkv.SequenceExists, pagedkv.SequenceBusy,
                pagedkv.PoolExhausted, pagedkv.StoreLocked, pagedkv.StoreCorrupt,
                pagedkv.PageCorrupt, pagedkv.GeometryMismatch, pagedkv.StoreFull,
                pagedkv.FormatVersionError, pagedkv.StoreClosed, pagedkv.StoreIOError,
                pagedkv.ReadOnlyStore):
        assert issubclass(cls, PagedKVError), cls


def test_bad_calls_raise_only_typed_errors(store) -> None:
    """A battery of wrong calls: each raises a PagedKVError and never lmdb.Error/OSError/bare KeyError."""
    model = Model(8)
    filled(store, model, "a", 5)
    k, v = kv(0, "x", 0, 2)
    calls = [
        lambda: store.create("a"), lambda: store.create(3.5), lambda: store.create(None),
        lambda: store.append("a", k, np.zeros(v.shape, np.float16)), lambda: store.append("a", k, k[:, :1]),
        lambda: store.append("zz", k, v), lambda: store.append(["a"], k, v),
        lambda: store.read("a", -1), lambda: store.read("a", 0, 99), lambda: store.read({}, 0),
        lambda: store.fork("a", "a"), lambda: store.fork("zz", "b"), lambda: store.fork("a", 1.5),
        lambda: store.drop("zz"), lambda: store.drop(None), lambda: store.length("zz"),
        lambda: store.step({}).__enter__(), lambda: store.step([("a", 1)]).__enter__(),
        lambda: store.step({"a": -1}).__enter__(), lambda: store.step({"a": 1.0}).__enter__(),
        lambda: store.step({"a": True}).__enter__(), lambda: store.step({"a": "1"}).__enter__(),
        lambda: store.step({"zz": 1}).__enter__(), lambda: store.step({2.5: 1}).__enter__(),
        lambda: store.step({"a": 10**6}).__enter__(),
        lambda: pagedkv.open(store.path, GEOM, 9), lambda: pagedkv.open(store.path),
        lambda: pagedkv.open(os.path.join(store.path, "pool.bin")),
        lambda: pagedkv.open(store.path, durability="fast"),
        lambda: pagedkv.open(store.path, "geom", 8),  # type: ignore[arg-type]
        lambda: pagedkv.open(os.path.join(store.path, "missing")),
        lambda: pagedkv.open(os.path.join(store.path, "pool.bin", "sub"), GEOM, 4),
        lambda: pagedkv.open(os.path.join(store.path, "x"), GEOM, 0),
        lambda: pagedkv.open(os.path.join(store.path, "x"), GEOM, True),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(Exception) as info:
            call()
        exc = info.value
        assert isinstance(exc, PagedKVError), (i, type(exc), exc)
        assert not isinstance(exc, lmdb.Error), i
        assert not isinstance(exc, OSError), i
        assert not (isinstance(exc, KeyError) and not isinstance(exc, SequenceNotFound)), i
    model.verify_all(store)
    assert store.stats()["pool_pinned"] == 0
    assert store.check() == []


@pytest.mark.parametrize("counts", [{"a": "x"}, {"a": -1}, {"a": 1.5}, {"a": None}, {}])
def test_can_step_rejects_what_step_rejects(store, counts) -> None:
    """can_step() validates its argument like step(): a typed error, never ValueError/TypeError or True."""
    store.create("a")
    with pytest.raises(PagedKVError):
        with store.step(counts):
            pass
    with pytest.raises(PagedKVError):
        store.can_step(counts)
    assert store.check() == []


# -- fork / copy-on-write / drop ---------------------------------------------------------


def test_fork_copy_on_write_partial_page(store) -> None:
    model = Model(9)
    filled(store, model, "a", PS + 2)  # last page is partial and will be shared
    pages = store.stats()["pages"]
    store.fork("a", "b")
    model.fork("a", "b")
    assert store.stats()["pages"] == pages  # shared, nothing copied yet
    model.verify(store, "b")
    cow = store.stats()["cow_copies"]
    store.append("b", *model.next_kv("b", 1))
    assert store.stats()["cow_copies"] == cow + 1
    store.append("a", *model.next_kv("a", 3))  # a's last page is private again: no copy
    store.append("b", *model.next_kv("b", 5))
    assert store.stats()["cow_copies"] == cow + 1
    assert store.stats()["pages"] == pages + 1 + 1 + 1  # b's copy, a's new page, b's new page
    model.verify_all(store)
    for seq in ("a", "b"):
        for start in range(model.lens[seq]):
            model.verify(store, seq, start, model.lens[seq])
    assert store.check() == []


def test_fork_at_page_boundary_needs_no_copy(store) -> None:
    model = Model(10)
    filled(store, model, "a", 2 * PS)
    store.fork("a", "b")
    model.fork("a", "b")
    store.append("b", *model.next_kv("b", 3))
    store.append("a", *model.next_kv("a", 3))
    assert store.stats()["cow_copies"] == 0
    model.verify_all(store)
    assert store.check() == []


def test_fork_empty_and_chain(store) -> None:
    model = Model(11)
    filled(store, model, "e", 0)
    store.fork("e", "e2")
    model.fork("e", "e2")
    filled(store, model, "a", 3)
    copies = 0
    for i in range(6):  # a -> f0 -> f1 ..., each appending one token after the fork
        src, dst = ("a" if i == 0 else f"f{i - 1}"), f"f{i}"
        store.fork(src, dst)
        model.fork(src, dst)
        copies += model.lens[dst] % PS != 0  # a shared partial page is copied on append
        store.append(dst, *model.next_kv(dst, 1))
        assert store.stats()["cow_copies"] == copies
    assert copies == 4  # lengths 3, 4, 5, 6, 7, 8: all but 4 and 8 end mid-page
    model.verify_all(store)
    assert store.check() == []


def test_fork_errors(store) -> None:
    store.create("a")
    store.create("b")
    with pytest.raises(SequenceExists):
        store.fork("a", "b")
    with pytest.raises(SequenceExists):
        store.fork("a", "a")
    with pytest.raises(SequenceNotFound):
        store.fork("x", "c")
    assert sorted(store.sequences()) == ["a", "b"]
    assert store.check() == []


def test_fork_then_drop_source_keeps_fork(store) -> None:
    model = Model(12)
    filled(store, model, "a", 2 * PS + 1)
    store.fork("a", "b")
    model.fork("a", "b")
    pages = store.stats()["pages"]
    store.drop("a")
    model.drop("a")
    assert store.stats()["pages"] == pages  # b still holds all of them
    model.verify_all(store)
    store.append("b", *model.next_kv("b", 2))  # refcount back to 1: no copy
    assert store.stats()["cow_copies"] == 0
    model.verify_all(store)
    assert store.check() == []


def test_drop_frees_pages_and_id_is_reusable(store) -> None:
    model = Model(13)
    filled(store, model, "keep", 5)
    base_pages = store.stats()["pages"]
    filled(store, model, "a", 3 * PS)
    assert store.stats()["pages"] == base_pages + 3
    store.drop("a")
    model.drop("a")
    assert store.stats()["pages"] == base_pages
    with pytest.raises(SequenceNotFound):
        store.length("a")
    with pytest.raises(SequenceNotFound):
        store.read("a")
    assert store.sequences() == ["keep"]
    filled(store, model, "a", 2)  # the same id again: new content, old pages gone
    model.verify_all(store)
    store.commit()
    store.drop("keep")
    model.drop("keep")
    model.verify_all(store)
    assert store.check() == []


def test_drop_survives_reopen(stores) -> None:
    store = stores.open(pool_pages=4)
    model = Model(14)
    for i in range(6):
        filled(store, model, i, 5 + i)
    store.commit()
    for i in (0, 3, 5):
        store.drop(i)
        model.drop(i)
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.stats()["pages"] == sum(-(-n // PS) for n in model.lens.values())
    assert store.check() == []


# -- step ------------------------------------------------------------------------------


def test_step_outputs_follow_mapping_order(store) -> None:
    model = Model(15)
    filled(store, model, "a", 3)
    filled(store, model, "b", 0)
    filled(store, model, 7, 9)
    before = dict(model.lens)
    counts = {7: 1, "a": 6, "b": 2}
    with store.step(counts) as s:
        check_step_outputs(store, s, [7, "a", "b"], before, counts)
        engine_write(store, s, [model.next_kv(seq, n) for seq, n in counts.items()])
        assert store.stats()["pool_pinned"] == len(np.unique(s.block_tables[s.block_tables >= 0]))
    assert store.stats()["pool_pinned"] == 0
    model.verify_all(store)
    assert store.check() == []


def test_step_block_tables_index_existing_tokens(store) -> None:
    """Inside a step, pool[block_tables] holds every existing token of each sequence."""
    model = Model(16)
    filled(store, model, "a", 2 * PS + 1)
    filled(store, model, "b", PS)
    with store.step({"b": 0, "a": 1}) as s:
        for row, seq in enumerate(["b", "a"]):
            k, v = model.expected(seq)
            for pos in range(model.lens[seq]):
                slot = s.block_tables[row, pos // PS]
                assert store.pool[slot, :, 0, pos % PS].tobytes() == k[:, pos].tobytes()
                assert store.pool[slot, :, 1, pos % PS].tobytes() == v[:, pos].tobytes()
        engine_write(store, s, [model.next_kv("b", 0), model.next_kv("a", 1)])
    model.verify_all(store)
    assert store.check() == []


def test_step_prefill_then_decode_persists(stores) -> None:
    store = stores.open(pool_pages=16)
    model = Model(17)
    seqs = ["p", "q", "r"]
    for seq in seqs:
        filled(store, model, seq, 0)
    prefill = {"p": 13, "q": 1, "r": 7}
    with store.step(prefill) as s:
        check_step_outputs(store, s, seqs, {q: 0 for q in seqs}, prefill)
        engine_write(store, s, [model.next_kv(q, n) for q, n in prefill.items()])
    for _ in range(10):
        before = dict(model.lens)
        counts = {q: 1 for q in seqs}
        with store.step(counts) as s:
            check_step_outputs(store, s, seqs, before, counts)
            engine_write(store, s, [model.next_kv(q, 1) for q in seqs])
    model.verify_all(store)
    assert store.stats()["steps"] == 11
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_step_new_tokens_committed_survive_reopen_under_eviction(stores) -> None:
    """Steps in a pool that keeps spilling: written K/V survive eviction, restore and reopen."""
    store = stores.open(pool_pages=6, evict_batch=1)
    model = Model(18)
    for i in range(6):
        filled(store, model, i, 0)
    for rnd in range(6):  # each sequence ends with at most 18 tokens: 5 pages of the 6 slots
        for i in range(6):
            counts = {i: 1 + (i + rnd) % 3}
            with store.step(counts) as s:
                engine_write(store, s, [model.next_kv(i, counts[i])])
        if rnd % 3 == 2:
            store.commit()
    st = store.stats()
    assert st["evictions"] > 0 and st["restores"] > 0
    model.verify_all(store)
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_step_with_zero_new_tokens(store) -> None:
    model = Model(19)
    filled(store, model, "a", 5)
    with store.step({"a": 0}) as s:
        assert len(s.slot_mapping) == 0
        assert s.seq_lens.tolist() == [5]
        assert s.block_tables.shape == (1, 2)
    model.verify_all(store)
    assert store.check() == []


def test_step_raising_rolls_back(store) -> None:
    model = Model(20)
    filled(store, model, "a", PS + 1)
    filled(store, model, "b", 0)
    store.fork("a", "c")  # shared partial page: the step copies it, then must undo the copy
    model.fork("a", "c")
    pages = store.stats()["pages"]

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with store.step({"a": PS + 2, "b": 2 * PS, "c": 1}) as s:
            pool = store.pool
            # the engine scribbles over every new position before failing
            for m in s.slot_mapping.tolist():
                pool[m // PS, :, :, m % PS] = np.float32(-1.0)
            raise Boom
    assert [store.length(q) for q in ("a", "b", "c")] == [PS + 1, 0, PS + 1]
    assert store.stats()["pages"] == pages
    assert store.stats()["pool_pinned"] == 0
    model.verify_all(store)
    # the sequences work normally afterwards
    with store.step({"a": 1, "c": 2, "b": 1}) as s:
        engine_write(store, s, [model.next_kv("a", 1), model.next_kv("c", 2), model.next_kv("b", 1)])
    model.verify_all(store)
    assert store.check() == []


def test_step_rollback_survives_reopen(stores) -> None:
    store = stores.open(pool_pages=6)
    model = Model(21)
    filled(store, model, "a", 3)
    store.commit()
    with pytest.raises(RuntimeError):
        with store.step({"a": 6}):
            raise RuntimeError("engine failed")
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_step_that_cannot_fit_raises_pool_exhausted(store) -> None:
    model = Model(22)
    filled(store, model, "a", 5 * PS)  # 5 pages
    filled(store, model, "b", 2 * PS)  # 2 pages; pool has 8
    assert store.can_step({"a": 1})
    assert store.can_step({"a": 4, "b": 0})  # 5 + 1 new page + 2 = 8 slots
    assert store.can_step({"a": 9})  # 5 + 3 new pages
    assert not store.can_step({"a": 4, "b": 1})  # 5 + 1 + 2 + 1 = 9 slots
    assert not store.can_step({"a": 100})
    stats = store.stats()
    with pytest.raises(PoolExhausted):
        with store.step({"a": 4, "b": 1}):
            pytest.fail("the step body must not run")
    with pytest.raises(PoolExhausted):
        with store.step({"a": 100}):
            pytest.fail("the step body must not run")
    after = store.stats()
    assert after["pool_pinned"] == 0 and after["pages"] == stats["pages"]
    assert store.length("a") == 5 * PS and store.length("b") == 2 * PS
    model.verify_all(store)
    # the fitting one works
    with store.step({"a": 4, "b": 0}) as s:
        engine_write(store, s, [model.next_kv("a", 4), model.next_kv("b", 0)])
    model.verify_all(store)
    assert store.check() == []


def test_step_pins_pages_against_eviction(store) -> None:
    model = Model(23)
    filled(store, model, "a", 3 * PS)
    filled(store, model, "other", 0)
    with store.step({"a": 2}) as s:
        assert store.stats()["pool_pinned"] == 4
        slots = set(s.block_tables[0].tolist())
        # another sequence streams 3 pool-fulls through the 4 unpinned slots
        store.append("other", *model.next_kv("other", 3 * 8 * PS))
        assert set(s.block_tables[0].tolist()) == slots
        assert store.stats()["pool_pinned"] == 4
        engine_write(store, s, [model.next_kv("a", 2)])
    assert store.stats()["pool_pinned"] == 0
    model.verify_all(store)
    assert store.check() == []


def test_step_busy_sequence_rules(store) -> None:
    model = Model(24)
    filled(store, model, "a", 2)
    filled(store, model, "b", 2)
    k, v = kv(0, "x", 0, 1)
    with store.step({"a": 1}) as s:
        with pytest.raises(SequenceBusy):
            store.append("a", k, v)
        with pytest.raises(SequenceBusy):
            store.drop("a")
        with pytest.raises(SequenceBusy):
            store.fork("a", "z")
        with pytest.raises(SequenceBusy):
            with store.step({"a": 1}):
                pass
        with pytest.raises(SequenceBusy):
            store.commit()
        assert not store.can_step({"a": 1})
        # other sequences and reads stay usable
        store.append("b", *model.next_kv("b", 1))
        assert store.read("a", 0, 2)[0].tobytes() == model.expected("a", 0, 2)[0].tobytes()
        engine_write(store, s, [model.next_kv("a", 1)])
    store.commit()
    model.verify_all(store)
    assert store.check() == []


def test_close_inside_own_step_raises_and_keeps_store(stores) -> None:
    """close() inside this thread's step is refused (SequenceBusy) without closing the handle:
    nothing uncommitted may be thrown away by a refused close."""
    store = stores.open()
    model = Model(43)
    filled(store, model, "a", 5)  # never committed
    with store.step({"a": 1}) as s:
        with pytest.raises(SequenceBusy):
            store.close()
        engine_write(store, s, [model.next_kv("a", 1)])
    model.verify_all(store)  # still open and whole
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_smallest_pool_works_or_is_refused(stores) -> None:
    """pool_pages=1 must either be refused at creation or work: nothing is pinned, so a
    PoolExhausted("every pool slot is pinned") from a plain append is wrong."""
    try:
        store = stores.open(pool_pages=1)
    except PagedKVError:
        return
    model = Model(44)
    filled(store, model, "a", 0)
    store.append("a", *model.next_kv("a", 3 * PS + 1))
    model.verify_all(store)
    assert store.check() == []


def test_sequence_longer_than_pool(stores) -> None:
    store = stores.open(pool_pages=4)
    model = Model(25)
    n = 4 * PS * 6 + 3  # six pool-fulls
    filled(store, model, "long", n)
    filled(store, model, "short", 2)
    model.verify(store, "long")
    for start, stop in [(0, 1), (n - 1, n), (5, n - 5), (PS * 4, PS * 9 + 1), (0, n)]:
        model.verify(store, "long", start, stop)
    store.append("long", *model.next_kv("long", 2 * 4 * PS))
    st = store.stats()
    assert st["spilled_pages"] > 0 and st["evictions"] > 0 and st["restores"] > 0
    store = stores.reopen(store)
    model.verify_all(store)
    assert not store.can_step({"long": 1})
    with pytest.raises(PoolExhausted):
        with store.step({"long": 1}):
            pass
    assert store.check() == []


# -- persistence ---------------------------------------------------------------------


def test_close_reopen_keeps_everything(stores) -> None:
    store = stores.open(pool_pages=6)
    model = Model(26)
    for i in range(10):
        filled(store, model, f"s{i}" if i % 2 else i, 3 * i + 1)
    store.fork("s1", "f")
    model.fork("s1", "f")
    store.append("f", *model.next_kv("f", 2))
    before = store.stats()
    assert before["spilled_pages"] > 0 and before["pool_used"] > 0
    store = stores.reopen(store)
    after = store.stats()
    for key in ("pool_used", "spilled_pages", "pages", "sequences", "tokens", "pool_pages"):
        assert after[key] == before[key], key
    assert after["pool_free"] == before["pool_pages"] - after["pool_used"]
    model.verify_all(store)
    store = stores.reopen(store)  # twice, after reads moved pages around
    model.verify_all(store)
    assert store.check() == []


def test_context_manager_commits(stores, tmp_path) -> None:
    model = Model(27)
    with pagedkv.open(tmp_path / "cm", GEOM, 4) as store:
        filled(store, model, "a", 9)
    with pytest.raises(StoreClosed):
        store.length("a")
    store = stores.open("cm", geom=None, pool_pages=None)
    model.verify_all(store)
    assert store.check() == []


def test_commit_is_the_restart_point(stores) -> None:
    """An in-process crash (no close) loses exactly the work since the last commit."""
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(28)
    for i in range(4):
        filled(store, model, i, 2 * PS + 1)
    store.commit()
    committed = {i: model.lens[i] for i in range(4)}
    # more work after the commit, with evictions and restores in between
    for i in range(4):
        store.append(i, *kv(99, i, 0, PS + 2))
    store.drop(0)
    store.create("new")
    store._abandon()
    store = stores.open(geom=None, pool_pages=None)
    assert sorted(store.sequences()) == [0, 1, 2, 3]
    for i in range(4):
        assert store.length(i) == committed[i]
    model.verify_all(store)
    assert store.check() == []


def test_lru_order_survives_reopen(stores) -> None:
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(29)
    for i in range(4):
        filled(store, model, i, PS)  # one page each: the pool is exactly full
    assert store.stats()["pool_free"] == 0 and store.stats()["evictions"] == 0
    for i in (2, 0, 3, 1, 0, 3):  # least recently used now: 2, then 1
        store.read(i)
    store = stores.reopen(store, evict_batch=1)
    filled(store, model, "new", 1)  # needs one slot: evicts exactly one page
    st = store.stats()
    assert st["evictions"] == 1 and st["spilled_pages"] == 1 and st["restores"] == 0
    for i in (0, 3, 1):
        store.read(i)
    assert store.stats()["restores"] == 0, "a recently used page was evicted first"
    store.read(2)
    assert store.stats()["restores"] == 1, "the least recently used page was not the one evicted"
    model.verify_all(store)
    assert store.check() == []


@pytest.mark.parametrize("change", [
    dict(layers=3), dict(kv_heads=1), dict(head_dim=8), dict(page_size=8), dict(dtype="float16"),
])
def test_reopen_with_other_geometry_raises(stores, change) -> None:
    store = stores.open(pool_pages=4)
    model = Model(30)
    filled(store, model, "a", 6)
    store.close()
    other = Geometry(**{**GEOM.to_dict(), **change})
    with pytest.raises(GeometryMismatch) as info:
        pagedkv.open(store.path, other, 4)
    assert next(iter(change)) in str(info.value)
    with pytest.raises(GeometryMismatch):
        pagedkv.open(store.path, other)
    store = stores.open(pool_pages=4)  # the lock was released; the store is intact
    model.verify_all(store)
    assert store.check() == []


@pytest.mark.parametrize("pages", [3, 5, 1000])
def test_reopen_with_other_pool_pages_raises(stores, pages: int) -> None:
    store = stores.open(pool_pages=4)
    model = Model(31)
    filled(store, model, "a", 6)
    store.close()
    size = os.path.getsize(os.path.join(store.path, "pool.bin"))
    with pytest.raises(GeometryMismatch):
        pagedkv.open(store.path, GEOM, pages)
    with pytest.raises(GeometryMismatch):
        pagedkv.open(store.path, None, pages)
    assert os.path.getsize(os.path.join(store.path, "pool.bin")) == size
    store = stores.open(geom=None, pool_pages=None)
    assert store.pool_pages == 4
    model.verify_all(store)
    assert store.check() == []


def snapshot_tree(path) -> dict:
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            data = None
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    data = f.read()
            out[os.path.relpath(full, path)] = (st.st_mode, st.st_mtime_ns, st.st_size, data)
    st = os.lstat(path)
    out["."] = (st.st_mode, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("layout", ["file", "subdir", "lmdb_like"])
def test_open_non_store_directory_refuses_untouched(tmp_path, layout: str) -> None:
    path = tmp_path / "other"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    if layout == "file":
        (path / "notes.txt").write_text("hello")
    elif layout == "subdir":
        (path / "spill").mkdir()
    else:
        env = lmdb.open(str(path / "db"), max_dbs=2)
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v")
        env.close()
    before = snapshot_tree(path)
    for kwargs in ({"geometry": GEOM, "pool_pages": 4}, {}, {"readonly": True},
                   {"geometry": GEOM, "pool_pages": 4, "durability": "volatile"}):
        with pytest.raises(PagedKVError):
            pagedkv.open(path, **kwargs)
        assert snapshot_tree(path) == before, kwargs


def test_open_directory_with_foreign_pool_bin_refuses_untouched(tmp_path) -> None:
    """A directory that merely contains a file named pool.bin is not a store: no LOCK, no chmod."""
    path = tmp_path / "other"
    path.mkdir()
    os.chmod(path, 0o755)
    (path / "pool.bin").write_bytes(os.urandom(8192))
    before = snapshot_tree(path)
    for kwargs in ({"geometry": GEOM, "pool_pages": 4}, {}):
        with pytest.raises(StoreCorrupt):
            pagedkv.open(path, **kwargs)
        assert snapshot_tree(path) == before, kwargs


def test_open_missing_without_geometry_creates_nothing(tmp_path) -> None:
    for kwargs in ({}, {"geometry": GEOM}, {"pool_pages": 4}):
        with pytest.raises(PagedKVError):
            pagedkv.open(tmp_path / "new", **kwargs)
    assert os.listdir(tmp_path) == []


def test_open_empty_directory_creates_store(stores, tmp_path) -> None:
    (tmp_path / "store").mkdir()
    store = stores.open()
    model = Model(32)
    filled(store, model, "a", 3)
    assert sorted(os.listdir(store.path)) == ["LOCK", "pool.bin", "spill"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "temporary directory left behind"
    model.verify_all(store)
    assert store.check() == []


def test_open_accepts_str_and_pathlike(stores, tmp_path) -> None:
    store = pagedkv.open(str(tmp_path / "s"), GEOM, 4)
    stores.opened.append(store)
    store.close()
    store = pagedkv.open(tmp_path / "s")
    stores.opened.append(store)
    assert store.geometry == GEOM and store.pool_pages == 4
    assert store.pool.shape == (4, *GEOM.page_shape) and store.pool.dtype == GEOM.np_dtype
    assert store.check() == []


# -- stats -----------------------------------------------------------------------------


def test_stats_required_keys_exist_and_move(stores) -> None:
    store = stores.open(pool_pages=4, evict_batch=1)
    st = store.stats()
    for key in REQUIRED_STATS:
        assert key in st, key
        assert isinstance(st[key], (int, float)), key
    assert st["pool_used"] == 0 and st["pool_free"] == 4 and st["spilled_pages"] == 0
    model = Model(33)
    for i in range(4):
        filled(store, model, i, 3 * PS)
    st = store.stats()
    assert st["evictions"] > 0 and st["bytes_spilled"] > 0 and st["spilled_pages"] > 0
    assert st["pool_used"] == 4 and st["pool_free"] == 0
    for i in range(4):
        model.verify(store, i)
    st2 = store.stats()
    assert st2["restores"] > 0 and st2["spill_hits"] > 0 and st2["bytes_restored"] > 0
    assert st2["restore_ms_p50"] > 0 and st2["restore_ms_p99"] >= st2["restore_ms_p50"] > 0
    assert st2["restore_ms_mean"] > 0
    assert st2["evictions"] > st["evictions"]
    model.verify(store, 3, 3 * PS - 1, 3 * PS)  # the page just restored: a resident hit
    assert store.stats()["resident_hits"] > st2["resident_hits"]
    assert store.stats()["misses"] == 0
    with store.step({0: 1}) as s:
        assert store.stats()["pool_pinned"] == 4
        engine_write(store, s, [model.next_kv(0, 1)])
    assert store.stats()["pool_pinned"] == 0
    final = store.stats()
    assert final["pool_used"] + final["pool_free"] + final["pool_pending"] == 4
    for key in REQUIRED_STATS:  # counters never go backwards
        if key not in ("pool_used", "pool_free", "pool_pinned", "spilled_pages") and \
                not key.startswith("restore_ms"):
            assert final[key] >= st[key], key
    assert store.check() == []


def test_stats_pool_accounting_adds_up(store) -> None:
    model = Model(34)
    for i in range(5):
        filled(store, model, i, 7)
    store.commit()
    store.drop(1)
    store.drop(3)
    st = store.stats()
    assert st["pool_used"] + st["pool_free"] + st["pool_pending"] == st["pool_pages"]
    store.commit()
    st = store.stats()
    assert st["pool_pending"] == 0
    assert st["pool_used"] + st["pool_free"] == st["pool_pages"]
    assert st["sequences"] == 3 and st["tokens"] == 21
    assert store.check() == []


# -- integrity (fail closed) --------------------------------------------------------


def _spill_env(path) -> tuple[lmdb.Environment, object]:
    env = lmdb.open(os.path.join(path, "spill"), max_dbs=4, subdir=True)
    return env, env.open_db(b"pages")


def test_corrupt_spilled_record_fails_closed(stores) -> None:
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(35)
    for i in range(6):
        filled(store, model, i, PS)
    assert store.stats()["spilled_pages"] == 2
    store.close()
    env, pages = _spill_env(store.path)
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=pages)))
        value = bytearray(value)
        value[-3] ^= 0x10  # one payload bit
        txn.put(key, bytes(value), db=pages)
    env.close()
    (bad_uid,) = struct.unpack(">Q", key)
    store = stores.open(geom=None, pool_pages=None)
    failed = []
    for i in range(6):
        try:
            model.verify(store, i)
        except PageCorrupt as exc:
            assert exc.uid == bad_uid
            failed.append(i)
    assert len(failed) == 1
    assert store.stats()["misses"] >= 1
    with pytest.raises(PageCorrupt):  # stays failed; never wrong bytes
        store.read(failed[0])
    problems = store.check()
    assert problems and any(str(bad_uid) in p for p in problems)
    store._abandon()


@pytest.mark.parametrize("field,value", [("v", 2), ("uid", 999), ("dtype", "float16"), ("fill", 3),
                                         ("fill", 9), ("codec", "lz4"), ("csum", 0), ("nbytes", 1),
                                         ("shape", [2, 2, 4, 2, 2])])
def test_spilled_record_header_field_wrong_fails_closed(stores, field, value) -> None:
    import msgpack

    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(36)
    for i in range(5):
        filled(store, model, i, PS)
    store.close()
    env, pages = _spill_env(store.path)
    with env.begin(write=True) as txn:
        key, raw = next(iter(txn.cursor(db=pages)))
        (hlen,) = struct.unpack_from("<I", raw)
        header = msgpack.unpackb(raw[4:4 + hlen])
        header[field] = value
        blob = msgpack.packb(header)
        txn.put(key, struct.pack("<I", len(blob)) + blob + raw[4 + hlen:], db=pages)
    env.close()
    store = stores.open(geom=None, pool_pages=None)
    errors = 0
    for i in range(5):
        try:
            model.verify(store, i)
        except PageCorrupt:
            errors += 1
    assert errors == 1
    assert store.check() != []
    store._abandon()


def test_corrupt_pool_slot_fails_closed_after_reopen(stores) -> None:
    store = stores.open(pool_pages=4)
    model = Model(37)
    for i in range(3):
        filled(store, model, i, PS)
    store.close()
    path = os.path.join(store.path, "pool.bin")
    flip_bit(path, 4096 + GEOM.page_nbytes + 17, 2)  # one bit somewhere in the first three slots
    store = stores.open(geom=None, pool_pages=None)
    outcomes = []
    for i in range(3):
        try:
            model.verify(store, i)
            outcomes.append("ok")
        except PageCorrupt:
            outcomes.append("corrupt")
    assert outcomes.count("corrupt") == 1
    assert store.stats()["misses"] == 1
    assert store.check() != []
    store._abandon()


# -- read-only handles, durability modes, crashes -----------------------------------------


def test_readonly_handle_reads_exact_and_writes_nothing(stores) -> None:
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(38)
    for i in range(5):
        filled(store, model, i, PS + 3)
    store.close()
    before = snapshot_tree(store.path)
    reader = pagedkv.open(store.path, readonly=True)
    try:
        model.verify_all(reader)  # spilled and resident pages alike
        k, v = kv(0, 0, 0, 1)
        for call in (lambda: reader.create("x"), lambda: reader.append(0, k, v),
                     lambda: reader.drop(0), lambda: reader.fork(0, "y"), lambda: reader.commit(),
                     lambda: reader.step({0: 1}).__enter__()):
            with pytest.raises(ReadOnlyStore):
                call()
        assert reader.check() == []
    finally:
        reader.close()
    after = snapshot_tree(store.path)
    changed = [name for name in before if before[name] != after.get(name)
               and not name.endswith("lock.mdb") and name != "spill"]
    assert changed == []


def test_durability_modes_nosync_persists_volatile_does_not(stores) -> None:
    model = Model(40)
    store = stores.open("ns", pool_pages=4, durability="nosync")
    filled(store, model, "a", 3 * PS + 1)
    store = stores.reopen(store, durability="nosync")
    model.verify_all(store)
    assert store.check() == []
    store.close()
    vol = stores.open("vol", pool_pages=4, durability="volatile")
    vol.create("a")
    vol.append("a", *kv(1, "a", 0, 4 * 4 * PS))  # spills
    assert vol.read("a")[0].tobytes() == kv(1, "a", 0, 4 * 4 * PS)[0].tobytes()
    assert vol.check() == []
    vol.close()
    vol = stores.open("vol", geom=None, pool_pages=None, durability="volatile")
    assert vol.sequences() == []
    assert vol.geometry == GEOM and vol.pool_pages == 4
    assert vol.check() == []


def test_crash_then_new_pages_keep_committed_pages(stores) -> None:
    """Records of pages spilled but never committed must not capture the uids of later pages.

    Commit, spill uncommitted pages, crash; after reopen, new pages must get fresh
    uids: deleting the orphan records must never delete a committed page's record.
    """
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(41)
    filled(store, model, "a", 0)
    store.commit()
    store.append("a", *kv(0, "lost", 0, 6 * PS))  # six pages, two spilled, none committed
    store._abandon()
    store = stores.open(geom=None, pool_pages=None, evict_batch=1)
    assert store.length("a") == 0
    store.append("a", *model.next_kv("a", 6 * PS))
    store.commit()
    model.verify_all(store)
    assert store.check() == []
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []
