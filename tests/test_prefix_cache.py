"""Prefix reuse: create(tokens=)/lookup, chained page hashes, cache pages, model identity, spill cap.

Geometry: 2 layers, 2 KV heads, head_dim 4, 8 tokens a page, float32 (``kits.prefix.GEOM``).
K/V are a function of (token id, position) unless a test says otherwise, so a page
served from the wrong prompt or the wrong position reads back as wrong bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pagedkv
import pagedkv.pages.prefix
from pagedkv import Geometry, ModelMismatch, PagedKVError, StoreClosed, StoreFull

from tests.kits.child import run_until_killed
from tests.kits.content import token_kv
from tests.kits.prefix import GEOM, PS, assert_holds, extend, index_problems, prefill, prompt
from tests.kits.store import engine_write



PAGE_BYTES = GEOM.layers * 2 * PS * GEOM.kv_heads * GEOM.head_dim * GEOM.itemsize
REPO = Path(__file__).resolve().parent.parent


def consistent(store: pagedkv.KVStore) -> None:
    assert store.check() == []
    assert index_problems(store) == []


# -- one set of pages for one prompt; reopen; crash -------------------------------------


def test_same_prompt_shares_one_set_of_full_pages(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 1001)
    store = pstores.open(pool_pages=64)
    assert prefill(store, "a", ids) == 0
    assert store.stats()["pages"] == 126
    assert store.lookup(ids) == 1000  # lookup may report every full page
    assert prefill(store, "b", ids) == 1000  # create leaves the last token to compute
    st = store.stats()
    assert st["pages"] == 127 and st["shared_pages"] == 125 and st["cow_copies"] == 0
    assert (st["prefix_query_tokens"], st["prefix_hit_tokens"], st["prefix_hit_pages"]) == (2002, 1000, 125)
    assert st["prefix_hit_rate"] == pytest.approx(1000 / 2002)
    assert_holds(store, "a", ids)
    assert_holds(store, "b", ids)
    store.commit()
    shared = store.stats()
    assert shared["pool_used"] + shared["spilled_pages"] == 127

    # the same two sequences without prefix reuse: twice the pages, in pool and spill
    base = pstores.open("baseline", pool_pages=64)
    for seq in ("a", "b"):
        base.create(seq)
        extend(base, seq, ids)
    base.commit()
    alone = base.stats()
    assert alone["pages"] == 252 and alone["shared_pages"] == 0
    assert alone["pool_used"] + alone["spilled_pages"] == 252
    assert shared["pool_used"] <= 64 and alone["pool_used"] <= 64
    saved = alone["spilled_pages"] - shared["spilled_pages"]
    assert saved >= 125 - 64  # at least the shared pages that the pool could not hold
    assert alone["spill_bytes"] - shared["spill_bytes"] >= saved * PAGE_BYTES
    # after a commit, spill holds one record per spilled page and nothing else
    for st in (shared, alone):
        assert st["spilled_pages"] * PAGE_BYTES < st["spill_bytes"] < st["spilled_pages"] * (PAGE_BYTES + 128)
    consistent(base)
    base.close()

    store = pstores.reopen(store)
    assert store.stats()["pages"] == 127
    assert store.lookup(ids) == 1000
    assert store.create("c", tokens=ids) == 1000
    assert_holds(store, "c", ids, 0, 1000)
    extend(store, "c", ids[1000:])
    assert_holds(store, "c", ids)
    # a prompt of whole pages reuses all but its last page
    aligned = ids[:1000]
    assert store.lookup(aligned) == 1000
    assert store.create("d", tokens=aligned) == 992
    extend(store, "d", aligned[992:])
    assert_holds(store, "d", aligned)
    st = store.stats()
    assert st["pages"] == 129 and st["prefix_hit_tokens"] == 1992 and st["cow_copies"] == 0
    consistent(store)


def test_cache_survives_sigkill_after_commit(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids, other, late = prompt(rng, 1001), prompt(rng, 43), prompt(rng, 24)
    path = pstores.path("crash")

    def child(ack) -> None:
        store = pagedkv.open(path, GEOM, 64)
        assert prefill(store, "a", ids) == 0
        assert prefill(store, "b", ids) == 1000
        prefill(store, "d", other)
        store.drop("d")  # its 5 full pages stay as cache
        store.commit()
        ack("committed")
        # uncommitted work the crash must discard
        store.drop("a")
        prefill(store, "z", late)
        extend(store, "b", late)

    assert run_until_killed(child) == ["committed"]
    store = pstores.open("crash", None, None)
    assert sorted(store.sequences()) == ["a", "b"]
    assert_holds(store, "a", ids)
    assert_holds(store, "b", ids)
    st = store.stats()
    assert st["cached_pages"] == 5 and st["pages"] == 127 + 5 and st["shared_pages"] == 125
    assert store.lookup(ids) == 1000
    assert store.lookup(other) == 40
    assert store.lookup(late) == 0  # sealed only in the dead process
    assert store.create("c", tokens=ids) == 1000
    assert_holds(store, "c", ids, 0, 1000)
    extend(store, "c", ids[1000:])
    assert_holds(store, "c", ids)
    assert prefill(store, "e", other) == 40
    assert_holds(store, "e", other)
    assert store.create("f", tokens=ids[:1000]) == 992  # whole pages: all but the last reused
    assert_holds(store, "f", ids, 0, 992)
    consistent(store)


# -- page boundaries and the token left to compute -----------------------------------------


@pytest.mark.parametrize("source", ["live", "dropped"])
@pytest.mark.parametrize("length", [0, 1, PS - 1, PS, PS + 1, 2 * PS - 1, 2 * PS, 2 * PS + 1,
                                    3 * PS - 1, 3 * PS, 3 * PS + 1])
def test_prompt_at_page_boundaries(pstores, length: int, source: str) -> None:
    ids = prompt(np.random.default_rng(length), length)
    store = pstores.open(pool_pages=8)
    assert prefill(store, "src", ids) == 0
    if source == "dropped":
        store.drop("src")
    full = length // PS * PS
    reused = (length - 1) // PS * PS if length else 0
    assert store.lookup(ids) == full
    assert store.create("b", tokens=ids) == reused
    assert store.length("b") == reused
    extend(store, "b", ids[reused:])
    assert_holds(store, "b", ids)
    src_pages = -(-length // PS) if source == "live" else full // PS
    assert store.stats()["pages"] == src_pages + -(-length // PS) - reused // PS
    assert store.stats()["cached_pages"] == ((full - reused) // PS if source == "dropped" else 0)
    for cut in range(length + 1):  # every prefix of the prompt
        assert store.lookup(ids[:cut]) == cut // PS * PS
    longer = np.concatenate([ids, prompt(np.random.default_rng(99), 5)])
    assert store.lookup(longer) == full
    assert store.create("c", tokens=longer) == full
    consistent(store)


def test_full_prefix_hit_still_leaves_one_token(pstores) -> None:
    ids = prompt(np.random.default_rng(7), 4 * PS + 1)
    store = pstores.open()
    prefill(store, "src", ids)
    for cut in range(1, len(ids) + 1):
        reused = store.create(f"q{cut}", tokens=ids[:cut])
        assert reused <= cut - 1, (cut, reused)
        assert reused == (cut - 1) // PS * PS
        store.drop(f"q{cut}")
    assert store.create("empty", tokens=[]) == 0 and store.lookup([]) == 0
    assert store.create("one", tokens=ids[:1]) == 0
    consistent(store)


# -- hash collisions -------------------------------------------------------------------------

_REAL_CHAIN_HASH = pagedkv.pages.prefix.chain_hash


def _constant_hash(parent: bytes, salt: bytes, token_ids: np.ndarray) -> bytes:
    return bytes(16)


def _one_bit_hash(parent: bytes, salt: bytes, token_ids: np.ndarray) -> bytes:
    return bytes([int(np.asarray(token_ids, np.int64).sum()) & 1]) * 16


@pytest.mark.parametrize("weak", [_constant_hash, _one_bit_hash], ids=["constant", "one-bit"])
def test_forced_collisions_never_share_pages_with_other_token_ids(pstores, monkeypatch, seed, weak) -> None:
    """The bar: a page is shared only if its token ids are the prompt's (K/V here depend on ids only)."""
    monkeypatch.setattr(pagedkv.pages.prefix, "chain_hash", weak)
    rng = np.random.default_rng(seed)
    # chunks that differ in a single token, so colliding pages with other ids abound
    base = prompt(rng, PS, vocab=4)
    chunks = []
    for i in range(6):
        chunk = base.copy()
        chunk[i % PS] = (chunk[i % PS] + 1 + i // PS) % 4
        chunks.append(chunk)
    chunks.append(base)
    store = pstores.open(pool_pages=8)
    hits = 0
    for r in range(60):
        parts = [chunks[i] for i in rng.integers(0, len(chunks), int(rng.integers(1, 5)))]
        ids = np.concatenate(parts + [prompt(rng, int(rng.integers(0, PS)), vocab=4)])
        hits += prefill(store, r, ids, positional=False)
        assert_holds(store, r, ids, positional=False)
        if rng.random() < 0.5:
            store.drop(r)
    assert hits > 0  # sharing happened, so the check above was not vacuous
    assert store.stats()["prefix_hit_tokens"] == hits
    consistent(store)


def test_constant_hash_shares_only_matching_ids(pstores, monkeypatch) -> None:
    monkeypatch.setattr(pagedkv.pages.prefix, "chain_hash", _constant_hash)
    rng = np.random.default_rng(5)
    first = prompt(rng, 3 * PS + 3)
    store = pstores.open()
    prefill(store, "a", first)
    other = prompt(rng, 3 * PS + 3)
    assert store.lookup(other) == 0 and prefill(store, "b", other) == 0
    assert_holds(store, "b", other)
    half = np.concatenate([first[:PS], other[PS:]])  # page 0 matches, the rest collide
    assert store.lookup(half) == PS and prefill(store, "c", half) == PS
    assert_holds(store, "c", half)
    # Every page collides with every other; ids and chain classes still find first's own pages.
    assert store.lookup(first) == 3 * PS and prefill(store, "d", first) == 3 * PS
    assert_holds(store, "d", first)
    consistent(store)


def _parent_blind_hash(parent: bytes, salt: bytes, token_ids: np.ndarray) -> bytes:
    return _REAL_CHAIN_HASH(pagedkv.pages.prefix.ROOT, salt, token_ids)


@pytest.mark.parametrize("case", ["constant-repeated-page", "parent-blind"])
def test_forced_collision_never_serves_kv_of_another_position_or_prefix(pstores, monkeypatch, case) -> None:
    """Stricter than the bar: equal token ids after another prefix (or at another position) are
    other KV; a collision of the chained hash must not serve them either."""
    rng = np.random.default_rng(11)
    x, y, z = prompt(rng, PS), prompt(rng, PS), prompt(rng, PS)
    store = pstores.open()
    if case == "constant-repeated-page":
        monkeypatch.setattr(pagedkv.pages.prefix, "chain_hash", _constant_hash)
        cached, query = np.concatenate([x, x, x, z[:3]]), np.concatenate([x, x, x, y[:3]])
        expected = 3 * PS  # x x x after the same prefix: the cached pages, found through the collisions
    else:
        monkeypatch.setattr(pagedkv.pages.prefix, "chain_hash", _parent_blind_hash)
        cached, query = np.concatenate([y, x, z[:3]]), np.concatenate([x, z, y[:3]])
        expected = 0  # x was only ever computed after y
    prefill(store, "cached", cached)
    reused = prefill(store, "query", query)
    assert_holds(store, "query", query)  # never the page of another position or prefix
    assert reused == expected
    consistent(store)


# -- fork and copy-on-write --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["append", "step"])
def test_fork_then_divergent_appends_copy_once(pstores, seed, how: str) -> None:
    rng = np.random.default_rng(seed)
    base, ta, tb = prompt(rng, PS + 5), prompt(rng, 7), prompt(rng, 7)
    store = pstores.open()
    prefill(store, "a", base)
    store.fork("a", "b")
    assert store.stats()["shared_pages"] == 2
    if how == "append":
        extend(store, "a", ta)
        extend(store, "b", tb)
    else:
        with store.step({"a": 7, "b": 7}, tokens={"a": ta, "b": tb}) as step:
            engine_write(store, step, [token_kv(ta, len(base), GEOM), token_kv(tb, len(base), GEOM)])
    st = store.stats()
    assert st["cow_copies"] == 1 and st["pages"] == 5 and st["shared_pages"] == 1
    seq_a, seq_b = np.concatenate([base, ta]), np.concatenate([base, tb])
    assert_holds(store, "a", seq_a)
    assert_holds(store, "b", seq_b)
    # both branches are reusable prefixes of their own
    assert store.lookup(seq_a) == store.lookup(seq_b) == 2 * PS
    assert prefill(store, "c", seq_b) == 2 * PS
    assert_holds(store, "c", seq_b)
    more = prompt(rng, 2 * PS)
    extend(store, "a", more)
    extend(store, "b", more)
    assert store.stats()["cow_copies"] == 1
    assert_holds(store, "a", np.concatenate([seq_a, more]))
    assert_holds(store, "b", np.concatenate([seq_b, more]))
    consistent(store)


# -- cache pages that outlive their sequences ----------------------------------------------------


@pytest.mark.parametrize("committed", [False, True], ids=["uncommitted", "committed"])
def test_cached_pages_outlive_their_sequence(pstores, seed, committed: bool) -> None:
    rng = np.random.default_rng(seed)
    ids, fill_ids = prompt(rng, 3 * PS + 5), prompt(rng, 8 * PS)
    store = pstores.open(pool_pages=8)
    prefill(store, "a", ids)
    if committed:
        store.commit()
    store.drop("a")
    st = store.stats()
    # the three hashed pages stay as cache; the partial page is recycled at once
    assert (st["pages"], st["cached_pages"], st["sequences"], st["pool_used"]) == (3, 3, 0, 3)
    assert st["pool_pending"] == (1 if committed else 0)  # committed bytes wait for the next commit
    store.commit()
    st = store.stats()
    assert (st["pool_used"], st["pool_free"], st["pool_pending"]) == (3, 5, 0)
    assert store.lookup(ids) == 3 * PS
    # other work pushes the cache pages out to spill, like any least recently used page
    prefill(store, "filler", fill_ids)
    st = store.stats()
    assert st["cached_pages"] == 3 and st["spilled_pages"] >= 3 and st["pages"] == 11
    restores = st["restores"]
    assert store.create("c", tokens=ids) == 3 * PS
    assert_holds(store, "c", ids, 0, 3 * PS)
    assert store.stats()["restores"] - restores >= 3  # they came back from spill
    extend(store, "c", ids[3 * PS:])
    assert_holds(store, "c", ids)
    store.drop("c")
    store.drop("filler")
    assert store.stats()["cached_pages"] == 11
    consistent(store)
    store = pstores.reopen(store)
    st = store.stats()
    assert (st["cached_pages"], st["pages"], st["sequences"]) == (11, 11, 0)
    assert store.lookup(ids) == 3 * PS and store.lookup(fill_ids) == 8 * PS
    assert prefill(store, "again", ids) == 3 * PS
    assert_holds(store, "again", ids)
    consistent(store)


def test_partial_page_completed_after_reopen_is_registered(pstores) -> None:
    """A committed partial page that fills after a reopen must become a reusable prefix page."""
    ids = prompt(np.random.default_rng(3), 2 * PS)
    store = pstores.open()
    prefill(store, "a", ids[:5])
    store = pstores.reopen(store)
    extend(store, "a", ids[5:])
    assert_holds(store, "a", ids)
    assert store.lookup(ids) == 2 * PS  # the completed page was hashed
    consistent(store)


def test_partial_page_completed_by_step_after_reopen_is_registered(pstores) -> None:
    ids = prompt(np.random.default_rng(4), 2 * PS)
    store = pstores.open()
    prefill(store, "a", ids[:5])
    store = pstores.reopen(store)
    with store.step({"a": len(ids) - 5}, tokens={"a": ids[5:]}) as step:
        engine_write(store, step, [token_kv(ids[5:], 5, GEOM)])
    assert_holds(store, "a", ids)
    assert store.lookup(ids) == 2 * PS  # the completed page was hashed
    consistent(store)


def test_stale_hash_mapping_after_page_reuse_never_serves_wrong_kv(pstores, seed) -> None:
    """nano-vllm #163: a page dropped from the cache, its row reused for other content."""
    rng = np.random.default_rng(seed)
    first = prompt(rng, 2 * PS + 3)
    store = pstores.open(pool_pages=4, evict_batch=1, spill_limit_bytes=4 * (PAGE_BYTES + 128))
    prefill(store, "a", first)
    store.drop("a")
    store.commit()
    old_rows = set(store._mgr.prefix.pages().tolist())
    reused_rows = False
    for r in range(12):  # newer cached prompts push the old ones out of the cache
        prefill(store, r, np.concatenate([first[:PS] if r % 3 == 0 else prompt(rng, PS),
                                          prompt(rng, 2 * PS + 1)]))
        store.drop(r)
        store.commit()
        reused_rows |= bool(old_rows & set(store._mgr.prefix.pages().tolist()))
        assert index_problems(store) == []
        assert store.stats()["spill_bytes"] <= 4 * (PAGE_BYTES + 128)
    assert store.stats()["cache_drops"] > 0 and reused_rows
    cached = store.lookup(first)
    assert prefill(store, "b", first) == min(cached, 2 * PS)
    assert_holds(store, "b", first)
    store = pstores.reopen(store)
    cached = store.lookup(first)
    assert prefill(store, "c", first) == cached
    assert_holds(store, "c", first)
    consistent(store)


# -- steps ----------------------------------------------------------------------------------------


def test_step_tokens_register_filled_pages(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids, plain = prompt(rng, 5 * PS), prompt(rng, 3 * PS)
    store = pstores.open()
    store.create("a", tokens=ids)
    store.create("n")
    with store.step({"a": 13, "n": 2 * PS}, tokens={"a": ids[:13]}) as step:  # "n" brings no ids
        engine_write(store, step, [token_kv(ids[:13], 0, GEOM), token_kv(plain[:2 * PS], 0, GEOM)])
    assert store.lookup(ids) == PS  # sealed when the step ended
    assert store.lookup(plain) == 0
    for pos in range(13, len(ids)):  # decode one token a step
        with store.step({"a": 1}, tokens={"a": ids[pos:pos + 1]}) as step:
            engine_write(store, step, [token_kv(ids[pos:pos + 1], pos, GEOM)])
        assert store.lookup(ids) == (pos + 1) // PS * PS
    assert_holds(store, "a", ids)
    assert store.create("b", tokens=ids) == 4 * PS
    assert_holds(store, "b", ids, 0, 4 * PS)
    store = pstores.reopen(store)
    assert store.lookup(ids) == 5 * PS and store.lookup(plain) == 0
    consistent(store)


@pytest.mark.parametrize("start", [0, 5, PS])
def test_failed_step_registers_nothing(pstores, seed, start: int) -> None:
    rng = np.random.default_rng(seed)
    ids, alt = prompt(rng, 3 * PS), prompt(rng, 3 * PS)
    alt[:start] = ids[:start]
    store = pstores.open()
    prefill(store, "a", ids[:start])
    before = store.stats()
    with pytest.raises(RuntimeError):
        with store.step({"a": len(ids) - start}, tokens={"a": ids[start:]}) as step:
            engine_write(store, step, [token_kv(ids[start:], start, GEOM)])
            raise RuntimeError("the engine failed")
    after = store.stats()
    assert store.length("a") == start
    assert (after["pages"], after["cached_pages"]) == (before["pages"], before["cached_pages"])
    assert store.lookup(ids) == start // PS * PS
    assert store.create("probe", tokens=ids) == start // PS * PS
    store.drop("probe")
    # the same positions, now with other ids, succeed and only they are registered
    with store.step({"a": len(alt) - start}, tokens={"a": alt[start:]}) as step:
        engine_write(store, step, [token_kv(alt[start:], start, GEOM)])
    assert store.lookup(alt) == len(alt)
    assert store.lookup(ids) == start // PS * PS
    assert_holds(store, "a", alt)
    store = pstores.reopen(store)
    assert store.lookup(ids) == start // PS * PS and store.lookup(alt) == len(alt)
    consistent(store)


# -- model identity ---------------------------------------------------------------------------------


def test_model_fingerprint_guards_the_cache(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids, other = prompt(rng, 5 * PS), prompt(rng, 3 * PS)
    store = pstores.open("m", pool_pages=4, model="m1")
    prefill(store, "a", ids, model="m1")
    prefill(store, "d", other, model="m1")
    store.drop("d")
    assert store.stats()["spilled_pages"] > 0  # old KV in spill too
    store.close()
    path = pstores.path("m")
    for kwargs in ({}, {"readonly": True}, {"readonly": True, "allow_model_change": True}):
        with pytest.raises(ModelMismatch) as info:
            pagedkv.open(path, model="m2", **kwargs)
        assert isinstance(info.value, PagedKVError) and "m1" in str(info.value)
    store = pstores.open("m", None, None)  # model=None: the stored one
    assert store.model == "m1" and store.lookup(ids) == 5 * PS and store.lookup(other) == 3 * PS
    store.close()
    store = pstores.open("m", None, None, model="m1")
    assert store.lookup(ids) == 5 * PS
    store.close()

    store = pstores.open("m", None, None, model="m2", allow_model_change=True)
    assert store.model == "m2"
    assert store.lookup(ids) == 0 and store.lookup(other) == 0  # the old cache is never served
    assert prefill(store, "b", ids, model="m2") == 0
    assert_holds(store, "b", ids, model="m2")
    assert prefill(store, "c", ids, model="m2") == 4 * PS
    assert_holds(store, "c", ids, model="m2")
    assert_holds(store, "a", ids, model="m1")  # the old sequence still reads its own bytes
    consistent(store)
    store.close()
    with pytest.raises(ModelMismatch):
        pagedkv.open(path, model="m1")
    store = pstores.open("m", None, None)
    assert store.model == "m2" and store.lookup(other) == 0
    assert prefill(store, "e", ids, model="m2") == 4 * PS
    assert_holds(store, "e", ids, model="m2")
    consistent(store)


# -- determinism across processes -------------------------------------------------------------------

_CHILD = """
import json, sys
import numpy as np
import pagedkv
from pagedkv.pages.prefix import ROOT, chain_hash, make_salt
path, mode, ids = sys.argv[1], sys.argv[2], np.array(json.loads(sys.argv[3]), np.int64)
store = pagedkv.open(path, readonly=mode == "read")
salt = make_salt(store.superblock.get("salt", b""), store.model)
out = {"lookup": store.lookup(ids), "hash": chain_hash(ROOT, salt, ids[:8]).hex()}
if mode == "write":
    out["create"] = store.create("x", tokens=ids)
store.close()
print(json.dumps(out))
"""


def _in_child(path: Path, mode: str, ids: np.ndarray) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="4242")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode, json.dumps(ids.tolist())],
                         capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_lookup_and_create_agree_across_processes(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 12 * PS + 3)
    store = pstores.open(model="fp")
    prefill(store, "a", ids)
    store.commit()
    salt = pagedkv.pages.prefix.make_salt(store.superblock["salt"], "fp")
    mine = pagedkv.pages.prefix.chain_hash(pagedkv.pages.prefix.ROOT, salt, ids[:PS]).hex()
    reader = _in_child(store.path, "read", ids)  # beside the open writer
    assert reader == {"lookup": 12 * PS, "hash": mine}
    store = pstores.reopen(store)
    store.close()
    writer = _in_child(store.path, "write", ids)
    assert writer == {"lookup": 12 * PS, "hash": mine, "create": 12 * PS}
    store = pstores.open(geom=None, pool_pages=None)
    assert store.length("x") == 12 * PS
    assert_holds(store, "x", ids, 0, 12 * PS)
    assert store.stats()["shared_pages"] == 12
    consistent(store)


# -- the spill cap ----------------------------------------------------------------------------------


def _record_bytes(pstores) -> int:
    """The size of one spilled page record of GEOM (measured, not assumed)."""
    store = pstores.open("calibrate", pool_pages=4, durability="volatile")
    prefill(store, "a", prompt(np.random.default_rng(0), 12 * PS))
    st = store.stats()
    store.close()
    assert st["spilled_pages"] >= 8
    return round(st["spill_bytes"] / st["spilled_pages"])


def test_spill_cap_holds_under_ten_times_the_cap(pstores, seed) -> None:
    rng = np.random.default_rng(seed)
    cap = 40 * (PAGE_BYTES + 64)
    store = pstores.open(pool_pages=16, spill_limit_bytes=cap, durability="nosync")
    seen = [0]

    def under_cap() -> None:
        spill = store.stats()["spill_bytes"]
        seen[0] = max(seen[0], spill)
        assert spill <= cap

    systems = [prompt(rng, int(rng.integers(2 * PS, 3 * PS))) for _ in range(4)]
    live = {f"live{i}": prompt(rng, int(rng.integers(2 * PS, 4 * PS))) for i in range(3)}
    for seq, ids in live.items():
        prefill(store, seq, ids)
        under_cap()
    store.commit()
    written, hits, r = 0, 0, 0
    while written < 10 * cap:
        ids = np.concatenate([systems[r % 4], prompt(rng, int(rng.integers(1, 4 * PS)))])
        reused = store.create(r, tokens=ids)
        under_cap()
        extend(store, r, ids[reused:], reused)
        under_cap()
        written += (len(ids) - reused) * PAGE_BYTES // PS
        hits += reused
        if r % 5 == 0:
            assert_holds(store, r, ids)
            under_cap()
        if r % 7 == 0:
            seq = f"live{r % 3}"
            assert_holds(store, seq, live[seq])  # restores: the live pages were spilled, not lost
            under_cap()
        store.drop(r)
        store.commit()
        under_cap()
        r += 1
    st = store.stats()
    data_mdb = os.path.getsize(pstores.path() / "spill" / "data.mdb")
    print(f"spill cap {cap} B, max spill_bytes {seen[0]} B, appended {written} B, requests {r}, "
          f"cache drops {st['cache_drops']}, bytes spilled {st['bytes_spilled']}, hit rate "
          f"{st['prefix_hit_rate']:.2f}, data.mdb {data_mdb} B (1 KiB pages: B-tree overhead dominates)")
    assert hits > 0 and st["cache_drops"] > 0 and st["bytes_spilled"] >= 5 * cap
    for seq, ids in live.items():
        assert_holds(store, seq, ids)
    under_cap()
    consistent(store)
    store.commit()
    spill = store.stats()["spill_bytes"]
    store = pstores.reopen(store, spill_limit_bytes=cap)
    assert store.stats()["spill_bytes"] == spill  # the accounting matches the records on disk
    for seq, ids in live.items():
        assert_holds(store, seq, ids)
    consistent(store)


def test_spill_cap_lmdb_file_at_a_realistic_size(pstores, seed) -> None:
    geom = Geometry(layers=8, kv_heads=4, head_dim=64, page_size=16, dtype="float16")  # 128 KiB pages
    page_bytes = geom.layers * 2 * geom.page_size * geom.kv_heads * geom.head_dim * geom.itemsize
    cap = 32 * page_bytes  # 4 MiB
    rng = np.random.default_rng(seed)
    store = pstores.open("real", geom, 16, spill_limit_bytes=cap, durability="nosync")
    data_mdb = pstores.path("real") / "spill" / "data.mdb"
    keep = prompt(rng, 10 * 16 + 5)
    prefill(store, "keep", keep)
    systems = [prompt(rng, 16 * int(rng.integers(2, 5))) for _ in range(3)]
    written, max_spill, max_file, r = 0, 0, 0, 0
    while written < 10 * cap:
        ids = np.concatenate([systems[r % 3], prompt(rng, int(rng.integers(1, 6 * 16)))])
        reused = store.create(r, tokens=ids)
        extend(store, r, ids[reused:], reused)
        written += (len(ids) - reused) * page_bytes // geom.page_size
        max_spill = max(max_spill, store.stats()["spill_bytes"])
        assert max_spill <= cap
        store.drop(r)
        store.commit()
        max_spill = max(max_spill, store.stats()["spill_bytes"])
        assert max_spill <= cap
        max_file = max(max_file, os.path.getsize(data_mdb))
        r += 1
    factor = max_file / cap
    print(f"realistic spill cap: page {page_bytes} B, cap {cap} B, appended {written} B, "
          f"max spill_bytes {max_spill} B, max data.mdb {max_file} B, factor {factor:.2f}")
    assert_holds(store, "keep", keep)
    assert factor <= 2.0
    consistent(store)


@pytest.mark.parametrize("evict_batch,cache", [(1, False), (64, False), (1, True)],
                         ids=["batch1", "default-batch", "batch1-resident-cache"])
def test_spill_cap_storefull_only_when_live_set_exceeds_it(pstores, evict_batch: int, cache: bool) -> None:
    rec = _record_bytes(pstores)
    fits = 5  # spilled records the cap holds (odd: a batch of 2 overshoots it)
    cap = fits * rec + rec // 2
    pool = 8
    batch = max(1, min(evict_batch, pool // 4))  # the store's effective eviction batch
    ids = prompt(np.random.default_rng(1), 40 * PS)
    store = pstores.open(pool_pages=pool, evict_batch=evict_batch, spill_limit_bytes=cap)
    store.create("L")
    extend(store, "L", ids[:(pool - 1) * PS])
    if cache:  # a cache-only page, resident and more recently used than L's pages
        prefill(store, "c", prompt(np.random.default_rng(2), PS))
        store.drop("c")
    store.commit()
    committed = store.length("L")
    raised_at = None
    for pages in range(pool, 40):
        need = pages - pool  # records the live set alone must hold in spill
        try:
            extend(store, "L", ids[(pages - 1) * PS:pages * PS])
        except StoreFull:
            raised_at = need
            break
        assert store.stats()["spill_bytes"] <= cap + batch * (rec + 16)  # the cap plus one batch
        store.commit()
        committed = pages * PS
    assert raised_at is not None, "the live set outgrew the cap without StoreFull"
    assert raised_at > fits, (f"StoreFull with the live set needing {raised_at} records of "
                              f"{rec} B and a cap of {cap} B ({fits} records)")
    with pytest.raises(StoreClosed):  # the handle is poisoned; the last commit is intact
        store.create("x")
    store._abandon()
    store = pstores.open(geom=None, pool_pages=None)
    assert store.length("L") == committed
    assert_holds(store, "L", ids[:committed])
    consistent(store)


def test_spill_cap_drops_a_resident_cache_page_before_spilling_past_the_cap(pstores) -> None:
    """A cache-only page in the pool costs nothing to drop: the cap need not be overshot for a live page."""
    rec = _record_bytes(pstores)
    cap = 5 * rec + rec // 2
    ids = prompt(np.random.default_rng(1), 13 * PS)
    store = pstores.open(pool_pages=8, evict_batch=1, spill_limit_bytes=cap)
    store.create("L")
    extend(store, "L", ids[:7 * PS])
    prefill(store, "c", prompt(np.random.default_rng(2), PS))
    store.drop("c")  # resident, more recently used than L's first pages
    store.commit()
    for pages in range(8, 14):  # the live set needs 5 records at most: it fits
        extend(store, "L", ids[(pages - 1) * PS:pages * PS])
        store.commit()
        st = store.stats()
        assert st["spill_bytes"] <= cap, (f"{st['spill_bytes']} B spilled over a cap of {cap} B with "
                                          f"{st['cached_pages']} droppable cache page(s) in the pool")
    assert_holds(store, "L", ids)
    consistent(store)


@pytest.mark.parametrize("evict_batch", [1, 64], ids=["batch1", "default-batch"])
@pytest.mark.parametrize("reopen", [False, True], ids=["after-commit", "after-reopen"])
def test_spill_cap_reading_a_live_set_that_fits_never_raises(pstores, reopen: bool, evict_batch: int) -> None:
    """The live set needs 5 records and the cap holds 5: reading it back must work, and at rest
    (after a commit) the spill holds one record per spilled page, under the cap."""
    rec = _record_bytes(pstores)
    cap = 5 * rec + rec // 2
    ids = prompt(np.random.default_rng(1), 13 * PS)
    store = pstores.open(pool_pages=8, evict_batch=evict_batch, spill_limit_bytes=cap)
    store.create("L")
    extend(store, "L", ids)
    store.commit()
    assert store.stats()["spilled_pages"] == 5 and store.stats()["spill_bytes"] <= cap
    if reopen:
        store = pstores.reopen(store, spill_limit_bytes=cap, evict_batch=evict_batch)
    for _ in range(3):
        assert_holds(store, "L", ids)  # a swap may overshoot by the pages it moves, never raise
        store.commit()
        st = store.stats()
        assert (st["spilled_pages"], st["pool_used"]) == (5, 8), "a page spilled beside a free slot"
        assert st["spill_bytes"] <= cap
    consistent(store)


# -- a randomised model of what the cache holds ------------------------------------------------------


def test_random_workload_matches_prefix_model(pstores, seed) -> None:
    """create/lookup equal a plain model: every full-page prefix ever written (no cap: none leave)."""
    rng = np.random.default_rng(seed)
    store = pstores.open(pool_pages=12, durability="nosync")
    roots = [prompt(rng, 4 * PS) for _ in range(3)]
    seqs: dict[str, np.ndarray] = {}
    cached: set[bytes] = set()
    names = iter(range(10**6))

    def remember(ids: np.ndarray) -> None:
        for end in range(PS, len(ids) + 1, PS):
            cached.add(ids[:end].tobytes())

    def expect(ids: np.ndarray, limit: int) -> int:
        end = 0
        while end + PS <= limit and ids[:end + PS].tobytes() in cached:
            end += PS
        return end

    for _ in range(400):
        op = rng.random()
        if op < 0.35 or not seqs:
            if seqs and rng.random() < 0.4:
                donor = seqs[list(seqs)[int(rng.integers(len(seqs)))]]
                head = donor[:int(rng.integers(0, len(donor) + 1))]
            else:
                head = roots[int(rng.integers(3))][:int(rng.integers(0, 4 * PS + 1))]
            ids = np.concatenate([head, prompt(rng, int(rng.integers(0, 2 * PS)))]).astype(np.int64)
            seq = f"s{next(names)}"
            assert store.lookup(ids) == expect(ids, len(ids))
            assert prefill(store, seq, ids) == expect(ids, max(len(ids) - 1, 0))
            seqs[seq] = ids
            remember(ids)
        elif op < 0.55:
            chosen = [s for s in seqs if rng.random() < 0.5] or [next(iter(seqs))]
            new = {s: prompt(rng, int(rng.integers(0, PS + 3))) for s in chosen}
            if not store.can_step({s: len(t) for s, t in new.items()}):
                continue
            fail = rng.random() < 0.25
            try:
                with store.step({s: len(t) for s, t in new.items()}, tokens=new) as step:
                    engine_write(store, step, [token_kv(t, len(seqs[s]), GEOM) for s, t in new.items()])
                    if fail:
                        raise RuntimeError("engine failure")
            except RuntimeError:
                assert fail
            else:
                for s, t in new.items():
                    seqs[s] = np.concatenate([seqs[s], t])
                    remember(seqs[s])
        elif op < 0.7:
            seq = list(seqs)[int(rng.integers(len(seqs)))]
            tail = prompt(rng, int(rng.integers(1, 2 * PS)))
            extend(store, seq, tail)
            seqs[seq] = np.concatenate([seqs[seq], tail])
            remember(seqs[seq])
        elif op < 0.8:
            src, dst = list(seqs)[int(rng.integers(len(seqs)))], f"s{next(names)}"
            store.fork(src, dst)
            seqs[dst] = seqs[src].copy()
        elif op < 0.9:
            seq = list(seqs)[int(rng.integers(len(seqs)))]
            store.drop(seq)
            del seqs[seq]
        elif op < 0.95:
            seq = list(seqs)[int(rng.integers(len(seqs)))]
            assert_holds(store, seq, seqs[seq])
        else:
            store.commit()
    for seq, ids in seqs.items():
        assert_holds(store, seq, ids)
    consistent(store)


# -- inputs ----------------------------------------------------------------------------------------


def test_lookup_creates_nothing_and_token_ids_are_validated(pstores) -> None:
    ids = prompt(np.random.default_rng(8), 2 * PS + 1)
    store = pstores.open()
    prefill(store, "a", ids)
    before = store.stats()
    assert store.lookup(ids) == 2 * PS
    after = store.stats()
    assert store.sequences() == ["a"] and after["pages"] == before["pages"]
    assert after["prefix_query_tokens"] == before["prefix_query_tokens"]  # lookups are not queries
    k, v = token_kv(ids[:2], 0, GEOM)
    for bad in ([[1, 2]], [-1], [1 << 32], [1.5], "ab"):
        with pytest.raises(PagedKVError):
            store.lookup(bad)
        with pytest.raises(PagedKVError):
            store.create("bad", tokens=bad)
    with pytest.raises(PagedKVError):
        store.append("a", k, v, tokens=[1, 2, 3])  # 3 ids for 2 tokens
    assert store.sequences() == ["a"] and store.length("a") == len(ids)
    consistent(store)
    store.close()
    reader = pagedkv.open(store.path, readonly=True)
    try:
        assert reader.lookup(ids) == 2 * PS
        assert reader.check() == []
    finally:
        reader.close()
