"""B2's rows with token ids and its fixed cost.

* ``b2_token_ids``: decode steps carrying each new token's id, so every page
  that fills is hashed, against a pure-Python hashing block manager
  (``ref.RefHashingBlockManager``) and, where vLLM is importable, against vLLM
  v1's own ``KVCacheManager`` with request hashing (``vllmref.VllmDecode``).
* ``b2_fixed_cost``: a one-sequence, one-token step, the cost every step pays
  whatever its batch.
* ``b2_fixed_growth``: that step on a pool a thousand times larger, against the
  small pool's: what a step costs must not grow with the pool.
"""

from __future__ import annotations

import shutil
from typing import Any, Callable

import numpy as np

from .. import open as open_store
from ..pages.directory import HASHED
from ..pages.sequence import SeqId
from ..store import KVStore
from .ref import RefBlockManager, RefHashingBlockManager
from .util import Ctx, Target, close_all, geom_params, interleave, make_row, timed
from .meta import META_GEOM, b2_step

VOCAB = 32_000


def b2_all(ctx: Ctx) -> list[dict[str, Any]]:
    """B2, every row: steps without token ids (``meta.b2_step``), with token ids, the fixed cost."""
    return b2_step(ctx) + b2_token_ids(ctx) + b2_fixed_cost(ctx) + b2_fixed_growth(ctx)


def hashed_pages(store: KVStore) -> int:
    """Live pages of ``store`` that carry a chained prefix hash.

    No public figure counts them (``stats()`` has cached and shared pages
    only), so the directory's flag column is read directly.
    """
    mgr = store._mgr
    return int(np.count_nonzero(mgr.live & ((mgr.flags & HASHED) != 0)))


class _Steps:
    """One side's run through the same prebuilt steps: a block times ``block`` of them from where it is."""

    def __init__(self, fn: Callable[[int], object], block: int, per_block: int) -> None:
        self.fn, self.block, self.per_block, self.done = fn, block, per_block, 0

    def __call__(self) -> float:
        first = self.done
        self.done += self.block

        def work() -> None:
            for index in range(first, first + self.block):
                self.fn(index)
        return timed(work) / (self.block * self.per_block) * 1e6


