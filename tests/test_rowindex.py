"""RowIndex, the prefix index's table: the same answers as a dict, with colliding homes."""

from __future__ import annotations

import random

import numpy as np

from pagedkv.rowindex import RowIndex


_HOMES = [random.Random(home).getrandbits(64) for home in range(4096)]


def digest(rng: random.Random, homes: int) -> bytes:
    """16 random bytes whose first 8 (the home) come from ``homes`` values, so probe paths collide."""
    return _HOMES[rng.randrange(homes)].to_bytes(8, "little") + rng.randbytes(8)


def test_matches_a_dict_through_adds_discards_and_rebuilds(seed) -> None:
    rng = random.Random(seed)
    rows = 6000
    hashes = np.zeros(rows, "V16")
    index, model = RowIndex(), {}  # model: digest -> row
    free = list(range(rows))
    rng.shuffle(free)
    pool: list[bytes] = []  # digests seen, so adds of a held digest happen
    for op in range(20_000):
        choice = rng.random()
        if choice < 0.5 and free:
            row = free.pop()
            d = rng.choice(pool) if pool and rng.random() < 0.2 else digest(rng, 1500)
            pool.append(d)
            hashes[row] = np.frombuffer(d, "V16")[0]
            added = index.add(d, row, hashes)
            assert added == (d not in model), op
            if added:
                model[d] = row
            else:
                free.append(row)
        elif choice < 0.8 and model:
            d = rng.choice(list(model))
            row = model.pop(d)
            assert index.holds(d, row)
            index.discard(d, row)
            assert not index.holds(d, row)
            free.append(row)
        elif choice < 0.82:  # a reopen: everything held laid out afresh in one go
            held = sorted(model.values())
            fresh = RowIndex()
            fresh.add_many(np.array(held), hashes)
            index = fresh
        else:
            d = rng.choice(pool) if pool else digest(rng, 1500)
            assert index.get(d, hashes) == model.get(d), op
        assert len(index) == len(model)
    assert sorted(index.rows().tolist()) == sorted(model.values())
    for d, row in model.items():
        assert index.get(d, hashes) == row and index.holds(d, row)
    # 70% full at most, so a miss always ends at an empty slot soon
    assert 10 * index.used <= 7 * len(index.slots)


def test_add_many_keeps_the_first_of_equal_digests(seed) -> None:
    rng = random.Random(seed)
    hashes = np.zeros(3000, "V16")
    digests = [digest(rng, 7) for _ in range(1000)]
    order = []
    for row in range(3000):
        d = digests[rng.randrange(len(digests))]
        hashes[row] = np.frombuffer(d, "V16")[0]
        order.append((row, d))
    index = RowIndex()
    index.add_many(np.arange(3000), hashes)
    first: dict[bytes, int] = {}
    for row, d in order:
        first.setdefault(d, row)
    assert len(index) == len(first)
    for d, row in first.items():
        assert index.get(d, hashes) == row
    assert index.get(b"\xff" * 16, hashes) is None
