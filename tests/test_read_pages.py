"""read_pages: whole pages in pool layout, the same bytes as read() without the K/V reshuffle."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import pagedkv
from pagedkv import PageCorrupt, PagedKVError, SequenceNotFound

from tests.kits.content import assert_same_bits
from tests.kits.files import flip_bit
from tests.kits.model import Model
from tests.kits.store import GEOM



PS = GEOM.page_size


def as_kv(pages: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, layers, 2, page_size, heads, dim) pages -> K and V of their first ``length`` tokens."""
    both = pages.transpose(1, 2, 0, 3, 4, 5).reshape(GEOM.layers, 2, -1, GEOM.kv_heads, GEOM.head_dim)
    return both[:, 0, :length], both[:, 1, :length]


def test_pages_hold_what_read_returns_through_spills(stores, seed) -> None:
    rng = random.Random(seed)
    store = stores.open(pool_pages=4)
    model = Model(seed)
    lengths = {}
    for seq in range(5):  # 5 sequences of up to 5 pages each through a 4-slot pool
        store.create(seq)
        model.create(seq)
        lengths[seq] = rng.randint(1, 5 * PS)
        store.append(seq, *model.next_kv(seq, lengths[seq]))
    for seq in rng.sample(range(5), 5):
        pages = store.read_pages(seq)
        npages = -(-lengths[seq] // PS)
        assert pages.shape == (npages, *GEOM.page_shape) and pages.dtype == GEOM.np_dtype
        k, v = as_kv(pages, lengths[seq])
        ek, ev = model.expected(seq)
        assert_same_bits(k, ek, f"K of {seq}")
        assert_same_bits(v, ev, f"V of {seq}")
        # past the last token: zeros, whatever the slot held before
        assert not pages[-1, :, :, lengths[seq] - (npages - 1) * PS:].any()
        first = rng.randrange(npages)
        assert_same_bits(store.read_pages(seq, first, npages), pages[first:], "a page range")
    assert store.stats()["restores"] > 0
    assert store.check() == []


def test_page_tail_is_zero_even_over_a_reused_slot(store) -> None:
    model = Model(3)
    store.create("old")
    model.create("old")
    store.append("old", *model.next_kv("old", PS))  # a full page of nonzero bytes
    store.drop("old")  # its slot is free again and keeps the bytes
    store.create("new")
    model.create("new")
    store.append("new", *model.next_kv("new", 1))
    pages = store.read_pages("new")
    assert pages.shape[0] == 1 and not pages[0, :, :, 1:].any()
    assert_same_bits(as_kv(pages, 1)[0], model.expected("new")[0])


def test_ranges_and_ids_are_checked(store) -> None:
    store.create("a")
    model = Model(4)
    model.create("a")
    store.append("a", *model.next_kv("a", 2 * PS + 1))  # 3 pages
    assert store.read_pages("a", 3).shape[0] == 0
    for start, stop in ((0, 4), (-1, 2), (2, 1), (True, 2), (0, 2.0)):
        with pytest.raises(PagedKVError):
            store.read_pages("a", start, stop)
    with pytest.raises(SequenceNotFound):
        store.read_pages("b")
    assert store.length("a") == 2 * PS + 1  # nothing changed


def test_readonly_handle_and_corrupt_slot(stores) -> None:
    store = stores.open(pool_pages=4)
    model = Model(5)
    for seq in range(3):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, PS))
    expected = {seq: store.read_pages(seq) for seq in range(3)}
    store.close()
    reader = pagedkv.open(store.path, readonly=True)
    for seq in range(3):
        assert_same_bits(reader.read_pages(seq), expected[seq], f"read-only pages of {seq}")
    reader.close()
    flip_bit(os.path.join(store.path, "pool.bin"), 4096 + GEOM.page_nbytes + 17, 2)  # in slot 1
    store = stores.open(geom=None, pool_pages=None)
    outcomes = []
    for seq in range(3):
        try:
            store.read_pages(seq)
            outcomes.append("ok")
        except PageCorrupt:
            outcomes.append("corrupt")
    assert outcomes.count("corrupt") == 1
    store._abandon()
