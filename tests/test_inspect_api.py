"""The store's read API (``KVStore.describe()`` and its kin) and the inspector's use of it.

* The inspector (``pagedkv/inspection/``, ``pagedkv/snapshot.py``) reads a store through
  public names only: no ``obj._private`` read from anything but ``self``.
* Every figure the API returns is checked against a store whose contents the test
  chose: counts, listings, a shared, a spilled and a cached page, a page whose pool
  slot was scribbled on, a stray record left by a writer that stopped.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv.describe import SLOT_STATES
from pagedkv.inspection import report
from tests.kits.store import GEOM, Stores

PKG = Path(__file__).resolve().parent.parent / "pagedkv"
INSPECTOR = sorted((PKG / "inspection").glob("*.py")) + [PKG / "snapshot.py"]
PAGE = GEOM.page_size


def private_reads(source: str) -> list[str]:
    """``line: expr._name`` for every single-underscore attribute read from an object other than ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_rule_finds_private_reads() -> None:
    # A guard for the guard: what the inspector used to do is caught, what it may do is not.
    assert private_reads("x = snap.store._mgr.live\n") == ["1: snap.store._mgr"]
    assert private_reads("store._spill.env.readers()\n") == ["1: store._spill"]
    assert private_reads("self._cache = 1\nname = type(x).__name__\nstore.describe()\n") == []


@pytest.mark.parametrize("path", INSPECTOR, ids=lambda path: path.name)
def test_the_inspector_reads_public_names_only(path: Path) -> None:
    assert private_reads(path.read_text()) == []


def test_the_inspector_is_read() -> None:
    names = {path.name for path in INSPECTOR}
    assert {"report.py", "cachereport.py", "snapshot.py"} <= names


def test_the_map_legend_names_the_slot_states() -> None:
    assert [report.MAP_LEGEND[ch].split(" ")[0] for ch in report._MAP_CHARS] == list(SLOT_STATES)


# -- a store whose every figure is known -------------------------------------------------

def _kv(rng: np.random.Generator, tokens: int) -> np.ndarray:
    return rng.standard_normal((GEOM.layers, tokens, GEOM.kv_heads, GEOM.head_dim)).astype(GEOM.dtype)


def _build(stores: Stores) -> tuple[pagedkv.KVStore, dict[str, list[int]], float]:
    """4 slots, 8 live pages: "a" (3 hashed full pages) shared whole by its fork "b";
    "c" (2 full pages and one of 2 tokens, unhashed); 2 hashed pages cached from the dropped "d".
    """
    rng = np.random.default_rng(7)
    store = stores.open(pool_pages=4)
    started = time.time()
    prompt_a, prompt_d = rng.integers(0, 1000, 3 * PAGE), rng.integers(1000, 2000, 2 * PAGE)
    for seq, tokens, ids in (("a", 3 * PAGE, prompt_a), ("c", 2 * PAGE + 2, None), ("d", 2 * PAGE, prompt_d)):
        store.create(seq)
        store.append(seq, _kv(rng, tokens), _kv(rng, tokens), tokens=ids)
    store.fork("a", "b")
    store.commit()
    uids = {seq.id: list(seq.pages) for seq in store.describe_sequences()}
    store.drop("d")
    assert store.create("e", tokens=prompt_a) == 2 * PAGE  # a prefix query: 2 full pages reused
    store.drop("e")
    store.commit()
    return store, uids, started


