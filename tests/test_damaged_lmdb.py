"""A damaged data.mdb that open accepts must not kill the caller at its first commit.

LMDB's write path trusts the free list and the tree structure far more than its
read path does: with two pages of data.mdb swapped, or a free list naming a
page that is still in use, reads give ``PageCorrupt`` and the next commit used
to die inside LMDB (``mdb_page_touch``/``mdb_freelist_save`` assertions,
SIGABRT). Every case here runs in a forked child with a timeout and must end in
one of two ways: open raises ``StoreCorrupt`` (without writing a byte), or open,
reads, commits, appends, close and a second open all succeed, with every byte
read equal to what was written or ``PageCorrupt``. Never a signal, a hang or an
untyped exception.

Seeds are printed; replay one with ``PAGEDKV_SEED=<n>``. Soak sizes (every pair
of pages, thousands of flips): ``PAGEDKV_SOAK=1 pytest -m soak tests/test_damaged_lmdb.py``.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import shutil
import struct
from pathlib import Path
from typing import Callable

import lmdb
import numpy as np
import pytest

import pagedkv
from pagedkv import Geometry, PageCorrupt, PagedKVError, StoreCorrupt
from pagedkv.storage.lmdbcheck import probe_in_child, walk_pages
from pagedkv.storage.spill import DB_NAMES

from tests.kits.child import Channel, Child, describe, in_children
from tests.kits.content import get_seed
from tests.kits.faults import Tally, scales
from tests.kits.files import DATA_MDB, SPILL, copy_store, poke, store_bytes
from tests.kits.lmdbfile import PSIZE, FreeRecord, Layout, free_records
from tests.kits.model import Model




# A KV page is 2 x 2 x 2 x 16 x 16 x 2 bytes = 4 KiB, so every spilled record is an
# overflow record of two LMDB pages; 8 pool slots make appends spill at once.
GEOM_WP = Geometry(layers=2, kv_heads=2, head_dim=16, page_size=16, dtype="float16")
POOL_PAGES = 8
GOOD = ("refused", "clean")  # outcome prefixes a case may end in


# -- a store with a free list ---------------------------------------------------------------


def build_store(path: Path, seed: int) -> Model:
    """A closed store whose spill file has several free-list records: sequences that spill,
    drops and appends over several commits."""
    rng = random.Random(seed)
    model = Model(seed, GEOM_WP)
    store = pagedkv.open(path, GEOM_WP, pool_pages=POOL_PAGES)
    live: list[str] = []
    for number in range(9):
        seq = f"s{number}"
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, rng.randrange(20, 90)))
        live.append(seq)
        store.commit()
    for _ in range(2):
        for seq in rng.sample(live, 2):
            store.drop(seq)
            model.drop(seq)
            live.remove(seq)
        store.commit()
        for seq in rng.sample(live, 2):
            store.append(seq, *model.next_kv(seq, rng.randrange(5, 40)))
            store.commit()
    store.close()
    return model


@pytest.fixture
def wp_store(fast_tmp: Path) -> tuple[Path, Model, Layout, int]:
    """A closed store with a free list (see ``build_store``): its path, model, layout and seed."""
    seed = get_seed("write path")
    path = fast_tmp / "base"
    model = build_store(path, seed)
    layout = Layout((path / DATA_MDB).read_bytes())
    assert len(layout.free) >= 2 and sum(len(r.ids) for r in layout.free) >= 4, layout.free
    return path, model, layout, seed


# -- what a child does with a damaged copy ---------------------------------------------------


def _read_all(store: pagedkv.KVStore, model: Model, ones: dict[str, int]) -> tuple[str, list[str]]:
    """Read every sequence: each must be exactly what was written, or PageCorrupt.

    ``ones`` counts the tokens of ones ``exercise`` appended after a sequence's
    model content (a sequence of the store only, like "fresh", has no model content).
    """
    names = sorted(set(model.lens) | set(ones))
    if sorted(store.sequences()) != names:
        return f"WRONG sequences {sorted(store.sequences())}", []
    corrupt, intact = [], []
    for seq in names:
        base = model.lens.get(seq, 0)
        if store.length(seq) != base + ones.get(seq, 0):
            return f"WRONG length of {seq}: {store.length(seq)}", []
        try:
            k, v = store.read(seq)
        except PageCorrupt:
            corrupt.append(seq)
            continue
        if base:
            ek, ev = model.expected(seq)
            if k[:, :base].tobytes() != ek.tobytes() or v[:, :base].tobytes() != ev.tobytes():
                return f"WRONG bytes in {seq}", []
        if not (k[:, base:] == 1).all() or not (v[:, base:] == 1).all():
            return f"WRONG appended bytes in {seq}", []
        intact.append(seq)
    return ("clean, PageCorrupt on reads" if corrupt else "clean"), intact


def exercise(path: str, model: Model) -> str:
    """Open a damaged copy as the writer and use it; one line saying how it went."""
    before = store_bytes(path)
    stage = "open"
    try:
        try:
            store = pagedkv.open(path)
        except StoreCorrupt:
            return "refused" if store_bytes(path) == before else "FAILED: the refused open wrote"
        ones: dict[str, int] = {}
        try:
            stage = "reads"
            outcome, intact = _read_all(store, model, ones)
            if outcome.startswith("WRONG"):
                return outcome
            stage = "commit"
            store.commit()
            stage = "append"
            # A fresh sequence and a grown intact one: new records, evictions and the
            # free pages LMDB hands out for them, then a commit.
            k = np.ones((GEOM_WP.layers, 40, GEOM_WP.kv_heads, GEOM_WP.head_dim), GEOM_WP.np_dtype)
            store.create("fresh")
            store.append("fresh", k, k)
            ones["fresh"] = 40
            for seq in intact[:1]:
                store.append(seq, k[:, :5], k[:, :5])
                ones[seq] = 5
            stage = "commit after append"
            store.commit()
        except BaseException:
            try:  # the failure is the finding; the handle only needs to go
                store.close()
            except BaseException:  # noqa: BLE001
                pass
            raise
        stage = "close"
        store.close()
        stage = "reopen"
        again = pagedkv.open(path)
        try:
            stage = "reads after reopen"
            second, _ = _read_all(again, model, ones)
            if second.startswith("WRONG"):
                return f"{second} after reopen"
        finally:
            again.close()
        return outcome
    except PagedKVError as exc:
        return f"FAILED at {stage}: {describe(exc)}"
    except BaseException as exc:  # noqa: BLE001 - the finding, reported to the parent
        return f"UNTYPED at {stage}: {describe(exc)}"


Damage = Callable[[Path], None]  # edits a data.mdb in place


def run_cases(base: Path, model: Model, work: Path, cases: list[tuple[str, Damage]],
              timeout: float = 10.0) -> Tally:
    """Apply each damage to its own copy of ``base`` and exercise it in forked children."""

    def one(item: tuple[int, Damage]) -> str:
        number, damage = item
        copy = work / f"case{number}"
        shutil.rmtree(copy, ignore_errors=True)  # left behind by a child that died on it
        copy_store(base, copy)
        try:
            damage(copy / DATA_MDB)
            return exercise(str(copy), model)
        finally:
            shutil.rmtree(copy, ignore_errors=True)

    items = [(number, damage) for number, (_, damage) in enumerate(cases)]
    tally = Tally()
    for (name, _), result in zip(cases, in_children(one, items, timeout=timeout)):
        tally.add_result(result, name, timeout)
    return tally


def bad_outcomes(tally: Tally) -> dict[str, int]:
    """The outcomes a case must never end in, with their counts."""
    return {name: count for name, count in tally.counts.items() if not name.startswith(GOOD)}


# -- damages ------------------------------------------------------------------------------------


def swap(data: bytes, a: int, b: int) -> Damage:
    """Swap pages ``a`` and ``b`` (of the file whose bytes are ``data``)."""
    def damage(path: Path) -> None:
        poke(path, a * PSIZE, data[b * PSIZE:(b + 1) * PSIZE])
        poke(path, b * PSIZE, data[a * PSIZE:(a + 1) * PSIZE])
    return damage


def rewrite_ids(record: FreeRecord, ids: list[int], count: int | None = None) -> Damage:
    """Write ``ids`` as a record's ID list in place (same length), with ``count`` as its count."""
    assert len(ids) == len(record.ids)

    def damage(path: Path) -> None:
        head = len(ids) if count is None else count
        poke(path, record.offset, struct.pack(f"<{len(ids) + 1}Q", head, *ids))
    return damage


