"""read(..., out=(k_out, v_out)): the caller's arrays filled with the bytes a fresh read returns.

Also the fast paths of a read: one page (resident or spilled, with its checks and
counters), runs of full pages in consecutive slots, and the spill store's read
transactions under map growth.
"""

from __future__ import annotations

import random
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import xxhash

import pagedkv
from pagedkv import Geometry, PageCorrupt, PagedKVError, PoolExhausted
from pagedkv.storage.codec import CODECS, bytes_checksum, page_checksum, record_layout
from pagedkv.storage.spill import SpillStore, uid_key

from tests.kits.content import assert_same_bits
from tests.kits.model import Model
from tests.kits.store import GEOM

PS = GEOM.page_size


def shape_of(n: int, geom: Geometry = GEOM) -> tuple[int, int, int, int]:
    return (geom.layers, n, geom.kv_heads, geom.head_dim)


def filled(store: pagedkv.KVStore, model: Model, lengths: dict[Any, int], chunk: int = 3) -> None:
    """Append ``lengths`` tokens to each sequence, a few at a time and in turn, so slots interleave."""
    for seq in lengths:
        store.create(seq)
        model.create(seq)
    left = dict(lengths)
    while any(left.values()):
        for seq, n in left.items():
            take = min(n, chunk)
            if take:
                store.append(seq, *model.next_kv(seq, take))
                left[seq] -= take


def out_views(n: int, kind: str, geom: Geometry = GEOM) -> tuple[np.ndarray, np.ndarray]:
    """A (k_out, v_out) pair of the given layout, filled with a pattern a missed write would leave."""
    shape = shape_of(n, geom)
    if kind == "contiguous":
        k, v = np.empty(shape, geom.np_dtype), np.empty(shape, geom.np_dtype)
    elif kind == "halves":  # both in one buffer, as a fresh read allocates them
        both = np.empty((2, *shape), geom.np_dtype)
        k, v = both[0], both[1]
    elif kind == "token_slice":  # a window of longer buffers
        k = np.empty(shape_of(n + 5, geom), geom.np_dtype)[:, 3:3 + n]
        v = np.empty(shape_of(n + 5, geom), geom.np_dtype)[:, 2:2 + n]
    elif kind == "token_major":  # (n, layers, heads, dim) storage seen as (layers, n, heads, dim)
        k = np.empty((n, geom.layers, geom.kv_heads, geom.head_dim), geom.np_dtype).swapaxes(0, 1)
        v = np.empty((n, geom.layers, geom.kv_heads, geom.head_dim), geom.np_dtype).swapaxes(0, 1)
    elif kind == "interleaved":  # K and V of a token side by side: views that interleave, not overlap
        both = np.empty((geom.layers, n, 2, geom.kv_heads, geom.head_dim), geom.np_dtype)
        k, v = both[:, :, 0], both[:, :, 1]
    else:
        raise AssertionError(kind)
    k.view(np.uint8).fill(0xA5)
    v.view(np.uint8).fill(0x5A)
    assert k.shape == v.shape == shape
    return k, v


