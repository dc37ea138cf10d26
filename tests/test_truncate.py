"""``KVStore.truncate``: rolling a sequence back (rejected speculative tokens), crash-safely.

Geometry: ``kits.store.GEOM`` (4 tokens a page, 512-byte pages) for the data path; ``kits.prefix.GEOM``
(8 tokens a page) for the prefix cache. After a truncation the model gives the sequence a
new content key, so tokens appended afterwards differ from the ones cut: a truncation that
left the old bytes in place reads back as wrong bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import PagedKVError, ReadOnlyStore, SequenceBusy, SequenceNotFound

from tests.kits.child import run_until_killed
from tests.kits.model import Model, build_committed
from tests.kits.prefix import PS as PPS, assert_holds, extend, index_problems, prefill, prompt
from tests.kits.store import GEOM



PS = GEOM.page_size


def cut(store: pagedkv.KVStore, model: Model, seq: Any, length: int) -> None:
    """Truncate ``seq`` in the store and in the model; later appends get new content."""
    store.truncate(seq, length)
    model.undo(seq, length)
    model._gen += 1
    model.keys[seq] = (seq, model._gen)


def filled(store: pagedkv.KVStore, model: Model, seq: Any, n: int) -> None:
    store.create(seq)
    model.create(seq)
    if n:
        store.append(seq, *model.next_kv(seq, n))


def held_pages(store: pagedkv.KVStore, seq: Any) -> list[int]:
    """White-box: the uids of a sequence's pages, in order."""
    mgr = store._mgr
    return [int(mgr.uid[pid]) for pid in store._seqs.find(seq).table.tolist()]


# -- the data path ----------------------------------------------------------------------------


@pytest.mark.parametrize("n,length", [(10, 7), (10, 8), (10, 4), (10, 1), (12, 9), (9, 9), (3, 2),
                                      (12, 0), (13, 12)])
