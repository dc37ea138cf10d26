"""Data-path scenarios: B1 prefill append and B3 read/gather (B4 churn is in ``bench_churn``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import open as open_store
from .util import (GIB, Ctx, Pairs, Target, as_pages, geom_params, interleave, kv_block, make_row, remove,
                   timed)
from ..geometry import PRESETS

AT_LEAST_085 = Target(">= 0.85", ">=", 0.85)


def b1_prefill(ctx: Ctx) -> list[dict[str, Any]]:
    """B1: append whole prompts vs a page-by-page copy into a memmap of the same shape."""
    geom = PRESETS["small"] if ctx.quick else PRESETS["llama-3-8b"]
    seqs, tokens, pairs = (16, 256, 5) if ctx.quick else (64, 512, 5)
    per_seq = -(-tokens // geom.page_size)
    total = seqs * per_seq
    k, v = kv_block(geom, tokens, ctx.np_rng("b1"))  # one prompt's K/V, appended to every sequence
    src = as_pages(geom, k, v)
    path, ref_path = ctx.path("b1-store"), ctx.path("b1-ref.bin")
    store = open_store(path, geom, pool_pages=total)
    ref = np.memmap(ref_path, dtype=geom.np_dtype, mode="w+", shape=(total, *geom.page_shape))
    nbytes = total * geom.page_nbytes

    def pagedkv_run(check: bool = False) -> float:
        def fill() -> None:
            for seq in range(seqs):
                store.create(seq)
                store.append(seq, k, v)
        seconds = timed(fill)
        if check:
            got_k, got_v = store.read(seqs - 1)
            assert np.array_equal(got_k, k) and np.array_equal(got_v, v), "B1: read-back differs"
        for seq in range(seqs):  # no commit since: the freed slots are reusable at once
            store.drop(seq)
        return nbytes / seconds / GIB

    def reference_run() -> float:
        def fill() -> None:
            for seq in range(seqs):
                base = seq * per_seq
                for index in range(per_seq):
                    ref[base + index] = src[index]
        return nbytes / timed(fill) / GIB

    def layout_run() -> float:
        # What append() itself must do: scatter (layers, n, heads, dim) K and V into pages.
        def fill() -> None:
            for seq in range(seqs):
                for index in range(per_seq):
                    lo, hi = index * geom.page_size, min(tokens, (index + 1) * geom.page_size)
                    ref[seq * per_seq + index, :, 0, : hi - lo] = k[:, lo:hi]
                    ref[seq * per_seq + index, :, 1, : hi - lo] = v[:, lo:hi]
        return nbytes / timed(fill) / GIB

    try:
        ctx.say(f"B1: {seqs} x {tokens} tokens, {nbytes / GIB:.2f} GiB per round")
        pagedkv_run(check=True)  # first touch of both files, untimed
        reference_run()
        result = interleave(pagedkv_run, reference_run, pairs, {"layout": layout_run})
    finally:
        store.close()
        remove(path, ref_path)
    params = {**geom_params(geom), "sequences": seqs, "tokens": tokens, "pages": total,
              "bytes": nbytes, "pairs": pairs}
    return [make_row("B1", "prefill append", result.a_median, result.b_median, "GiB/s", result.ratio,
                     AT_LEAST_085, params,
                     "append() of (layers, n, heads, dim) K/V vs dst[i] = src[i] of ready-made pages "
                     "into a memmap on the same filesystem; both warm; metrics: the same scatter "
                     "into page layout done with bare numpy", _layout_metrics(result))]


def b3_read(ctx: Ctx) -> list[dict[str, Any]]:
    """B3: read whole resident sequences vs a page-by-page numpy copy of the same bytes."""
    geom = PRESETS["small"] if ctx.quick else PRESETS["llama-3-8b"]
    seqs, tokens, pairs = (16, 256, 5) if ctx.quick else (16, 512, 5)
    per_seq = -(-tokens // geom.page_size)
    total = seqs * per_seq
    k, v = kv_block(geom, tokens, ctx.np_rng("b3"))
    src = as_pages(geom, k, v)
    path, ref_path = ctx.path("b3-store"), ctx.path("b3-ref.bin")
    store = open_store(path, geom, pool_pages=total)
    ref = np.memmap(ref_path, dtype=geom.np_dtype, mode="w+", shape=(total, *geom.page_shape))
    nbytes = total * geom.page_nbytes
    for seq in range(seqs):
        store.create(seq)
        store.append(seq, k, v)
        ref[seq * per_seq:(seq + 1) * per_seq] = src

    # Each result is dropped before the next read, as the reference drops its copy:
    # keeping them all would change how the kernel backs the fresh arrays.
    def pagedkv_run() -> float:
        def gather() -> None:
            for seq in range(seqs):
                store.read(seq)
        return nbytes / timed(gather) / GIB

    def pages_run() -> float:
        def gather() -> None:
            for seq in range(seqs):
                store.read_pages(seq)
        return nbytes / timed(gather) / GIB

    def reference_run() -> float:
        def gather() -> None:
            for seq in range(seqs):
                out = np.empty((per_seq, *geom.page_shape), geom.np_dtype)
                for index in range(per_seq):
                    out[index] = ref[seq * per_seq + index]
        return nbytes / timed(gather) / GIB

    def layout_run() -> float:
        # What read() itself must do: gather pages into (layers, n, heads, dim) K and V.
        def gather() -> None:
            shape = (geom.layers, tokens, geom.kv_heads, geom.head_dim)
            for seq in range(seqs):
                out_k, out_v = np.empty(shape, geom.np_dtype), np.empty(shape, geom.np_dtype)
                for index in range(per_seq):
                    lo, hi = index * geom.page_size, min(tokens, (index + 1) * geom.page_size)
                    out_k[:, lo:hi] = ref[seq * per_seq + index, :, 0, : hi - lo]
                    out_v[:, lo:hi] = ref[seq * per_seq + index, :, 1, : hi - lo]
        return nbytes / timed(gather) / GIB

    try:
        got_k, got_v = store.read(0)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v), "B3: read-back differs"
        assert np.array_equal(store.read_pages(0), src), "B3: pages differ"
        pagedkv_run()  # warm-up
        reference_run()
        result = interleave(pagedkv_run, reference_run, pairs, {"layout": layout_run, "pages": pages_run})
    finally:
        store.close()
        remove(path, ref_path)
    params = {**geom_params(geom), "sequences": seqs, "tokens": tokens, "pages": total,
              "bytes": nbytes, "pairs": pairs}
    return [make_row("B3", "read whole sequences", result.a_median, result.b_median, "GiB/s",
                     result.ratio, AT_LEAST_085, params,
                     "read() into fresh K and V arrays vs out[i] = memmap[page] into a fresh array; "
                     "all resident; metrics: the same gather into K/V layout done with bare numpy",
                     _layout_metrics(result)),
            make_row("B3", "read whole sequences as pages", float(np.median(result.extra["pages"])),
                     result.b_median, "GiB/s", result.ratio_to_b(result.extra["pages"]), AT_LEAST_085,
                     params, "read_pages() (pool layout, one copy per page) vs the same reference, "
                     "measured in the same rounds")]


def _layout_metrics(result: Pairs) -> dict[str, Any]:
    """The bare-numpy layout copy measured in the same rounds: how much of the gap is layout."""
    layout = result.extra["layout"]
    return {"layout_copy_gibs": float(np.median(layout)), "ratio_to_layout_copy": result.ratio_to(layout)}
