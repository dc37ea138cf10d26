"""Paged attention (pagedkv.attention) against dense attention over ``read()``'s K/V.

Stores here use a small pool and short pages, so sequences end with partial pages and
their pages lie scattered over the pool after interleaved appends, evictions and
restores; the reference is float64 dense attention with the same GQA head mapping.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pagedkv
from pagedkv import Geometry, PagedKVError
from pagedkv.attention import paged_attention, paged_prefill_attention

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def dense(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention of the last ``len(q)`` positions over ``k``/``v`` ``(T, kv_heads, dim)``."""
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k64, v64 = np.repeat(k64, groups, axis=1), np.repeat(v64, groups, axis=1)  # head h -> h // groups
    scores = np.einsum("qhd,thd->hqt", q64, k64) * scale
    first = len(k) - len(q)
    scores[:, np.arange(len(k))[None, :] > first + np.arange(len(q))[:, None]] = -np.inf
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    return np.einsum("hqt,thd->qhd", scores, v64)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def random_kv(rng: np.random.Generator, geom: Geometry, n: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (geom.layers, n, geom.kv_heads, geom.head_dim)
    return (rng.standard_normal(shape).astype(geom.np_dtype), rng.standard_normal(shape).astype(geom.np_dtype))


def scattered_store(path: Path, dtype: str, seed: int) -> tuple[pagedkv.KVStore, dict[str, int]]:
    """Eight sequences (13..37 tokens, 4-token pages) appended in interleaved chunks into a
    24-slot pool holding fewer pages than they need: pages scatter, spill and come back."""
    geom = Geometry(layers=3, kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    store = pagedkv.open(path, geom, 24, durability="nosync")
    rng = np.random.default_rng(seed)
    target = {f"s{i}": int(n) for i, n in enumerate(rng.integers(13, 38, 8))}
    for seq in target:
        store.create(seq)
    while any(store.length(seq) < n for seq, n in target.items()):
        seq = str(rng.choice([s for s, n in target.items() if store.length(s) < n]))
        take = int(min(rng.integers(1, 7), target[seq] - store.length(seq)))
        store.append(seq, *random_kv(rng, geom, take))
    for seq in rng.permutation(list(target)):  # touch everything once more: evictions + restores
        store.read(str(seq))
    assert store.stats()["restores"] > 0 and store.stats()["spilled_pages"] > 0
    return store, target


def batch_of(store: pagedkv.KVStore, new: dict[str, int], rng: np.random.Generator) -> dict[str, int]:
    """A random batch of sequences whose pages fit in the pool at once."""
    batch: dict[str, int] = {}
    for seq in rng.permutation(list(new)):
        trial = {**batch, str(seq): new[str(seq)]}
        if store.can_step(trial):
            batch = trial
    return batch


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("q_heads", [2, 4, 8])
def test_decode_matches_dense_over_scattered_pages(tmp_path: Path, seed: int, dtype: str, q_heads: int) -> None:
    store, lengths = scattered_store(tmp_path / "s", dtype, seed)
    geom, rng = store.geometry, np.random.default_rng(seed + 1)
    scattered = False
    for _ in range(3):
        batch = batch_of(store, {seq: 1 for seq in lengths}, rng)
        queries = rng.standard_normal((geom.layers, len(batch), q_heads, geom.head_dim)).astype(geom.np_dtype)
        with store.step(batch) as step:
            k, v = random_kv(rng, geom, len(batch))
            slots, offsets = np.divmod(step.slot_mapping, geom.page_size)
            for layer in range(geom.layers):  # the engine's write of the new token, layer by layer
                store.pool[slots, layer, 0, offsets] = k[layer]
                store.pool[slots, layer, 1, offsets] = v[layer]
            outs = [paged_attention(queries[layer], store.pool, step.block_tables, step.seq_lens, layer)
                    for layer in range(geom.layers)]
            tables = step.block_tables
            scattered |= any(np.any(np.diff(row[row >= 0]) != 1) for row in tables)
        for row, seq in enumerate(batch):
            keys, values = store.read(seq)
            for layer in range(geom.layers):
                ref = dense(queries[layer, row:row + 1], keys[layer], values[layer], geom.head_dim ** -0.5)
                assert outs[layer].shape == queries[layer].shape and outs[layer].dtype == geom.np_dtype
                assert rel_err(outs[layer][row:row + 1], ref) <= TOL[dtype], (seq, layer)
    assert scattered, "expected some sequence's pages out of order in the pool"
    store.close()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prefill_is_causal_and_matches_dense(tmp_path: Path, seed: int, dtype: str) -> None:
    store, lengths = scattered_store(tmp_path / "s", dtype, seed)
    geom, rng = store.geometry, np.random.default_rng(seed + 2)
    store.create("fresh")  # a prompt prefilled from nothing, beside chunks appended to old sequences
    new = {seq: int(rng.integers(0, 9)) for seq in lengths} | {"fresh": 13}
    batch = batch_of(store, new, rng)
    assert batch, "nothing fits"
    q_heads, total = 4, sum(batch.values())
    queries = rng.standard_normal((total, q_heads, geom.head_dim)).astype(geom.np_dtype)
    with store.step(batch) as step:
        k, v = random_kv(rng, geom, total)
        slots, offsets = np.divmod(step.slot_mapping, geom.page_size)
        store.pool[slots, :, 0, offsets] = k.transpose(1, 0, 2, 3)
        store.pool[slots, :, 1, offsets] = v.transpose(1, 0, 2, 3)
        qlens = np.array(list(batch.values()), np.int32)
        out = paged_prefill_attention(queries, store.pool, step.block_tables, step.seq_lens, qlens, 1, scale=0.3)
    start = 0
    for seq, count in batch.items():
        keys, values = store.read(seq)
        ref = dense(queries[start:start + count], keys[1], values[1], 0.3)
        if count:
            assert rel_err(out[start:start + count], ref) <= TOL[dtype], seq
        start += count
    store.close()


def synthetic(rng: np.random.Generator, lens: list[int], page_size: int = 4, kv_heads: int = 2,
              head_dim: int = 8, pool_pages: int = 40) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A raw pool (NaN wherever no sequence has a token) and random block tables."""
    pool = np.full((pool_pages, 2, 2, page_size, kv_heads, head_dim), np.nan, np.float32)
    slots = rng.permutation(pool_pages)
    width = max(-(-n // page_size) for n in lens) + 2
    tables = np.full((len(lens), width), -1, np.int32)
    kvs, used = [], 0
    for row, n in enumerate(lens):
        pages = -(-n // page_size)
        tables[row, :pages] = slots[used:used + pages]
        used += pages
        data = rng.standard_normal((2, 2, n, kv_heads, head_dim)).astype(np.float32)  # layer, k/v, token
        for index in range(n):
            pool[tables[row, index // page_size], :, :, index % page_size] = data[:, :, index]
        kvs.append(data)
    return pool, tables, kvs


def test_raw_arrays_padding_never_leaks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lens = [1, 4, 5, 17, 9]
    pool, tables, kvs = synthetic(rng, lens)
    q = rng.standard_normal((len(lens), 6, 8)).astype(np.float32)
    out = paged_attention(q, pool, tables, np.array(lens), 1, scale=0.25)
    assert np.isfinite(out).all()  # NaN in padding slots and page tails is never read into the sum
    for row, data in enumerate(kvs):
        assert rel_err(out[row:row + 1], dense(q[row:row + 1], data[1, 0], data[1, 1], 0.25)) <= 1e-5
    # The prefill form with one query per sequence is the decode form.
    same = paged_prefill_attention(q, pool, tables, np.array(lens), np.ones(len(lens), np.int64), 1, scale=0.25)
    np.testing.assert_allclose(same, out, rtol=1e-6, atol=1e-6)
    # Whole-prompt prefill of every sequence at once, and an empty batch.
    qall = rng.standard_normal((sum(lens), 2, 8)).astype(np.float32)
    full = paged_prefill_attention(qall, pool, tables, np.array(lens), np.array(lens), 0)
    start = 0
    for n, data in zip(lens, kvs):
        assert rel_err(full[start:start + n], dense(qall[start:start + n], data[0, 0], data[0, 1], 8 ** -0.5)) <= 1e-5
        start += n
    empty = paged_attention(np.zeros((0, 2, 8), np.float32), pool, np.zeros((0, 3), np.int32),
                            np.zeros(0, np.int32), 0)
    assert empty.shape == (0, 2, 8)


def test_bad_inputs_raise_pagedkv_error(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool, tables, _ = synthetic(rng, [5, 9])
    lens = np.array([5, 9], np.int32)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    holes = tables.copy()
    holes[1, 1] = -1
    wild = tables.copy()
    wild[0, 0] = len(pool)
    bad_calls = [
        lambda: paged_attention(q[0], pool, tables, lens, 0),  # q not 3-D
        lambda: paged_attention(q.tolist(), pool, tables, lens, 0),  # not an ndarray
        lambda: paged_attention(q.astype(np.int32), pool, tables, lens, 0),
        lambda: paged_attention(q[:, :, :4], pool, tables, lens, 0),  # head_dim differs
        lambda: paged_attention(q[:, :3], pool, tables, lens, 0),  # 3 q heads over 2 kv heads
        lambda: paged_attention(q[:, :1], pool, tables, lens, 0),  # fewer q heads than kv heads
        lambda: paged_attention(q, pool[0], tables, lens, 0),  # pool not 6-D
        lambda: paged_attention(q, pool, tables[:1], lens, 0),  # rows != sequences
        lambda: paged_attention(q, pool, tables.astype(np.float32), lens, 0),
        lambda: paged_attention(q, pool, tables[0], lens, 0),
        lambda: paged_attention(q, pool, tables, lens[:1], 0),
        lambda: paged_attention(q, pool, tables, np.array([0, 9]), 0),  # empty sequence
        lambda: paged_attention(q, pool, tables, np.array([5, 99]), 0),  # longer than its table
        lambda: paged_attention(q, pool, holes, lens, 0),  # -1 inside the length
        lambda: paged_attention(q, pool, wild, lens, 0),  # slot beyond the pool
        lambda: paged_attention(q, pool, tables, lens, 2),  # layer out of range
        lambda: paged_attention(q, pool, tables, lens, True),
        lambda: paged_attention(q, pool, tables, lens, 0, scale=0.0),
        lambda: paged_attention(q, pool, tables, lens, 0, scale=float("nan")),
        lambda: paged_attention(q, pool, tables, lens, 0, scale="1"),
        lambda: paged_prefill_attention(q, pool, tables, lens, np.array([1, 2]), 0),  # sums to 3 != 2
        lambda: paged_prefill_attention(q, pool, tables, lens, np.array([6, -4]), 0),  # 6 > seq_len 5
        lambda: paged_prefill_attention(q, pool, tables, lens, np.array([1.0, 1.0]), 0),
    ]
    for index, call in enumerate(bad_calls):
        with pytest.raises(PagedKVError):
            call()
            pytest.fail(f"bad call {index} did not raise")


def test_core_package_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import pagedkv, pagedkv.attention, pagedkv.integrations\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