LAYOUTS = ["contiguous", "halves", "token_slice", "token_major", "interleaved"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_out_holds_what_read_returns_over_random_ranges(stores, seed, kind: str) -> None:
    rng = random.Random(seed)
    store = stores.open(pool_pages=6)  # smaller than the data: reads restore and evict
    model = Model(seed)
    lengths = {seq: rng.randint(2 * PS + 1, 6 * PS) for seq in range(4)}  # at least 12 pages
    filled(store, model, lengths)
    ranges = []
    for _ in range(40):
        seq = rng.randrange(4)
        start = rng.randint(0, lengths[seq])
        ranges.append((seq, start, rng.randint(start, min(lengths[seq], start + 3 * PS))))
    ranges += [(seq, 0, lengths[seq]) for seq in range(4)]  # whole sequences: some pages are spilled
    for seq, start, stop in ranges:
        k_out, v_out = out_views(stop - start, kind)
        got = store.read(seq, start, stop, out=(k_out, v_out))
        assert got[0] is k_out and got[1] is v_out
        fresh_k, fresh_v = store.read(seq, start, stop)
        want_k, want_v = model.expected(seq, start, stop)
        assert_same_bits(k_out, want_k, f"K out of {seq}[{start}:{stop}]")
        assert_same_bits(v_out, want_v, f"V out of {seq}[{start}:{stop}]")
        assert_same_bits(fresh_k, want_k, f"K of {seq}[{start}:{stop}]")
        assert_same_bits(fresh_v, want_v, f"V of {seq}[{start}:{stop}]")
    assert store.stats()["restores"] > 0
    assert store.check() == []


@pytest.mark.parametrize("lo, hi", [(0, 1), (1, 3), (PS - 1, PS), (PS, 2 * PS), (PS + 1, PS + 2), (3, 3), (0, 0)])
def test_one_page_ranges_resident_and_spilled(stores, seed, lo: int, hi: int) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": 3 * PS, "b": 5 * PS}, chunk=PS)  # "a"'s first pages are spilled by now
    spilled_at_start = store._mgr.slot[store._seqs.find("a").pids[lo // PS]] < 0
    for _ in range(2):  # spilled (if it was), then resident
        k_out, v_out = out_views(hi - lo, "contiguous")
        store.read("a", lo, hi, out=(k_out, v_out))
        want_k, want_v = model.expected("a", lo, hi)
        assert_same_bits(k_out, want_k, f"K of a[{lo}:{hi}]")
        assert_same_bits(v_out, want_v, f"V of a[{lo}:{hi}]")
        k, v = store.read("a", lo, hi)
        assert_same_bits(k, want_k, f"K of a[{lo}:{hi}]")
        assert_same_bits(v, want_v, f"V of a[{lo}:{hi}]")
    assert spilled_at_start or lo == hi  # the case is what it says: the first read restored
    assert store.check() == []


def test_one_page_read_counts_like_a_chunk(stores, seed) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": 2 * PS, "b": 4 * PS}, chunk=PS)
    mgr = store._mgr
    assert mgr.slot[store._seqs.find("a").pids[0]] < 0
    before = store.stats()
    store.read("a", 0, 1)  # spilled: one restore
    store.read("a", 1, 2)  # resident now: one hit
    after = store.stats()
    assert after["restores"] - before["restores"] == 1
    assert after["spill_hits"] - before["spill_hits"] == 1
    assert after["resident_hits"] - before["resident_hits"] == 1
    assert after["bytes_restored"] - before["bytes_restored"] > GEOM.page_nbytes
    assert after["misses"] == before["misses"]
    assert after["tokens_read"] - before["tokens_read"] == 2
    slot = int(mgr.slot[store._seqs.find("a").pids[0]])
    assert mgr.stamp[slot] == mgr.stamp.max()  # the page read last is the most recently used


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_out_for_each_dtype(stores, seed, dtype: str) -> None:
    geom = Geometry(layers=3, kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    store = stores.open(geom=geom, pool_pages=5)
    model = Model(seed, geom)
    filled(store, model, {0: 9, 1: 13, 2: 7})
    for seq, n in ((0, 9), (1, 13), (2, 7)):
        for start, stop in ((0, n), (1, n - 1), (n - 1, n)):
            k_out, v_out = out_views(stop - start, "halves", geom)
            store.read(seq, start, stop, out=(k_out, v_out))
            fresh = store.read(seq, start, stop)
            want_k, want_v = model.expected(seq, start, stop)
            for got, want in ((k_out, want_k), (v_out, want_v), (fresh[0], want_k), (fresh[1], want_v)):
                assert got.dtype == geom.np_dtype
                assert_same_bits(got, want, f"{dtype} {seq}[{start}:{stop}]")


def test_pages_in_consecutive_and_scattered_slots(stores, seed) -> None:
    store = stores.open(pool_pages=24)
    model = Model(seed)
    store.create("run")
    model.create("run")
    store.append("run", *model.next_kv("run", 8 * PS + 2))  # one append: consecutive slots
    filled(store, model, {"x": 4 * PS, "y": 4 * PS}, chunk=PS)  # page by page in turn: every other slot
    mgr = store._mgr
    run_slots = mgr.slot[store._seqs.find("run").pids[:8]]
    x_slots = mgr.slot[store._seqs.find("x").pids[:4]]
    assert (np.diff(run_slots) == 1).all() and not (np.diff(x_slots) == 1).any()
    for seq, n in (("run", 8 * PS + 2), ("run", 8 * PS), ("x", 4 * PS)):
        for start, stop in ((0, n), (1, n), (PS, n - 1), (PS, 3 * PS), (PS - 1, 3 * PS + 1)):
            want_k, want_v = model.expected(seq, start, stop)
            fresh_k, fresh_v = store.read(seq, start, stop)
            assert_same_bits(fresh_k, want_k, f"K of {seq}[{start}:{stop}]")
            assert_same_bits(fresh_v, want_v, f"V of {seq}[{start}:{stop}]")
            for kind in ("contiguous", "token_major"):
                k_out, v_out = out_views(stop - start, kind)
                store.read(seq, start, stop, out=(k_out, v_out))
                assert_same_bits(k_out, want_k, f"K of {seq}[{start}:{stop}] into {kind}")
                assert_same_bits(v_out, want_v, f"V of {seq}[{start}:{stop}] into {kind}")


def test_a_range_longer_than_the_pool_streams_into_out(stores, seed) -> None:
    store = stores.open(pool_pages=3)
    model = Model(seed)
    filled(store, model, {"long": 7 * PS + 1}, chunk=PS)
    k_out, v_out = out_views(7 * PS, "token_slice")
    store.read("long", 1, 7 * PS + 1, out=(k_out, v_out))
    want_k, want_v = model.expected("long", 1, 7 * PS + 1)
    assert_same_bits(k_out, want_k, "K")
    assert_same_bits(v_out, want_v, "V")


def test_out_on_a_read_only_handle(stores, seed) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": 3 * PS + 1, "b": 4 * PS})
    store.close()
    reader = stores.open(geom=None, pool_pages=None, readonly=True)
    for start, stop in ((0, 3 * PS + 1), (2, 3), (PS + 1, 2 * PS + 3)):
        k_out, v_out = out_views(stop - start, "interleaved")
        reader.read("a", start, stop, out=(k_out, v_out))
        want_k, want_v = model.expected("a", start, stop)
        assert_same_bits(k_out, want_k, f"K of a[{start}:{stop}]")
        assert_same_bits(v_out, want_v, f"V of a[{start}:{stop}]")


def test_a_fresh_pair_is_two_independent_arrays(stores, seed) -> None:
    store = stores.open()
    model = Model(seed)
    filled(store, model, {"a": 2 * PS + 3})
    k, v = store.read("a")
    assert k.shape == v.shape == shape_of(2 * PS + 3)
    assert k.flags.c_contiguous and v.flags.c_contiguous and k.flags.writeable and v.flags.writeable
    assert not np.shares_memory(k, v)
    want_v = model.expected("a")[1]
    k[...] = 0
    assert_same_bits(v, want_v, "V after K was overwritten")
    model.verify(store, "a")  # the store's copy is untouched
    assert not np.shares_memory(v, store.pool)


BAD_OUTS = {
    "one array": lambda n: np.empty(shape_of(n), GEOM.np_dtype),
    "three arrays": lambda n: tuple(np.empty(shape_of(n), GEOM.np_dtype) for _ in range(3)),
    "lists": lambda n: (np.empty(shape_of(n)).tolist(), np.empty(shape_of(n)).tolist()),
    "wrong dtype": lambda n: (np.empty(shape_of(n), np.float16), np.empty(shape_of(n), np.float16)),
    "one token short": lambda n: (np.empty(shape_of(n - 1), GEOM.np_dtype), np.empty(shape_of(n), GEOM.np_dtype)),
    "layers swapped with tokens": lambda n: (np.empty((n, GEOM.layers, 2, 4), GEOM.np_dtype),) * 2,
    "read-only": lambda n: tuple(np.broadcast_to(np.zeros(1, GEOM.np_dtype), shape_of(n)) for _ in range(2)),
    "the same array twice": lambda n: (lambda a: (a, a))(np.empty(shape_of(n), GEOM.np_dtype)),
    "overlapping views": lambda n: (lambda a: (a[:, :n], a[:, 1:n + 1]))(np.empty(shape_of(n + 1), GEOM.np_dtype)),
}


@pytest.mark.parametrize("case", sorted(BAD_OUTS))
def test_a_bad_out_is_refused_typed_and_changes_nothing(stores, seed, case: str) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": 3 * PS, "b": 3 * PS})
    before = store.stats()
    with pytest.raises(PagedKVError):
        store.read("a", 1, 2 * PS, out=BAD_OUTS[case](2 * PS - 1))
    after = store.stats()
    assert {key: after[key] for key in ("restores", "resident_hits", "spill_hits", "tokens_read")} == \
           {key: before[key] for key in ("restores", "resident_hits", "spill_hits", "tokens_read")}
    model.verify_all(store)  # still usable, nothing poisoned
    store.commit()


def test_out_inside_the_pool_is_refused(stores, seed) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": 2})
    pool = store.pool
    views = (pool[3, :, 0, :2], pool[3, :, 1, :2])  # a slot's K and V rows: the right shape and dtype
    with pytest.raises(PagedKVError, match="pool"):
        store.read("a", out=views)
    model.verify(store, "a")


def test_out_wrong_shape_names_the_expected_one(store) -> None:
    model = Model(1)
    filled(store, model, {"a": 5})
    with pytest.raises(PagedKVError, match=r"\(2, 5, 2, 4\)"):
        store.read("a", out=(np.empty(shape_of(4), GEOM.np_dtype), np.empty(shape_of(4), GEOM.np_dtype)))


def test_one_page_read_of_a_damaged_record_is_page_corrupt_for_that_page_alone(stores, seed, caplog) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": 2 * PS, "b": 4 * PS}, chunk=PS)
    mgr, spill = store._mgr, store._spill
    pid = int(store._seqs.find("a").pids[0])
    assert mgr.slot[pid] < 0
    key = uid_key(int(mgr.uid[pid]))
    with spill.begin_read() as txn:
        record = bytearray(txn.get(key, db=spill.pages))
    record[-1] ^= 0x10  # inside the last token's bytes: the page is full
    spill.write(lambda txn: txn.put(key, bytes(record), db=spill.pages), "test damage")
    misses = store.stats()["misses"]
    caplog.set_level("WARNING", logger="pagedkv")
    placed = []
    for _ in range(2):
        with pytest.raises(PageCorrupt) as err:
            store.read("a", 0, 1, out=out_views(1, "contiguous"))
        assert err.value.uid == int(mgr.uid[pid]) and mgr.slot[pid] < 0
        assert mgr.free_slots and (mgr.slot_pid[mgr.free_slots] < 0).all()  # the slot taken went back
        placed.append(int(np.count_nonzero(mgr.slot_pid >= 0)))
    assert placed[0] == placed[1]  # a known-corrupt page takes no slot
    assert store.stats()["misses"] == misses + 2
    assert len([r for r in caplog.records if "fails its checksum" in r.getMessage()]) == 1  # said once
    model.verify(store, "a", PS, 2 * PS)  # the other page still reads
    model.verify(store, "b")


def test_one_page_read_rechecks_committed_bytes_once_the_pool_is_out(stores, seed) -> None:
    store = stores.open(pool_pages=8)
    model = Model(seed)
    filled(store, model, {"a": 2 * PS})
    store.commit()
    slot = int(store._mgr.slot[store._seqs.find("a").pids[1]])
    store.pool[slot].view(np.uint32)[0, 0, 1] ^= 1  # a committed token of page 1, written outside any step
    with pytest.raises(PageCorrupt):
        store.read("a", PS + 1, PS + 2)
    model.verify(store, "a", 0, PS)


def test_one_page_read_when_every_slot_is_pinned(stores, seed) -> None:
    store = stores.open(pool_pages=4)
    model = Model(seed)
    filled(store, model, {"a": PS, "b": 2 * PS, "c": 2 * PS}, chunk=PS)
    assert store._mgr.slot[store._seqs.find("a").pids[0]] < 0
    with store.step({"b": 0, "c": 0}):  # pins b's and c's pages: every slot
        assert store._mgr.available() == 0
        for seq, lo in (("a", 0), ("b", 1), ("c", PS)):  # spilled, or resident and pinned
            with pytest.raises(PoolExhausted):
                store.read(seq, lo, lo + 1)
    model.verify_all(store)


def test_record_headers_match_msgpack_for_every_fill_and_width() -> None:
    geom = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=300, dtype="float16")  # fills past 255
    layout = record_layout(geom)
    widths = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]
    for uid in widths:
        for csum in widths:
            for fill in (0, 1, 127, 128, 255, 256, 299, 300):
                for codec, nbytes in [("raw", geom.page_nbytes)] + [(name, 77) for name in CODECS]:
                    header = msgpack.packb({"v": 1, "uid": uid, "dtype": geom.dtype, "shape": list(geom.page_shape),
                                            "fill": fill, "codec": codec, "csum": csum, "nbytes": nbytes})
                    assert layout.prefix(uid, fill, codec, csum, nbytes) == len(header).to_bytes(4, "little") + header
                record = layout.prefix(uid, fill, "raw", csum, geom.page_nbytes) + bytes(geom.page_nbytes)
                assert layout.match_raw(memoryview(record), uid, fill, csum) is not None
                assert layout.match_raw(memoryview(record), uid, fill, csum ^ 1) is None
    assert record_layout(geom) is layout and record_layout(Geometry(2, 2, 4, 300, "float16")) is layout


def test_small_page_checksum_is_the_streamed_digest() -> None:
    geom = Geometry(layers=1, kv_heads=1, head_dim=15, page_size=3, dtype="bfloat16")  # 180 bytes
    page = np.arange(np.prod(geom.page_shape), dtype=np.float32).astype(geom.np_dtype).reshape(geom.page_shape)
    for fill in range(geom.page_size + 1):
        hasher = xxhash.xxh3_64(seed=99)
        hasher.update(struct.pack("<QI", 7, fill))  # uid, fill: the checksum's definition
        hasher.update(np.ascontiguousarray(page[:, :, :fill]).view(np.uint8).tobytes())
        assert page_checksum(page, fill, 7, 99) == hasher.intdigest()
        assert page_checksum(page.swapaxes(0, 1).copy().swapaxes(0, 1), fill, 7, 99) == hasher.intdigest()


@pytest.mark.parametrize("page_size", [1, 3, 300])  # one-shot and streamed digests
def test_bytes_checksum_of_a_full_page_is_its_page_checksum(page_size: int) -> None:
    geom = Geometry(layers=2, kv_heads=1, head_dim=15, page_size=page_size, dtype="bfloat16")
    page = np.arange(np.prod(geom.page_shape), dtype=np.float32).astype(geom.np_dtype).reshape(geom.page_shape)
    flat = memoryview(page.reshape(-1).view(np.uint8))
    assert bytes_checksum(flat, page_size, 7, 99) == page_checksum(page, page_size, 7, 99)
    assert bytes_checksum(page.tobytes(), page_size, 8, 99) != page_checksum(page, page_size, 7, 99)


def test_a_locked_read_is_counted_once_writes_are_shared(tmp_path: Path) -> None:
    spill = SpillStore(str(tmp_path / "spill"), readonly=False, create=True, sync=False, map_size=1 << 20)
    try:
        with spill.locked_read() as txn:  # every writer holds the caller's lock: nothing to count
            assert txn.get(b"missing", db=spill.pages) is None and spill._reading == 0
        spill.share_writes()
        with spill.locked_read() as txn:
            assert txn.get(b"missing", db=spill.pages) is None and spill._reading == 1
        assert spill._reading == 0
    finally:
        spill.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_store_shares_its_writes_iff_a_write_behind_thread_writes(tmp_path: Path, write_behind: bool) -> None:
    with pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=8, write_behind=write_behind) as store:
        with store._spill.locked_read():
            assert store._spill._reading == int(write_behind)


@pytest.mark.parametrize("shared_locked_read", [False, True])
def test_map_growth_waits_for_an_open_read_transaction(tmp_path: Path, shared_locked_read: bool) -> None:
    spill = SpillStore(str(tmp_path / "spill"), readonly=False, create=True, sync=False, map_size=1 << 20)
    if shared_locked_read:  # the foreground's read beside a write-behind thread that grows the map
        spill.share_writes()
    try:
        size = spill.env.info()["map_size"]
        inside, leave, grown = threading.Event(), threading.Event(), threading.Event()

        def reader() -> None:
            with (spill.locked_read() if shared_locked_read else spill.background_read()) as txn:
                assert txn.get(b"missing", db=spill.pages) is None
                inside.set()
                assert leave.wait(30)

        def writer() -> None:  # a value larger than the map: the write grows it first
            spill.write(lambda txn: txn.put(uid_key(1), bytes(2 << 20), db=spill.pages), "big")
            grown.set()

        threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
        threads[0].start()
        assert inside.wait(30)
        threads[1].start()
        deadline = time.monotonic() + 30
        while spill._readers.waiting == 0:  # the writer is waiting for the reader to leave
            assert time.monotonic() < deadline, "map growth never waited"
            time.sleep(0.001)
        assert not grown.is_set() and spill.env.info()["map_size"] == size
        leave.set()
        for thread in threads:
            thread.join(30)
        assert grown.is_set() and spill.env.info()["map_size"] > size
        assert spill._reading == 0 and spill._readers.waiting == 0
        with spill.begin_read() as txn:
            assert len(txn.get(uid_key(1), db=spill.pages)) == 2 << 20
    finally:
        spill.close()
