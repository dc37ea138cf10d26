"""RowIndex, the prefix index's table: the same answers as a dict, with colliding homes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv.pages.rowindex import RowIndex


_HOMES = [random.Random(home).getrandbits(64) for home in range(4096)]


def digest(rng: random.Random, homes: int) -> bytes:
    """16 random bytes whose first 8 (the home) come from ``homes`` values, so probe paths collide."""
    return _HOMES[rng.randrange(homes)].to_bytes(8, "little") + rng.randbytes(8)


@pytest.mark.slow
def test_matches_a_multimap_through_adds_discards_and_rebuilds(seed) -> None:
    """Several rows may share a digest (a prompt prefilled twice); each is held and found."""
    rng = random.Random(seed)
    rows = 6000
    hashes = np.zeros(rows, "V16")
    index, model = RowIndex(), {}  # model: row -> digest
    free = list(range(rows))
    rng.shuffle(free)
    pool: list[bytes] = []  # digests seen, so adds of a held digest happen

    def rows_of(d: bytes) -> list[int]:
        return sorted(row for row, held in model.items() if held == d)

    for op in range(20_000):
        choice = rng.random()
        if choice < 0.5 and free:
            row = free.pop()
            d = rng.choice(pool) if pool and rng.random() < 0.2 else digest(rng, 1500)
            pool.append(d)
            hashes[row] = np.frombuffer(d, "V16")[0]
            assert index.add(d, row, hashes), op
            assert not index.add(d, row, hashes), op  # a row is held once
            model[row] = d
        elif choice < 0.8 and model:
            row = rng.choice(list(model))
            d = model.pop(row)
            assert index.holds(d, row)
            index.discard(d, row)
            assert not index.holds(d, row)
            free.append(row)
        elif choice < 0.82:  # a reopen: everything held laid out afresh in one go
            fresh = RowIndex()
            fresh.add_many(np.array(sorted(model)), hashes)
            index = fresh
        else:
            d = rng.choice(pool) if pool else digest(rng, 1500)
            assert sorted(index.get(d, hashes)) == rows_of(d), op
        assert len(index) == len(model)
    assert sorted(index.rows().tolist()) == sorted(model)
    for row, d in model.items():
        assert row in index.get(d, hashes) and index.holds(d, row)
    # 70% full at most, so a miss always ends at an empty slot soon
    assert 10 * index.used <= 7 * len(index.slots)


def test_add_many_holds_every_row_of_equal_digests_once(seed) -> None:
    rng = random.Random(seed)
    hashes = np.zeros(3000, "V16")
    digests = [digest(rng, 7) for _ in range(1000)]
    by_digest: dict[bytes, list[int]] = {}
    for row in range(3000):
        d = digests[rng.randrange(len(digests))]
        hashes[row] = np.frombuffer(d, "V16")[0]
        by_digest.setdefault(d, []).append(row)
    index = RowIndex()
    index.add_many(np.arange(3000), hashes)
    index.add_many(np.arange(0, 3000, 7), hashes)  # rows held already are not held twice
    assert len(index) == 3000
    for d, rows in by_digest.items():
        assert sorted(index.get(d, hashes)) == rows
    assert index.get(b"\xff" * 16, hashes) == []