def test_describe_counts_what_the_store_holds(stores: Stores) -> None:
    store, uids, started = _build(stores)
    info = store.describe()
    pages = info.pages
    assert (pages.total, pages.shared, pages.hashed, pages.cached, pages.orphan) == (8, 3, 5, 2, 0)
    assert (pages.resident, pages.spilled) == (4, 4)  # the pool is full; the rest went to LMDB
    assert (info.sequences, info.tokens) == (3, 3 * PAGE + 3 * PAGE + 2 * PAGE + 2)
    assert (info.pool_pages, info.geometry, info.uuid, info.format_version) == (4, GEOM, store.uuid, 3)
    assert info.metadata_checked and info.path == str(store.path)
    assert sum(info.slots.values()) == 4 and info.slots["free"] == 0 and info.slots["pinned"] == 0
    resident = [page for page in store.describe_pages() if page.resident]
    assert info.slots["shared"] == sum(page.refcount > 1 for page in resident)
    assert info.slots["cached"] == sum(page.cached for page in resident)
    # Every spilled page has exactly one record; the raw codec holds them all.
    assert info.records == 4 == info.codecs["raw"].pages and info.codecs["int8"].pages == 0
    assert info.record_bytes == info.codecs["raw"].bytes == sum(p.record_bytes for p in store.describe_pages()
                                                                 if not p.resident)
    assert info.spill.entries["pages"] == info.records and info.spill.last_txnid > 0
    commit = info.last_commit
    assert commit == store.last_commit()
    assert commit.commits == 2 and commit.durability == "durable" and commit.remote is None
    assert commit.time is not None and started <= commit.time <= time.time()
    counters = commit.counters
    assert (counters["prefix_queries"], counters["prefix_query_tokens"]) == (1, 3 * PAGE)
    assert (counters["prefix_hit_tokens"], counters["prefix_hit_pages"]) == (2 * PAGE, 2)
    assert counters["evictions"] == store.stats()["evictions"] >= 4


def test_the_listings_name_each_page_and_sequence(stores: Stores) -> None:
    store, uids, _ = _build(stores)
    seqs = store.describe_sequences()
    assert [seq.id for seq in seqs] == store.sequences() == ["a", "c", "b"]
    by_id = {seq.id: seq for seq in seqs}
    assert by_id["a"].pages == by_id["b"].pages == tuple(uids["a"]) and len(uids["a"]) == 3
    assert by_id["c"].pages == tuple(uids["c"]) and len(set(uids["a"]) | set(uids["c"])) == 6
    assert by_id["c"].length == 2 * PAGE + 2
    pages = {page.uid: page for page in store.describe_pages()}
    assert set(pages) == set(uids["a"]) | set(uids["c"]) | set(uids["d"])
    for seq in seqs:
        assert seq.resident == sum(pages[uid].resident for uid in seq.pages)
    first, second, third = (pages[uid] for uid in uids["a"])
    assert [p.refcount for p in (first, second, third)] == [2, 2, 2]
    assert all(p.prefix_hash is not None and len(p.prefix_hash) == 16 for p in (first, second, third))
    # The chain: a first page follows nothing; each next one follows its predecessor's class.
    assert (first.parent, second.parent, third.parent) == (0, first.uid, second.uid)
    partial = pages[uids["c"][-1]]
    assert (partial.tokens, partial.prefix_hash, partial.parent, partial.refcount) == (2, None, None, 1)
    for uid in uids["d"]:
        assert pages[uid].cached and pages[uid].refcount == 0
    assert not any(page.cached for page in pages.values() if page.refcount)
    states = store.slot_states()
    for page in pages.values():
        if page.resident:
            assert page.record in ("none", "current")  # a restored page keeps its record until a commit
            expected = "cached" if page.cached else "shared" if page.refcount > 1 else "resident"
            assert SLOT_STATES[states[page.slot]] == expected
        else:
            assert (page.record, page.codec) == ("current", "raw") and page.record_bytes > 0
    assert sorted(page.slot for page in pages.values() if page.resident) == [0, 1, 2, 3]
    # A listing by uid keeps the order asked for, short or long (one lookup path each).
    wanted = [uids["c"][2], uids["a"][0], uids["d"][1]]
    assert [page.uid for page in store.describe_pages(wanted)] == wanted
    many = list(pages)[::-1] * 3
    assert [page.uid for page in store.describe_pages(many)] == many


def test_pages_are_checked_without_being_restored(stores: Stores) -> None:
    store, uids, _ = _build(stores)
    before = store.stats()
    checked = store.describe_pages(check=True)
    assert all(page.ok is True and page.problem is None for page in checked)
    assert [p.slot for p in checked] == [p.slot for p in store.describe_pages()]
    assert store.stats()["restores"] == before["restores"]
    victim = next(page for page in checked if page.resident)
    store.pool[victim.slot, 0, 0, 0] += 1.0  # an engine scribbling outside its step
    (bad,) = store.describe_pages([victim.uid], check=True)
    assert bad.ok is False and bad.problem == f"page {victim.uid}: pool slot {victim.slot} fails its checksum"
    assert any(p.kind == "pool_checksum" and p.page == victim.uid for p in store.check(detailed=True))


