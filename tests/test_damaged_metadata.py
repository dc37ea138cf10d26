"""Every committed metadata record is checksummed and schema-checked: damage is reported, never followed.

A flipped bit in a block table used to make ``read()`` return another page's
bytes with ``check() == []``; a malformed state field escaped as a bare
``TypeError``. Here every record of every metadata database is damaged in turn
(a bit of its value, a bit of its key, a valid record moved under another key,
a hostile writer's well-sealed nonsense), and each damaged copy must be refused
by a writer (``StoreCorrupt``, not a byte changed), listed by ``check()`` and
``pagedkv verify`` on a read-only open, and never serve a wrong byte.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
from click.testing import CliRunner

import pagedkv
from pagedkv import PageCorrupt, StoreCorrupt
from pagedkv.cli.commands import cli
from pagedkv.pages import lrulog
from pagedkv.storage.metarecord import TAG_META, seal
from pagedkv.demo.kvgen import check_read

from tools import make_sample

from tests.kits.content import get_seed
from tests.kits.files import spill_dbs, spill_env
from tests.kits.model import Model
from tests.kits.store import GEOM, ROOT


PS = GEOM.page_size
META_DBS = ("meta", "seqs", "dir", "tokens")


def _ids(seq: Any, start: int, n: int) -> np.ndarray:
    return (np.arange(start, start + n) * 7 + hash(str(seq)) % 1000).astype(np.int64) % 50_000


def build(path: Path, seed: int) -> Model:
    """A closed store with token ids, a fork, cached pages of a dropped sequence and spilled pages."""
    model = Model(seed)
    store = pagedkv.open(path, GEOM, 8)
    for seq, n in (("a", 21), ("b", 14), (7, 30)):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, n), tokens=_ids(seq, 0, n) if seq != 7 else None)
        store.commit()
    store.fork("a", "f")
    model.fork("a", "f")
    store.append("f", *model.next_kv("f", 3), tokens=_ids("f", 21, 3))
    store.create("gone")
    model.create("gone")
    store.append("gone", *model.next_kv("gone", 12), tokens=_ids("gone", 0, 12))
    store.drop("gone")
    model.drop("gone")
    store.commit()
    store.close()
    return model


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Model]:
    path = tmp_path / "store"
    return path, build(path, get_seed("metadata"))


def records(path: Path) -> list[tuple[str, bytes, bytes]]:
    """(db name, key, value) of every metadata record."""
    env = spill_env(path, readonly=True, lock=False)
    try:
        dbs = spill_dbs(env)
        with env.begin() as txn:
            return [(name, bytes(k), bytes(v)) for name in META_DBS for k, v in txn.cursor(db=dbs[name])]
    finally:
        env.close()


def rewrite(path: Path, db: str, key: bytes, value: bytes | None, new_key: bytes | None = None) -> None:
    """Replace one record's value (and move it under ``new_key``), as damage on disk would."""
    env = spill_env(path)
    try:
        handle = spill_dbs(env)[db]
        with env.begin(write=True) as txn:
            if new_key is not None:
                txn.delete(key, db=handle)
                key = new_key
            if value is not None:
                txn.put(key, value, db=handle)
    finally:
        env.close()


def digest(path: Path) -> str:
    return hashlib.sha256((path / "spill" / "data.mdb").read_bytes()
                          + (path / "pool.bin").read_bytes()).hexdigest()


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def assert_refused_and_reported(path: Path, model: Model) -> list[str]:
    """A writer refuses with StoreCorrupt and changes nothing; read-only lists the damage, serves no wrong byte."""
    before = digest(path)
    with pytest.raises(StoreCorrupt):
        pagedkv.open(path)
    assert digest(path) == before, "a refused writer open changed the store"
    try:
        store = pagedkv.open(path, readonly=True)
    except StoreCorrupt:
        return ["refused"]
    try:
        problems = store.check()
        assert problems, "damaged metadata, yet check() is clean"
        for seq in store.sequences():
            try:
                model.verify(store, seq)
            except PageCorrupt:
                pass
    finally:
        store.close()
    result = CliRunner().invoke(cli, ["verify", str(path)])
    assert result.exit_code != 0 and "no damage" not in result.output, result.output
    return problems