@pytest.mark.parametrize("pool_pages", [8, 3], ids=["resident", "spilling"])
def test_truncate_then_append(stores, seed, n: int, length: int, pool_pages: int) -> None:
    store = stores.open(pool_pages=pool_pages, evict_batch=1)
    model = Model(seed)
    filled(store, model, "a", n)
    filled(store, model, "other", 2 * PS + 1)  # keeps the small pool under pressure
    store.commit()
    cut(store, model, "a", length)
    assert store.length("a") == length
    model.verify(store, "a")
    assert store.stats()["pages"] == -(-length // PS) + 3
    store.append("a", *model.next_kv("a", 2 * PS - 1))
    model.verify_all(store)
    assert store.check() == []
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_truncate_to_the_same_length_changes_nothing(store, seed) -> None:
    model = Model(seed)
    filled(store, model, "a", 2 * PS + 1)
    pages = held_pages(store, "a")
    store.truncate("a", 2 * PS + 1)
    assert held_pages(store, "a") == pages
    model.verify(store, "a")
    assert store.check() == []


def test_truncate_to_zero_frees_every_page(stores, seed) -> None:
    store = stores.open()
    model = Model(seed)
    filled(store, model, "a", 3 * PS + 2)
    store.commit()
    cut(store, model, "a", 0)
    assert store.length("a") == 0 and store.stats()["pages"] == 0
    assert store.read("a")[0].shape[1] == 0
    store.append("a", *model.next_kv("a", PS + 1))
    model.verify(store, "a")
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.stats()["pages"] == 2
    assert store.check() == []


def test_truncate_frees_tail_pages_and_their_records(stores, seed) -> None:
    """Freed tail pages go like a drop's: their records leave LMDB at the next commit."""
    store = stores.open(pool_pages=3, evict_batch=1)
    model = Model(seed)
    filled(store, model, "a", 8 * PS)  # 5 of 8 pages spilled
    store.commit()
    before = store.stats()
    assert before["spilled_pages"] == 5
    cut(store, model, "a", 2 * PS)  # the last 6 pages go; spilled ones among them
    store.commit()
    after = store.stats()
    assert after["pages"] == 2
    assert after["spill_bytes"] < before["spill_bytes"]
    assert after["spilled_pages"] + after["pool_used"] == 2
    model.verify(store, "a")
    assert store.check() == []  # no record is left without a page
    store = stores.reopen(store)
    assert store.stats()["pages"] == 2
    model.verify_all(store)


def test_truncate_into_a_shared_page_copies_it(store, seed) -> None:
    model = Model(seed)
    filled(store, model, "a", 2 * PS + 2)
    store.fork("a", "b")
    model.fork("a", "b")
    shared = held_pages(store, "a")
    copies = store.stats()["cow_copies"]
    cut(store, model, "a", PS + 1)  # into page 1, which b shares
    assert store.stats()["cow_copies"] == copies + 1
    assert held_pages(store, "a")[0] == shared[0]  # a kept full page stays shared
    assert held_pages(store, "a")[1] != shared[1]  # the partly kept one is a private copy
    assert held_pages(store, "b") == shared  # b is untouched
    store.append("a", *model.next_kv("a", PS + 3))
    model.verify_all(store)
    assert store.check() == []


def test_truncate_at_a_shared_page_boundary_copies_nothing(store, seed) -> None:
    model = Model(seed)
    filled(store, model, "a", 3 * PS)
    store.fork("a", "b")
    model.fork("a", "b")
    copies = store.stats()["cow_copies"]
    cut(store, model, "a", 2 * PS)
    assert store.stats()["cow_copies"] == copies
    store.append("a", *model.next_kv("a", 3))
    model.verify_all(store)
    assert store.check() == []


@pytest.mark.parametrize("which", ["source", "fork"])
def test_truncate_a_forked_sequence(stores, seed, which: str) -> None:
    store = stores.open(pool_pages=4, evict_batch=1)
    model = Model(seed)
    filled(store, model, "src", 3 * PS + 3)
    store.fork("src", "dst")
    model.fork("src", "dst")
    store.append("dst", *model.next_kv("dst", 2))  # dst's last page is its own copy now
    store.commit()
    seq, other = ("src", "dst") if which == "source" else ("dst", "src")
    for length in (3 * PS + 1, 2 * PS + 2, PS, 1):
        cut(store, model, seq, length)
        model.verify_all(store)
        store.append(seq, *model.next_kv(seq, 1))
        model.verify_all(store)
        assert store.check() == []
    store.drop(other)
    model.drop(other)
    model.verify_all(store)
    store = stores.reopen(store)
    model.verify_all(store)
    assert store.check() == []


def test_truncate_inside_a_step(store, seed) -> None:
    model = Model(seed)
    filled(store, model, "a", 5)
    filled(store, model, "b", 5)
    with store.step({"a": 1}):
        with pytest.raises(SequenceBusy):
            store.truncate("a", 2)
        store.truncate("b", 2)  # another sequence is free to change
    assert store.length("a") == 6 and store.length("b") == 2


def test_truncate_errors(stores, seed) -> None:
    store = stores.open()
    model = Model(seed)
    filled(store, model, "a", 5)
    with pytest.raises(SequenceNotFound):
        store.truncate("nope", 0)
    for bad in (-1, 6, 1 << 40):
        with pytest.raises(PagedKVError, match="outside"):
            store.truncate("a", bad)
    for bad in (True, 2.0, "2", None):
        with pytest.raises(PagedKVError):
            store.truncate("a", bad)
    assert store.length("a") == 5
    store.close()
    reader = pagedkv.open(store.path, readonly=True)
    try:
        with pytest.raises(ReadOnlyStore):
            reader.truncate("a", 1)
    finally:
        reader.close()


@pytest.mark.parametrize("write_behind", [False, True], ids=["foreground", "write-behind"])
def test_truncate_in_a_loop_of_speculative_decoding(stores, seed, write_behind: bool) -> None:
    """Propose k tokens, keep a random prefix of them, over and over, with commits between."""
    rng = np.random.default_rng(seed)
    store = stores.open(pool_pages=6, evict_batch=2, write_behind=write_behind)
    model = Model(seed)
    for seq in ("a", "b", "c"):
        filled(store, model, seq, int(rng.integers(1, 3 * PS)))
    for round_ in range(60):
        seq = ("a", "b", "c")[round_ % 3]
        base = model.lens[seq]
        k = int(rng.integers(1, 2 * PS))
        store.append(seq, *model.next_kv(seq, k))
        cut(store, model, seq, base + int(rng.integers(0, k + 1)))
        if rng.integers(0, 4) == 0:
            store.commit()
        if model.lens[seq] > 8 * PS:
            cut(store, model, seq, int(rng.integers(0, PS)))
    model.verify_all(store)
    assert store.check() == []
    store = stores.reopen(store)
    model.verify_all(store)


# -- crash safety ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["resident", "spilled"])
@pytest.mark.parametrize("length", [PS + 1, 2 * PS + 3, 1])
def test_crash_after_truncate_and_append_shows_the_last_commit(stores, seed, where: str, length: int) -> None:
    """Cutting into a committed page and writing over the cut must not touch its committed bytes."""
    pool = 8 if where == "resident" else 3
    path = stores.path()
    model = build_committed(path, {"a": 3 * PS, "b": 3 * PS}, seed, pool, evict_batch=1)
    committed = (dict(model.lens), {s: list(v) for s, v in model.segs.items()})
    store = pagedkv.open(path, evict_batch=1)
    cut(store, model, "a", length)
    store.append("a", *model.next_kv("a", 2 * PS))
    model.verify(store, "b")  # evicts a's rewritten pages: new records over the old uids, if any
    model.verify(store, "a")
    store._abandon()  # a crash: nothing since the last commit
    model.lens, model.segs = committed
    store = stores.open(geom=None, pool_pages=None)
    model.verify_all(store)
    assert store.check() == []


def test_sigkill_after_truncate_shows_the_last_commit(stores, seed) -> None:
    path = stores.path()
    model = build_committed(path, {"a": 3 * PS + 2, "b": 2 * PS}, seed, 3, evict_batch=1)
    committed = (dict(model.lens), {s: list(v) for s, v in model.segs.items()})

    def child(ack) -> None:
        store = pagedkv.open(path, evict_batch=1)
        cut(store, model, "a", PS + 2)
        store.append("a", *model.next_kv("a", 3 * PS))
        cut(store, model, "b", 1)
        store.append("b", *model.next_kv("b", PS))
        model.verify_all(store)
        ack("rewritten")

    assert run_until_killed(child) == ["rewritten"]
    model.lens, model.segs = committed
    store = stores.open(geom=None, pool_pages=None)
    model.verify_all(store)
    assert store.check() == []


def test_truncate_committed_then_crash_keeps_the_truncation(stores, seed) -> None:
    store = stores.open(pool_pages=3, evict_batch=1)
    model = Model(seed)
    filled(store, model, "a", 4 * PS + 1)
    store.commit()
    cut(store, model, "a", PS + 2)
    store.append("a", *model.next_kv("a", 1))
    store.commit()
    store.append("a", *model.next_kv("a", 5))  # uncommitted: the crash drops it
    store._abandon()
    model.undo("a", PS + 3)
    store = stores.open(geom=None, pool_pages=None)
    model.verify_all(store)
    assert store.check() == []


# -- the prefix cache ---------------------------------------------------------------------


def hashed(store: pagedkv.KVStore, seq: Any) -> list[bool]:
    """White-box: which pages of ``seq`` carry a prefix hash, now and in the last commit."""
    from pagedkv.pages.manager import HASHED

    mgr = store._mgr
    return [bool(mgr.flags[pid] & HASHED) for pid in store._seqs.find(seq).table.tolist()]


def token_lists(store: pagedkv.KVStore, seq: Any) -> list[list[int] | None]:
    """White-box: the token ids each page of ``seq`` records (from memory or the tokens table)."""
    mgr = store._mgr
    out = []
    for pid in store._seqs.find(seq).table.tolist():
        ids = mgr.page_tokens_of(pid)
        out.append(None if ids is None else [int(t) for t in ids])
    return out


def expected_lists(ids: Any, length: int) -> list[list[int] | None]:
    ids = [int(t) for t in ids[:length]]
    return [ids[at:at + PPS] for at in range(0, length, PPS)]


def test_truncate_into_a_hashed_page_keeps_it_as_cache(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 3 * PPS + 4)
    store = pstores.open()
    prefill(store, "a", ids)
    store.commit()
    assert hashed(store, "a") == [True, True, True, False]
    store.truncate("a", 2 * PPS + 3)  # into the hashed third page
    assert hashed(store, "a") == [True, True, False]
    assert token_lists(store, "a") == expected_lists(ids, 2 * PPS + 3)
    assert store.lookup(ids) == 3 * PPS  # the page cut into is still cached, whole
    assert index_problems(store) == [] and store.check() == []
    other = np.concatenate([ids[:2 * PPS + 3], prompt(rng, PPS + 2)])
    extend(store, "a", other[2 * PPS + 3:])
    assert_holds(store, "a", other)
    assert hashed(store, "a") == [True, True, True, False]
    assert store.lookup(other) == 3 * PPS and store.lookup(ids) == 3 * PPS
    for name, want in (("x", ids), ("y", other)):
        assert prefill(store, name, want) == 3 * PPS
        assert_holds(store, name, want)
    store = pstores.reopen(store)
    assert index_problems(store) == [] and store.check() == []
    assert hashed(store, "a") == [True, True, True, False]  # as the committed directory says
    assert store.lookup(ids) == 3 * PPS and store.lookup(other) == 3 * PPS
    for name, want in (("a", other), ("x", ids), ("y", other)):
        assert_holds(store, name, want)


@pytest.mark.parametrize("how", ["in-place", "copied"])
def test_truncated_partial_page_keeps_only_its_kept_token_ids(pstores, seed, how: str) -> None:
    """A partial page cut keeps only its kept ids; filled again, it hashes the new ids.

    In place: the cut falls after the page's committed tokens, so only uncommitted ones go.
    Copied: the cut falls inside its committed tokens, which must stay for a crash.
    """
    rng = np.random.default_rng(seed)
    ids = prompt(rng, PPS + 6)
    store = pstores.open()
    committed = PPS + 2 if how == "in-place" else PPS + 6
    prefill(store, "a", ids[:committed])
    store.commit()
    store = pstores.reopen(store)  # the partial page's ids now come from the tokens table
    extend(store, "a", ids[committed:])
    copies = store.stats()["cow_copies"]
    store.truncate("a", PPS + 3)
    assert store.stats()["cow_copies"] == copies + (how == "copied")
    assert token_lists(store, "a") == expected_lists(ids, PPS + 3)
    store.commit()
    store = pstores.reopen(store)
    assert token_lists(store, "a") == expected_lists(ids, PPS + 3)  # as the tokens table holds them
    new = np.concatenate([ids[:PPS + 3], prompt(rng, PPS + 1)])
    extend(store, "a", new[PPS + 3:])
    assert hashed(store, "a") == [True, True, False]
    assert store.lookup(new) == 2 * PPS
    assert store.lookup(np.concatenate([ids, prompt(rng, PPS)])) == PPS
    assert prefill(store, "b", new) == 2 * PPS
    assert_holds(store, "b", new)
    store = pstores.reopen(store)
    assert hashed(store, "a") == [True, True, False]
    assert store.lookup(new) == 2 * PPS
    assert_holds(store, "a", new)
    assert index_problems(store) == [] and store.check() == []


def test_truncate_to_a_page_boundary_keeps_the_kept_pages_hashed(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 4 * PPS)
    store = pstores.open()
    prefill(store, "a", ids)
    store.truncate("a", 2 * PPS)
    assert hashed(store, "a") == [True, True]
    assert store.lookup(ids) == 4 * PPS  # the cut pages stay as cache
    extend(store, "a", ids[2 * PPS:3 * PPS])
    assert store.stats()["pages"] == 5  # the recomputed third page is a duplicate of the cached one
    store.commit()
    store = pstores.reopen(store)
    assert store.lookup(ids) == 4 * PPS
    assert_holds(store, "a", ids[:3 * PPS])
    assert index_problems(store) == [] and store.check() == []


def test_truncate_uncommitted_hashed_page_then_crash(pstores, seed) -> None:
    """A page hashed since the last commit and cut: reopen after a crash indexes only committed pages."""
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 2 * PPS + 1)
    store = pstores.open(pool_pages=4, evict_batch=1)
    prefill(store, "a", ids[:PPS])
    store.commit()
    extend(store, "a", ids[PPS:])
    store.truncate("a", PPS + 3)
    store._abandon()
    store = pstores.open(geom=None, pool_pages=None)
    assert store.length("a") == PPS
    assert store.lookup(ids) == PPS
    assert index_problems(store) == [] and store.check() == []


@pytest.mark.parametrize("commit_first", [False, True], ids=["uncommitted", "first-page-committed"])
def test_truncate_into_a_page_hashed_since_the_last_commit(pstores, seed, commit_first: bool) -> None:
    """Cut into a page no commit recorded yet: it stays indexed whole, never as a partial page."""
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 2 * PPS + 1)
    store = pstores.open()
    prefill(store, "a", ids[:PPS])
    if commit_first:
        store.commit()
    extend(store, "a", ids[PPS:])
    store.truncate("a", PPS + 3)
    assert hashed(store, "a") == [True, False]
    assert index_problems(store) == [] and store.check() == []
    assert store.lookup(ids) == 2 * PPS
    assert prefill(store, "b", ids) == 2 * PPS
    assert_holds(store, "b", ids)
    assert_holds(store, "a", ids[:PPS + 3])
    store = pstores.reopen(store)
    assert index_problems(store) == [] and store.check() == []
    assert store.lookup(ids) == 2 * PPS
    assert_holds(store, "a", ids[:PPS + 3])