def rewrite_key(record: FreeRecord, key: int) -> Damage:
    """Give a free-list record another txn id as its key."""
    def damage(path: Path) -> None:
        poke(path, record.node + 8, struct.pack("<Q", key))
    return damage


def free_list_cases(layout: Layout) -> list[tuple[str, Damage]]:
    """Free-list records that LMDB's next write transaction would act on, each damaged one way."""
    records = [r for r in layout.free if r.ids]
    many = next(r for r in records if len(r.ids) >= 2)
    first, other = records[0], records[1]
    cases: list[tuple[str, Damage]] = [
        ("page 0 listed free", rewrite_ids(many, many.ids[:-1] + [0])),
        ("meta page 1 listed free", rewrite_ids(many, many.ids[:-1] + [1])),
        ("page past last_pgno listed free", rewrite_ids(many, [layout.last_pgno + 1] + many.ids[1:])),
        ("page far past the file listed free", rewrite_ids(many, [1 << 40] + many.ids[1:])),
        ("page listed twice in one record", rewrite_ids(many, [many.ids[0]] + many.ids[:-1])),
        ("record sorted ascending", rewrite_ids(many, sorted(many.ids))),
        ("count one larger than the record", rewrite_ids(many, many.ids, len(many.ids) + 1)),
        ("count one smaller than the record", rewrite_ids(many, many.ids, len(many.ids) - 1)),
        ("keys out of order", rewrite_key(first, other.key + 1) if other.key + 1 != first.key
         else rewrite_key(first, other.key + 2)),
        ("key past the last txn", rewrite_key(layout.free[-1], layout.txnid + 7)),
    ]
    elsewhere = next(p for r in records if r is not first for p in r.ids if p not in first.ids)
    cases.append(("page listed in two records",
                  rewrite_ids(first, sorted(first.ids[1:] + [elsewhere], reverse=True))))
    # Pages both free and in use: what a page swap leaves behind, named directly.
    in_use = {"main database root": layout.roots["main"], "free list root": layout.roots["free"]}
    for name in ("dir", "pages", "seqs", "meta"):
        in_use[f"{name} tree page"] = layout.tree_pages[name][-1]
    first_ovf, pages = layout.overflow[len(layout.overflow) // 2]
    in_use["overflow first page"] = first_ovf
    in_use["overflow continuation page"] = first_ovf + pages - 1
    for what, pgno in in_use.items():
        target = next(r for r in records if pgno not in r.ids)
        cases.append((f"{what} ({pgno}) listed free",
                      rewrite_ids(target, sorted(target.ids[1:] + [pgno], reverse=True))))
    return cases


def flip_cases(layout: Layout, rng: random.Random, count: int) -> list[tuple[str, Damage]]:
    """Bit flips in the headers, node arrays, node headers and keys of live tree pages."""
    data = layout.data
    targets = [(name, pgno) for name, pages in layout.tree_pages.items() for pgno in pages]
    cases = []
    for _ in range(count):
        name, pgno = rng.choice(targets)
        base = pgno * PSIZE
        lower, upper = struct.unpack_from("<HH", data, base + 12)
        node = base + rng.choice(struct.unpack_from(f"<{(lower - 16) // 2}H", data, base + 16))
        ksize = struct.unpack_from("<H", data, node + 6)[0]
        region = rng.choice(["page header", "node array", "node", "node"])
        offset = {"page header": lambda: base + rng.randrange(16),
                  "node array": lambda: base + 16 + rng.randrange(lower - 16),
                  "node": lambda: node + rng.randrange(8 + ksize)}[region]()
        bit = rng.randrange(8)

        def damage(path: Path, offset: int = offset, bit: int = bit) -> None:
            poke(path, offset, bytes([data[offset] ^ (1 << bit)]))
        cases.append((f"{name} page {pgno}, {region}: bit {bit} of byte {offset - base}", damage))
    return cases


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_swapped_pages_never_kill_the_writer(wp_store, fast_tmp: Path, scale: str) -> None:
    """Two 4 KiB pages of data.mdb swapped: refused at open, or every later step works."""
    path, model, layout, seed = wp_store
    rng = random.Random(seed)
    pages = len(layout.data) // PSIZE
    every = list(itertools.combinations(range(2, pages), 2))
    if scale == "soak":
        pairs = every
    else:
        # An old version of a tree page in place of a live one is what LMDB's write
        # path trips over; a seeded sample of the other pairs covers the rest.
        live, stale = sorted(layout.live_pages()), layout.stale_tree_pages()
        pairs = sorted({tuple(sorted(p)) for p in itertools.product(live, stale)})
        chosen = set(pairs)
        pairs += rng.sample([p for p in every if p not in chosen], 40)
    cases = [(f"pages {a} and {b} swapped", swap(layout.data, a, b)) for a, b in pairs]
    tally = run_cases(path, model, fast_tmp, cases)
    print(f"swaps (seed {seed}, {pages} pages, {len(cases)} pairs, lmdb {lmdb.version(True)}):\n"
          f"{tally}")
    assert not bad_outcomes(tally), str(tally)


def test_free_list_damage_is_refused_at_open(wp_store, fast_tmp: Path) -> None:
    """Every damaged free list is StoreCorrupt at the writer's open, before anything writes."""
    path, model, layout, seed = wp_store
    cases = free_list_cases(layout)
    tally = run_cases(path, model, fast_tmp, cases)
    print(f"free list (seed {seed}, records {[(r.key, r.ids) for r in layout.free]}, last page "
          f"{layout.last_pgno}):\n{tally}")
    assert tally.counts == {"refused": len(cases)}, str(tally)


def test_refusal_names_the_free_list(wp_store, fast_tmp: Path) -> None:
    """The StoreCorrupt of a free-list page in use says what is wrong, not only that a child failed."""
    path, _model, layout, _seed = wp_store
    _, damage = next(case for case in free_list_cases(layout) if case[0].startswith("main database root"))
    copy = copy_store(path, fast_tmp / "named")
    damage(copy / DATA_MDB)
    with pytest.raises(ValueError, match="free list"):
        walk_pages(str(copy / DATA_MDB))
    with pytest.raises(StoreCorrupt, match="free list"):
        pagedkv.open(copy)


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_tree_node_flips_never_kill_the_writer(wp_store, fast_tmp: Path, scale: str) -> None:
    """Bit flips in live tree pages of every database, the free list and main database included."""
    path, model, layout, seed = wp_store
    rng = random.Random(seed ^ 0x5EED)
    cases = flip_cases(layout, rng, {"ci": 60, "soak": 5000}[scale])
    tally = run_cases(path, model, fast_tmp, cases)
    print(f"tree flips (seed {seed}):\n{tally}")
    assert not bad_outcomes(tally), str(tally)


def test_healthy_files_pass_the_walk(fast_tmp: Path) -> None:
    """Files LMDB itself wrote (branch pages, overflow records, a free list grown beside a
    held reader) pass the walk after every commit."""
    seed = get_seed("healthy walk")
    rng = random.Random(seed)
    where = fast_tmp / "env"
    env = lmdb.open(str(where), max_dbs=4, map_size=1 << 28, sync=False, metasync=False)
    dbs = [env.open_db(name) for name in (b"dir", b"pages", b"seqs", b"tokens")]
    keys: list[list[bytes]] = [[] for _ in dbs]
    reader: lmdb.Transaction | None = None
    deepest, most_free = 0, 0
    try:
        for _ in range(120):
            with env.begin(write=True) as txn:
                for _ in range(rng.randrange(1, 300)):
                    which = rng.randrange(len(dbs))
                    if rng.random() < 0.85 or not keys[which]:
                        # uid-like keys in two databases, variable-length ones in the others
                        if which >= 2:
                            key = os.urandom(rng.randrange(1, 40))
                        else:
                            key = rng.randrange(1 << 24).to_bytes(8, "big")
                        big = rng.random() < 0.05
                        size = rng.choice([0, 9, 40, 2100, 4100, 9000]) if big else rng.randrange(1, 90)
                        if txn.put(key, os.urandom(size), db=dbs[which], overwrite=False):
                            keys[which].append(key)
                    else:
                        index = rng.randrange(len(keys[which]))
                        keys[which][index], keys[which][-1] = keys[which][-1], keys[which][index]
                        txn.delete(keys[which].pop(), db=dbs[which])
            if rng.random() < 0.1:  # a held snapshot keeps the pages it sees off the free list's reuse
                if reader is None:
                    reader = env.begin()
                else:
                    reader.abort()
                    reader = None
            walk_pages(str(where / "data.mdb"))
            with env.begin() as txn:
                deepest = max(deepest, *(txn.stat(db)["depth"] for db in dbs))
            most_free = max(most_free, free_records(where / "data.mdb"))
    finally:
        if reader is not None:
            reader.abort()
        env.close()
    print(f"healthy walk (seed {seed}): deepest tree {deepest} levels, "
          f"up to {most_free} free-list records")
    assert deepest >= 2 and most_free >= 2, "the workload never grew branch pages or a free list"


def churn(chan: Channel, path: str) -> None:
    """A writer committing as fast as it can (one token, then a commit), until told to stop:
    each commit frees pages that the next but one reuses."""
    store = pagedkv.open(path, durability="nosync")
    store.create("churn")
    token = np.zeros((GEOM_WP.layers, 1, GEOM_WP.kv_heads, GEOM_WP.head_dim), GEOM_WP.np_dtype)
    chan.send("running")
    commits = 0
    while not select.select([chan.read_fd], [], [], 0)[0]:
        store.append("churn", token, token)
        store.commit()
        commits += 1
    chan.recv()
    store.close()
    chan.send(commits)


@pytest.mark.slow
def test_walk_beside_a_busy_writer_sees_one_snapshot(wp_store) -> None:
    """Beside a live writer the walk holds a read transaction on the snapshot it checks, so
    pages the writer reuses meanwhile never look like damage."""
    path, _model, _layout, _seed = wp_store
    refused = []
    with Child(churn, str(path)) as writer:
        assert writer.recv() == "running"
        for _ in range(40):
            try:
                probe_in_child(str(path / SPILL), DB_NAMES, lock=True)
            except StoreCorrupt as exc:
                refused.append(str(exc))
        writer.send("stop")
        commits = writer.recv()
    print(f"busy writer: {commits} commits during 40 probes, {len(refused)} refused")
    assert commits >= 40, "the writer hardly moved: the test shows nothing"
    assert not refused, refused[:3]