@pytest.mark.slow
def test_every_metadata_record_is_checked(built, tmp_path: Path) -> None:
    """A bit flip in each record's value, and in its key, is damage a writer refuses and verify lists."""
    path, model = built
    rng = random.Random(get_seed("flips"))
    work = tmp_path / "work"
    seen = set()
    for db, key, value in records(path):
        cases = [("value", flip(value, rng.randrange(8 * len(value))), None)]
        if db != "meta":  # a flipped meta key is an unknown record beside a missing one
            cases.append(("key", value, flip(key, rng.randrange(8 * len(key)))))
        else:
            cases.append(("key", value, key[:-1] + bytes([key[-1] ^ 1])))
        for what, new_value, new_key in cases:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(path, work)
            rewrite(work, db, key, new_value, new_key)
            assert_refused_and_reported(work, model)
            seen.add(db)
    assert seen == set(META_DBS)


def test_flipped_uid_in_a_block_table_never_serves_another_page(built, tmp_path: Path) -> None:
    """The reproduction: a uid of "a"'s table changed to another live page's uid, sealed or not."""
    path, model = built
    (_, key, value), = [r for r in records(path) if r[0] == "seqs" and msgpack.unpackb(r[1]) == "a"]
    seq_id, length, raw = msgpack.unpackb(value[:-8])
    uids = np.frombuffer(raw, "<u8").copy()
    uids[0] ^= 1  # another page's uid (uids are dense), as one bit flip makes it
    bad = msgpack.packb([seq_id, length, uids.astype("<u8").tobytes()])
    for sealed in (False, True):
        work = tmp_path / f"work{sealed}"
        shutil.copytree(path, work)
        # Unsealed: the flip in place. "Sealed": a value with a valid checksum trailer
        # of another store (seed 0), as a copy from elsewhere would carry.
        rewrite(work, "seqs", key, seal(b"seqs", key, bad, 0) if sealed else bad + value[-8:])
        problems = assert_refused_and_reported(work, model)
        assert any("block table of 'a'" in line for line in problems), problems
        with pagedkv.open(work, readonly=True) as store:
            assert "a" not in store.sequences()
            with pytest.raises(pagedkv.SequenceNotFound):
                store.read("a")
            model.verify(store, "b")  # the rest stays readable


HOSTILE_STATE: list[tuple[str, Callable[[dict], dict]]] = [
    ("next_uid None", lambda s: {**s, "next_uid": None}),
    ("next_uid 2**64-1", lambda s: {**s, "next_uid": 2**64 - 1}),
    ("commits 'x'", lambda s: {**s, "commits": "x"}),
    ("tick a dict", lambda s: {**s, "tick": {"a": 1}}),
    ("tick huge", lambda s: {**s, "tick": 2**63 - 1}),
    ("durability 7", lambda s: {**s, "durability": 7}),
    ("time NaN", lambda s: {**s, "time": float("nan")}),
    ("counter negative", lambda s: {**s, "evictions": -5}),
    ("a list, not a map", lambda s: [1, 2]),
    ("lru_log a str", lambda s: {**s, "lru_log": "0-3"}),
    ("lru_log reversed", lambda s: {**s, "lru_log": [5, 1]}),
    ("lru_log of three ends", lambda s: {**s, "lru_log": [0, 1, 2]}),
]


@pytest.mark.parametrize("name,change", HOSTILE_STATE, ids=[n for n, _ in HOSTILE_STATE])
def test_hostile_state_fields_are_typed_damage(built, name: str, change: Callable) -> None:
    """Well-sealed but malformed state fields: StoreCorrupt at open, damage in verify, never a bare error."""
    path, model = built
    with pagedkv.open(path, readonly=True) as store:
        seed = store._mgr.seed
    (_, _, value), = [r for r in records(path) if r[0] == "meta" and r[1] == b"state"]
    state = msgpack.unpackb(value[:-8])
    rewrite(path, "meta", b"state", seal(TAG_META, b"state", msgpack.packb(change(state)), seed))
    problems = assert_refused_and_reported(path, model)
    assert any("state" in line for line in problems), problems


def test_huge_lru_stamps_are_damage(built) -> None:
    path, model = built
    with pagedkv.open(path, readonly=True) as store:
        seed, slots = store._mgr.seed, store.pool_pages
    stamps = np.full(slots, 2**63 - 1, "<i8").tobytes()
    rewrite(path, "meta", b"lru", seal(TAG_META, b"lru", stamps, seed))
    assert any("lru" in line for line in assert_refused_and_reported(path, model))


@pytest.fixture
def logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Model]:
    """``built``, with its LRU stamps committed as a base and a log of several deltas."""
    monkeypatch.setattr(lrulog, "MAX_LOG_SHARE", 1e9)  # no base rewrite for the log's size
    path = tmp_path / "store"
    model = build(path, get_seed("metadata"))
    assert len(deltas(path)) >= 3
    return path, model


