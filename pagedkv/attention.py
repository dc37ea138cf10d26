"""Reference paged attention in numpy, straight from the page pool through block tables.

The layout is vLLM's: ``block_tables`` is int32 ``(num_seqs, max_pages)``, -1 padded,
each entry a slot of ``pool`` (``(pool_pages, layers, 2, page_size, kv_heads,
head_dim)``); ``seq_lens`` counts every token of a sequence, the new ones included.
Query heads may be a multiple of the KV heads (grouped-query attention: query head
``h`` reads KV head ``h // (num_q_heads // kv_heads)``, as in Llama and vLLM).

Everything is vectorised over sequences and pages; scores and softmax run in
float32 whatever the pool dtype (float16 and bfloat16 lose too much in a sum of
thousands of terms), and the output comes back in the query's dtype.
This is a correctness reference for engines and tests, not a fast kernel: it
materialises the gathered K/V of the batch and the padded score matrix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .errors import PagedKVError

__all__ = ["paged_attention", "paged_prefill_attention"]


def paged_attention(q: np.ndarray, pool: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                    layer: int, scale: float | None = None) -> np.ndarray:
    """Decode attention: one query token per sequence over its whole cached context.

    Params:
        q: ``(num_seqs, num_q_heads, head_dim)``, the query of each sequence's newest token.
        pool: the page pool, ``(pool_pages, layers, 2, page_size, kv_heads, head_dim)``.
        block_tables: int ``(num_seqs, max_pages)``, -1 padded, slots into ``pool``.
        seq_lens: int ``(num_seqs,)``, tokens of each sequence including the new one (>= 1).
        layer: the transformer layer whose K/V to use.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
    Returns:
        ``(num_seqs, num_q_heads, head_dim)`` in ``q``'s dtype.
    Raises:
        PagedKVError: on a bad shape, dtype, length, layer or block-table entry.
    """
    q = _as_float_array("q", q, 3)
    lens = _as_int_vector("seq_lens", seq_lens, q.shape[0])
    return _attend(q, pool, block_tables, lens, np.ones(len(lens), np.int64), layer, scale)


def paged_prefill_attention(q: np.ndarray, pool: np.ndarray, block_tables: np.ndarray,
                            seq_lens: np.ndarray, query_lens: np.ndarray, layer: int,
                            scale: float | None = None) -> np.ndarray:
    """Prefill (or chunked-prefill / mixed) attention with a causal mask over the new tokens.

    Sequence ``i`` contributes its last ``query_lens[i]`` tokens as queries, packed in
    order in ``q``; token at position ``p`` attends to positions ``0..p`` of its
    sequence (the cached prefix and the new tokens up to itself). With every
    ``query_lens[i] == 1`` this is ``paged_attention``.

    Params:
        q: ``(sum(query_lens), num_q_heads, head_dim)``.
        query_lens: int ``(num_seqs,)``, new tokens of each sequence, ``0 <= query_lens <= seq_lens``.
        pool, block_tables, seq_lens, layer, scale: as for ``paged_attention``.
    Returns:
        ``(sum(query_lens), num_q_heads, head_dim)`` in ``q``'s dtype.
    Raises:
        PagedKVError: on a bad shape, dtype, length, layer or block-table entry.
    """
    q = _as_float_array("q", q, 3)
    lens = _as_int_vector("seq_lens", seq_lens, -1)
    qlens = _as_int_vector("query_lens", query_lens, len(lens))
    if (qlens < 0).any() or (qlens > lens).any():
        raise PagedKVError("query_lens must satisfy 0 <= query_lens <= seq_lens")
    if int(qlens.sum()) != q.shape[0]:
        raise PagedKVError(f"q holds {q.shape[0]} tokens but query_lens add up to {int(qlens.sum())}")
    return _attend(q, pool, block_tables, lens, qlens, layer, scale)


# -- the shared core --------------------------------------------------------------------------


def _attend(q: np.ndarray, pool: Any, block_tables: Any, lens: np.ndarray, qlens: np.ndarray,
            layer: Any, scale: float | None) -> np.ndarray:
    num_seqs = len(lens)
    if not isinstance(pool, np.ndarray) or pool.ndim != 6 or pool.shape[2] != 2:
        raise PagedKVError("pool must be an ndarray (pool_pages, layers, 2, page_size, kv_heads, head_dim), "
                           f"got {getattr(pool, 'shape', type(pool).__name__)}")
    if pool.dtype.kind != "f" and pool.dtype.name != "bfloat16":
        raise PagedKVError(f"pool dtype must be float16, bfloat16 or float32, got {pool.dtype}")
    pool_pages, layers, _, page_size, kv_heads, head_dim = pool.shape
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layers:
        raise PagedKVError(f"layer must be an int in [0, {layers}), got {layer!r}")
    num_q_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise PagedKVError(f"q has head_dim {q.shape[2]}, the pool {head_dim}")
    if num_q_heads < kv_heads or num_q_heads % kv_heads:
        raise PagedKVError(f"num_q_heads ({num_q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if num_seqs == 0:
        return np.empty_like(q)
    tables = _block_tables(block_tables, num_seqs)
    if (lens < 1).any():
        raise PagedKVError("seq_lens must be >= 1")
    npages = -(-lens // page_size)
    if int(npages.max()) > tables.shape[1]:
        raise PagedKVError(f"a sequence of {int(lens.max())} tokens needs {int(npages.max())} pages; "
                           f"block_tables has {tables.shape[1]} columns")
    width = int(npages.max())
    tables = tables[:, :width].astype(np.int64)
    needed = np.arange(width)[None, :] < npages[:, None]
    if ((tables < 0) | (tables >= pool_pages))[needed].any():
        raise PagedKVError(f"block_tables has a missing (-1) or out-of-range slot (pool has {pool_pages}) "
                           "within a sequence's length")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_scale(scale)

    # Gather this layer's K/V of every page of the batch: (S, width, 2, page, kv, dim) -> tokens.
    slots = np.where(needed, tables, 0)  # padding reads slot 0; the mask below hides it
    pages = pool[slots, int(layer)].astype(np.float32, copy=False)
    ctx = width * page_size
    keys = pages[:, :, 0].reshape(num_seqs, ctx, kv_heads, head_dim)
    # Slots past a sequence's length (padding, the unwritten tail of its last page) may hold
    # anything, NaN included: zero their values so a masked weight of 0 cannot meet a NaN.
    in_seq = np.arange(ctx)[None, :] < lens[:, None]
    values = np.where(in_seq[:, :, None, None], pages[:, :, 1].reshape(num_seqs, ctx, kv_heads, head_dim), 0)

    # Pad the packed queries to (S, Qmax, ...); query j of sequence i sits at position
    # lens[i] - qlens[i] + j and sees keys at positions <= it (causal, and < lens[i]).
    qmax = int(qlens.max())
    token_rows = np.repeat(np.arange(num_seqs), qlens)
    token_cols = np.arange(len(token_rows)) - np.repeat(np.cumsum(qlens) - qlens, qlens)
    groups = num_q_heads // kv_heads
    padded = np.zeros((num_seqs, qmax, kv_heads, groups, head_dim), np.float32)
    padded[token_rows, token_cols] = q.astype(np.float32, copy=False).reshape(-1, kv_heads, groups, head_dim)
    positions = (lens - qlens)[:, None] + np.arange(qmax)[None, :]  # (S, Qmax)
    visible = np.arange(ctx)[None, None, :] <= positions[:, :, None]  # (S, Qmax, ctx)

    scores = np.einsum("sqkgd,stkd->skgqt", padded, keys, optimize=True) * np.float32(scale)
    scores = np.where(visible[:, None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)  # every real query sees >= 1 key: no -inf max
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.einsum("skgqt,stkd->sqkgd", scores, values, optimize=True)
    real: NDArray[np.float32] = out[token_rows, token_cols]  # the rows of real queries
    return real.reshape(q.shape).astype(q.dtype, copy=False)


# -- validation -------------------------------------------------------------------------------


def _as_float_array(name: str, arr: Any, ndim: int) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise PagedKVError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != ndim:
        raise PagedKVError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise PagedKVError(f"{name} must hold floats, got {arr.dtype}")
    return arr


def _as_int_vector(name: str, arr: Any, length: int) -> np.ndarray:
    out = np.asarray(arr) if isinstance(arr, (np.ndarray, list, tuple)) else None
    if out is None or out.ndim != 1 or (out.size and out.dtype.kind not in "iu"):
        raise PagedKVError(f"{name} must be a 1-D array of ints")
    if length >= 0 and len(out) != length:
        raise PagedKVError(f"{name} has {len(out)} entries for {length} sequences")
    return out.astype(np.int64)


def _block_tables(tables: Any, num_seqs: int) -> np.ndarray:
    if not isinstance(tables, np.ndarray) or tables.ndim != 2 or (tables.size and tables.dtype.kind not in "iu"):
        raise PagedKVError("block_tables must be a 2-D int array (num_seqs, max_pages), -1 padded")
    if tables.shape[0] != num_seqs:
        raise PagedKVError(f"block_tables has {tables.shape[0]} rows for {num_seqs} sequences")
    return tables


def _check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise PagedKVError(f"scale must be a number, got {scale!r}")
    if not math.isfinite(float(scale)) or float(scale) <= 0:
        raise PagedKVError(f"scale must be finite and > 0, got {scale!r}")
    return float(scale)