def test_page_content_is_the_pages_bytes(stores: Stores) -> None:
    store, uids, _ = _build(stores)
    pages = {page.uid: page for page in store.describe_pages()}
    contents = {uid: store.page_content(uid) for uid in uids["a"] + uids["c"]}  # before any read restores
    spilled = [uid for uid in contents if not pages[uid].resident]
    resident = [uid for uid in contents if pages[uid].resident]
    assert spilled and resident
    for uid in spilled:
        content = contents[uid]
        assert content.record is not None and content.record["uid"] == uid
        assert content.record["fill"] == pages[uid].tokens and content.record_bytes == pages[uid].record_bytes
    for uid in resident:
        assert contents[uid].record is None and contents[uid].record_bytes is None
    for seq in ("a", "c"):
        read = store.read_pages(seq)
        for index, uid in enumerate(uids[seq]):
            fill = pages[uid].tokens
            page = contents[uid].page
            assert page is not None and page.shape == read[index].shape
            assert np.array_equal(page[:, :, :fill], read[index][:, :, :fill])
    with pytest.raises(pagedkv.PageNotFound):
        store.page_content(max(pages) + 1)
    with pytest.raises(pagedkv.PageNotFound):
        store.describe_pages([uids["a"][0], max(pages) + 1])
    with pytest.raises(pagedkv.PagedKVError, match="page uid must be an integer"):
        store.describe_pages([-1])


def test_a_read_only_handle_sees_the_same_store(stores: Stores) -> None:
    store, uids, _ = _build(stores)
    writer = store.describe()
    listing = store.describe_pages()
    sequences = store.describe_sequences()
    store.close()
    reader = pagedkv.open(store.path, readonly=True)
    stores.opened.append(reader)
    seen = reader.describe()
    assert (seen.pages, seen.slots, seen.records, seen.record_bytes, seen.codecs) == \
        (writer.pages, writer.slots, writer.records, writer.record_bytes, writer.codecs)
    assert seen.last_commit.commits == 3  # close() committed once more
    # Residency included: the reader loads the last commit (its order is load order, by key).
    assert sorted(reader.describe_sequences(), key=lambda seq: seq.id) == sorted(sequences, key=lambda seq: seq.id)
    assert [seq.id for seq in reader.describe_sequences()] == reader.sequences()
    assert [(p.uid, p.refcount, p.prefix_hash) for p in reader.describe_pages()] == \
        [(p.uid, p.refcount, p.prefix_hash) for p in listing]
    assert seen.spill.locking is False and seen.spill.reader_pids is None  # no writer: no lock file used
    assert reader.garbage() == []


def test_garbage_lists_the_records_a_stopped_writer_left(stores: Stores) -> None:
    rng = np.random.default_rng(3)
    store = stores.open(pool_pages=4)
    store.create("kept")
    store.append("kept", _kv(rng, PAGE), _kv(rng, PAGE))
    store.commit()
    store.create("lost")
    store.append("lost", _kv(rng, 6 * PAGE), _kv(rng, 6 * PAGE))  # evicts its own first pages
    (lost,) = [seq for seq in store.describe_sequences() if seq.id == "lost"]
    spilled = {page.uid for page in store.describe_pages(lost.pages) if not page.resident}
    assert spilled
    store._abandon()  # a crash: the eviction's records were written, the commit naming them never
    reader = pagedkv.open(store.path, readonly=True)
    stores.opened.append(reader)
    garbage = reader.garbage()
    assert {p.page for p in garbage} == spilled and {p.kind for p in garbage} == {"stray_record"}
    assert not any(p.kind == "stray_record" for p in reader.check(detailed=True))
    assert reader.describe().records == len(spilled) + reader.describe().pages.spilled