def deltas(path: Path) -> list[tuple[bytes, bytes]]:
    """(key, value) of every delta of the LRU log, oldest first."""
    return [(key, value) for db, key, value in records(path) if db == "meta" and lrulog.is_delta_key(key)]


def sealed_delta(path: Path, key: bytes, pairs: list[tuple[int, int]]) -> bytes:
    """A delta of (slot, stamp) ``pairs`` under ``key``, sealed as the store's writer would."""
    with pagedkv.open(path, readonly=True) as store:
        seed = store._mgr.seed
    return seal(TAG_META, key, np.array(pairs, lrulog.DELTA_DTYPE).tobytes(), seed)


LOG_DAMAGE: list[tuple[str, Callable[[Path], None]]] = [
    ("a delta missing", lambda p: rewrite(p, "meta", deltas(p)[1][0], None, deltas(p)[1][0])),  # deleted
    ("an extra delta", lambda p: rewrite(p, "meta", lrulog.delta_key(99), deltas(p)[-1][1])),
    ("an extra delta sealed", lambda p: rewrite(p, "meta", lrulog.delta_key(99),
                                                sealed_delta(p, lrulog.delta_key(99), [(0, 1)]))),
    ("a flipped bit", lambda p: rewrite(p, "meta", deltas(p)[1][0], flip(deltas(p)[1][1], 13))),
    ("a slot out of range", lambda p: rewrite(p, "meta", deltas(p)[1][0],
                                             sealed_delta(p, deltas(p)[1][0], [(0, 1), (8, 2)]))),
    ("slots out of order", lambda p: rewrite(p, "meta", deltas(p)[1][0],
                                            sealed_delta(p, deltas(p)[1][0], [(3, 1), (2, 2)]))),
    ("a stamp out of range", lambda p: rewrite(p, "meta", deltas(p)[1][0],
                                              sealed_delta(p, deltas(p)[1][0], [(0, 2**63 - 1)]))),
    ("an empty delta", lambda p: rewrite(p, "meta", deltas(p)[1][0], sealed_delta(p, deltas(p)[1][0], []))),
]


@pytest.mark.parametrize("name,damage", LOG_DAMAGE, ids=[n for n, _ in LOG_DAMAGE])
def test_a_damaged_lru_log_is_damage(logged, name: str, damage: Callable[[Path], None]) -> None:
    """A delta missing, extra, flipped or well-sealed nonsense: a writer refuses, a reader reports it
    and keeps the base record's stamps."""
    path, model = logged
    (_, _, base), = [r for r in records(path) if r[0] == "meta" and r[1] == b"lru"]
    damage(path)
    problems = assert_refused_and_reported(path, model)
    assert any("lru" in line for line in problems), problems
    with pagedkv.open(path, readonly=True) as store:
        assert np.array_equal(store._mgr.stamp, np.frombuffer(base[:-8], "<i8"))


@pytest.mark.parametrize("field,value", [("salt", 12), ("salt", "text"), ("model", 5), ("model", b"x"),
                                         ("created", "yesterday"), ("pool_pages", 2**40)])
def test_hostile_superblock_fields_are_store_corrupt(built, field: str, value: Any) -> None:
    path, _ = built
    (_, _, raw), = [r for r in records(path) if r[0] == "meta" and r[1] == b"superblock"]
    sb = msgpack.unpackb(raw[:-8])
    sb[field] = value
    rewrite(path, "meta", b"superblock", seal(TAG_META, b"superblock", msgpack.packb(sb), 0))
    for readonly in (False, True):
        with pytest.raises(StoreCorrupt):
            pagedkv.open(path, readonly=readonly)


def test_damaged_table_keeps_every_page_it_may_reference(built, tmp_path: Path) -> None:
    """Nothing is collected while a table is damaged: repairing the record gives every byte back."""
    path, model = built
    (_, key, value), = [r for r in records(path) if r[0] == "seqs" and msgpack.unpackb(r[1]) == "b"]
    rewrite(path, "seqs", key, flip(value, 3))
    for _ in range(2):
        with pytest.raises(StoreCorrupt):
            pagedkv.open(path)
    rewrite(path, "seqs", key, value)  # the record as it was: nothing else may have moved
    with pagedkv.open(path) as store:
        model.verify_all(store)
        assert store.check() == []


# -- format 1: the golden store opens, reads, and is sealed by its first writer ------------------