def b2_token_ids(ctx: Ctx) -> list[dict[str, Any]]:
    """B2 with token ids: ``step(mapping, tokens=ids)`` per sequence-step vs a hashing reference and vLLM."""
    from . import vllmref

    counts = (64, 256) if ctx.quick else (64, 256, 1024)
    steps, pairs = (40, 5) if ctx.quick else (256, 8)
    block = steps // pairs
    page_size = META_GEOM.page_size
    why_not_vllm = vllmref.unavailable()
    rows = []
    for nseq in counts:
        rng = ctx.rng(f"b2-ids-{nseq}")
        ids_rng = ctx.np_rng(f"b2-ids-{nseq}")
        prompts = [rng.randint(1, 512) for _ in range(nseq)]
        total = steps + block + 1  # measured steps, the warm-up block, the checked step
        # Distinct random ids per sequence: no two sequences share a prefix, so every fill is a new page.
        ids = [ids_rng.integers(0, VOCAB, prompt + total).tolist() for prompt in prompts]
        prompt_ids = {seq: ids[seq][:prompts[seq]] for seq in range(nseq)}
        step_ids: list[dict[SeqId, list[int]]] = [
            {seq: ids[seq][prompts[seq] + index:prompts[seq] + index + 1] for seq in range(nseq)}
            for index in range(total)]
        step_tokens = [{seq: tokens[0] for seq, tokens in one.items()} for one in step_ids]
        pages = sum(-(-(p + total) // page_size) for p in prompts)
        path = ctx.path(f"b2-ids-{nseq}")
        store = open_store(path, META_GEOM, pool_pages=pages)
        ref = RefHashingBlockManager(pages, page_size)
        vllm = None if why_not_vllm else vllmref.VllmDecode(pages, page_size, max(prompts) + total + 16)
        mapping: dict[SeqId, int] = {seq: 1 for seq in range(nseq)}
        try:
            for seq in range(nseq):  # the prefill, untimed
                store.create(seq)
                ref.add(seq)
                if vllm is not None:
                    vllm.add(seq, prompt_ids[seq])
            with store.step(dict(enumerate(prompts)), tokens=prompt_ids):
                pass
            ref.step_ids(dict(enumerate(prompts)), prompt_ids)

            def pagedkv_step(index: int) -> None:
                with store.step(mapping, tokens=step_ids[index]):
                    pass

            sides = {"pagedkv": _Steps(pagedkv_step, block, nseq),
                     "reference": _Steps(lambda index: ref.step_ids(mapping, step_ids[index]), block, nseq)}
            if vllm is not None:
                peer = vllm  # narrowed for the closure
                sides["vllm"] = _Steps(lambda index: peer.step(step_tokens[index]), block, nseq)
            for side in sides.values():  # warm-up
                side()
            extra: dict[str, Callable[[], float]] | None = {"vllm": sides["vllm"]} if vllm is not None else None
            result = interleave(sides["pagedkv"], sides["reference"], pairs, extra)
            last = steps + block
            with store.step(mapping, tokens=step_ids[last]) as step:  # every side describes the same sequences
                tables, slot_mapping, lens = ref.step_ids(mapping, step_ids[last])
                assert np.array_equal(step.seq_lens, lens), "B2 ids: sequence lengths differ"
                assert step.block_tables.shape == tables.shape, "B2 ids: block table shapes differ"
                assert np.array_equal(step.slot_mapping % page_size, slot_mapping % page_size)
                block_tables_shape, slot_mapping_now = step.block_tables.shape, step.slot_mapping.copy()
            hashed = hashed_pages(store)
            expected = int(sum(int(n) // page_size for n in lens))
            assert hashed == len(ref.prefix_cache) == expected, \
                f"B2 ids: {hashed} pages hashed, the reference cached {len(ref.prefix_cache)}, expected {expected}"
            vllm_hashed = None
            if vllm is not None:
                vllm.step(step_tokens[last])
                shape, vllm_lens, vllm_slots = vllm.outputs(list(range(nseq)))
                assert np.array_equal(vllm_lens, lens), "B2 ids: vLLM's sequence lengths differ"
                assert shape == block_tables_shape, "B2 ids: vLLM's block table shape differs"
                assert np.array_equal(vllm_slots % page_size, slot_mapping_now % page_size)
                vllm_hashed = vllm.hashed_blocks()
                assert vllm_hashed == hashed, f"B2 ids: vLLM cached {vllm_hashed} blocks, pagedkv hashed {hashed}"
        finally:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
        params = {**geom_params(META_GEOM), "sequences": nseq, "new_tokens_per_step": 1, "steps": steps,
                  "pairs": pairs, "prompt_tokens": "uniform 1..512", "token_ids": f"random in [0, {VOCAB})"}
        metrics: dict[str, Any] = {"hashed_pages": hashed}
        name = f"decode step with token ids {nseq} seqs"
        rows.append(make_row("B2", name, result.a_median, result.b_median, "us/seq-step", result.ratio,
                             Target("<= 1.0x", "<=", 1.0), params,
                             "with store.step(mapping, tokens=ids) enter+exit per sequence-step, each filled "
                             "page hashed, vs a pure-Python block manager hashing each filled block "
                             "(xxh3-128 over parent hash + ids) into a prefix-cache dict", metrics))
        if vllm is not None:
            series = result.extra["vllm"]
            vllm_us = float(np.median(series))
            rows.append(make_row("B2", f"{name} vs vLLM", result.a_median, vllm_us, "us/seq-step",
                                 result.ratio_to(series), Target("<= 0.5x", "<=", 0.5),
                                 {**params, "vllm_hash_algo": vllm.hash_algo},
                                 "the same steps vs vLLM v1's KVCacheManager (prefix caching on, 16-token "
                                 "blocks): per request append_output_token_ids (request block hashing) + "
                                 "allocate_slots(request, 1), timed together",
                                 {**metrics, "vllm_cached_blocks": vllm_hashed}))
        else:
            rows[-1]["notes"] += f"; vLLM not importable here ({why_not_vllm}), so no vLLM row"
    return rows


def b2_fixed_cost(ctx: Ctx) -> list[dict[str, Any]]:
    """B2's fixed cost: ``with store.step({0: 1}): pass`` on one resident sequence, us per step."""
    steps, pairs = (100, 5) if ctx.quick else (500, 10)
    block = steps // pairs
    page_size = META_GEOM.page_size
    prompt = ctx.rng("b2-fixed").randint(1, 512)
    pages = -(-(prompt + steps + block + 1) // page_size)
    path = ctx.path("b2-fixed")
    store = open_store(path, META_GEOM, pool_pages=pages)
    ref = RefBlockManager(pages, page_size)
    mapping: dict[SeqId, int] = {0: 1}
    try:
        store.create(0)
        ref.add(0)
        with store.step({0: prompt}):
            pass
        ref.step({0: prompt})

        def pagedkv_step(_: int) -> None:
            with store.step(mapping):
                pass

        ours = _Steps(pagedkv_step, block, 1)
        theirs = _Steps(lambda _: ref.step(mapping), block, 1)
        ours()  # warm-up
        theirs()
        result = interleave(ours, theirs, pairs)
        with store.step(mapping) as step:
            tables, slot_mapping, lens = ref.step(mapping)
            assert np.array_equal(step.seq_lens, lens), "B2 fixed: sequence lengths differ"
            assert step.block_tables.shape == tables.shape, "B2 fixed: block table shapes differ"
            assert np.array_equal(step.slot_mapping % page_size, slot_mapping % page_size)
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    params = {**geom_params(META_GEOM), "sequences": 1, "new_tokens_per_step": 1, "steps": steps,
              "pairs": pairs, "prompt_tokens": prompt}
    return [make_row("B2", "one-sequence step fixed cost", result.a_median, result.b_median, "us/step",
                     result.ratio, Target("<= 25 us", "<=", 25.0, on="pagedkv"), params,
                     "with store.step({0: 1}): pass on one resident sequence, no token ids, us per step; "
                     "the reference is the pure-Python block manager's one-sequence step (ratio reported)")]


def b2_fixed_growth(ctx: Ctx) -> list[dict[str, Any]]:
    """B2: the one-sequence step of ``b2_fixed_cost`` on a 1,000,000-slot pool against a 1,000-slot one.

    Blocks of steps alternate between the two stores (large then small), each
    store's one resident sequence stepping by one token. A step's work is its
    sequence's pages, so the ratio should be 1; a scan of the pool's slots in
    every step is what it catches (64-byte pages: the large pool is a 64 MB file).
    """
    small_slots, large_slots = 1_000, (100_000 if ctx.quick else 1_000_000)
    steps, pairs = (100, 5) if ctx.quick else (500, 15)
    block = steps // pairs
    prompt = ctx.rng("b2-growth").randint(1, 512)
    paths = {size: ctx.path(f"b2-growth-{size}") for size in (small_slots, large_slots)}
    stores: dict[int, KVStore] = {}
    mapping: dict[SeqId, int] = {0: 1}
    try:
        for size, path in paths.items():
            ctx.say(f"B2: a one-sequence step on a {size}-slot pool")
            stores[size] = store = open_store(path, META_GEOM, pool_pages=size)
            store.create(0)
            with store.step({0: prompt}):
                pass

        def stepper(store: KVStore) -> _Steps:
            def one(_: int) -> None:
                with store.step(mapping):
                    pass
            return _Steps(one, block, 1)

        large, small = stepper(stores[large_slots]), stepper(stores[small_slots])
        large()  # warm-up
        small()
        result = interleave(large, small, pairs)
        lengths = {size: store.length(0) for size, store in stores.items()}
        assert len(set(lengths.values())) == 1, f"B2 growth: the two stores took different steps {lengths}"
    finally:
        close_all(stores.values(), *paths.values())
    params = {**geom_params(META_GEOM), "sequences": 1, "new_tokens_per_step": 1, "steps": steps,
              "pairs": pairs, "prompt_tokens": prompt, "small_pool_pages": small_slots,
              "large_pool_pages": large_slots}
    return [make_row("B2", f"one-sequence step fixed cost, {large_slots} vs {small_slots} slots", result.a_median,
                     result.b_median, "us/step", result.ratio, Target("<= 1.2x", "<=", 1.2), params,
                     "with store.step({0: 1}): pass on one resident sequence, no token ids, on a pool of "
                     f"{large_slots} slots vs one of {small_slots}, interleaved",
                     {"small_us": result.b_median})]