@pytest.mark.slow
def test_format_1_store_reads_unchecked_and_a_writer_seals_it(tmp_path: Path) -> None:

    work = tmp_path / "sample.kv"
    shutil.copytree(ROOT / "data" / "sample.kv", work)
    with pagedkv.open(work, readonly=True) as store:
        assert store.superblock["format"] == 1 and store.check() == []
    with pagedkv.open(work) as store:
        assert store.superblock["format"] == pagedkv.storage.codec.FORMAT_VERSION
    names = {db: {k for d, k, _ in records(work) if d == db} for db in META_DBS}
    for db, key, value in records(work):  # every record is sealed now: a flip is damage
        if db == "meta" and key == b"superblock":
            continue
        copy = tmp_path / "flipped"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(work, copy)
        rewrite(copy, db, key, flip(value, 0))
        with pytest.raises(StoreCorrupt):
            pagedkv.open(copy)
    assert names["seqs"] and names["tokens"] and names["dir"]
    with pagedkv.open(work, readonly=True) as store:
        for req in make_sample.requests():
            if req.length:
                check_read(store, make_sample.GEOMETRY, make_sample.SEED, req)
        gone = make_sample.DROPPED
        assert store.lookup(gone.token_ids(make_sample.SEED, 0, gone.length)) == gone.length
        assert store.check() == []


@pytest.mark.parametrize("name, version", [("sample-v2.kv", 2), ("sample-v3.kv", 3)])
def test_golden_stores_of_formats_2_and_3_read_in_place(name: str, version: int) -> None:
    """The frozen stores read bit-exact, unchanged on disk; format 3's holds a delta of its LRU log."""
    sample = ROOT / "data" / name
    before = digest(sample)
    with pagedkv.open(sample, readonly=True) as store:
        assert store.superblock["format"] == version and store.check() == []
        log = store._mgr.stamp_log
        assert (log.next - log.first > 0) == (version >= 3), log
        for req in make_sample.requests():
            if req.length:
                check_read(store, make_sample.GEOMETRY, make_sample.SEED, req)
        gone = make_sample.DROPPED
        assert store.lookup(gone.token_ids(make_sample.SEED, 0, gone.length)) == gone.length
    assert digest(sample) == before


def test_a_spill_record_under_a_huge_key_is_damage_not_the_next_uid(built) -> None:
    """A spilled page's record moved under its key with the top bit set (a flipped bit in an LMDB
    node: spill records are not sealed under their key) is reported, and no writer opens the store.

    Taken as an uncommitted record, its key became the store's next uid (2**63 + uid), which
    the writer then committed and every later open refused.
    """
    path, model = built
    env = spill_env(path)
    try:
        pages = spill_dbs(env)["pages"]
        with env.begin() as txn:
            key, value = next(iter(txn.cursor(db=pages)))
            key, value = bytes(key), bytes(value)
    finally:
        env.close()
    rewrite(path, "pages", key, value, new_key=bytes([key[0] | 0x80]) + key[1:])
    lines = assert_refused_and_reported(path, model)
    assert any("spill record's key is not a page uid" in line for line in lines), lines


def test_unsealed_records_in_a_sealed_store_are_damage(built, tmp_path: Path) -> None:
    """A format-1 (bare) value written into a format-2 store is not trusted."""
    path, model = built
    (_, key, value), = [r for r in records(path) if r[0] == "seqs" and msgpack.unpackb(r[1]) == "a"]
    rewrite(path, "seqs", key, value[:-8])
    assert_refused_and_reported(path, model)


def test_a_deleted_record_is_damage(built, tmp_path: Path) -> None:
    """A block table, directory entry or token list deleted outright (no bit to fail) is still damage."""
    path, model = built
    chosen = {}
    for db, key, _ in records(path):
        if db in ("seqs", "dir", "tokens") and db not in chosen:
            chosen[db] = key
    assert set(chosen) == {"seqs", "dir", "tokens"}
    for db, key in chosen.items():
        work = tmp_path / f"work-{db}"
        shutil.copytree(path, work)
        rewrite(work, db, key, None, new_key=key)  # deleted, put back nowhere
        problems = assert_refused_and_reported(work, model)
        assert problems == ["refused"] or any("found, the last write left" in p for p in problems), problems


def test_an_older_token_list_put_back_is_damage(built) -> None:
    """Token lists only grow: a shorter one (validly sealed, from an earlier commit) is damage."""
    path, model = built
    with pagedkv.open(path, readonly=True) as store:
        seed = store._mgr.seed
    key, value = next((k, v) for db, k, v in records(path) if db == "tokens" and len(v) - 8 >= 8)
    rewrite(path, "tokens", key, seal(b"tokens", key, value[:-8][:-4], seed))
    assert any("stored token ids" in p for p in assert_refused_and_reported(path, model))
