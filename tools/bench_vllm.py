"""pagedkv as vLLM's KV tier: time to first token restored vs computed, load vs a bare copy, lookup cost.

One vLLM engine (CPU, in-process mode so the connector's parts can be timed) on a
random-weight Llama big enough that prefill costs something (default 8 layers,
hidden 512, 8 KV heads of 64, 2,048-token prompts). vLLM's own prefix cache is
off, so a hit is served by pagedkv alone. Every figure is a ratio of two things
measured in this process, interleaved (A B A B), median of ``--pairs`` pairs:

- TTFT: ``generate(max_tokens=1)`` of a prompt whose pages the store holds (it
  was computed, saved and committed earlier) against a fresh prompt of the same
  length that vLLM must prefill.
- load: the worker's load of those pages into vLLM's blocks (create a sequence
  sharing the cached pages, ``read_pages``, copy into the blocks, drop) against a
  bare copy of the same page bytes from memory into the same blocks.
- lookup: the scheduler side's answer to "how many tokens does the store hold"
  (pagedkv's chained hash of every page, probed in its view) against vLLM's own
  block hashing of the same prompt (``get_request_block_hasher``, sha256).

    python tools/bench_vllm.py             # the defaults above, 7 pairs
    python tools/bench_vllm.py --json --pairs 5 --tokens 1024   # JSON on the last line
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

PAGE = 32


def _make_model(path: str, layers: int, hidden: int, heads: int, head_dim: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=head_dim, max_position_embeddings=8192, initializer_range=0.2,
                         torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def _pairs(count: int, first: Callable[[int], float], second: Callable[[int], float]) -> tuple[list[float], list[float]]:
    a, b = [], []
    for index in range(count):
        a.append(first(index))
        b.append(second(index))
    return a, b


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.pairs < 5:
        parser.error("--pairs must be at least 5")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tmp = tempfile.mkdtemp(prefix="bench-vllm-")
    head_dim = args.hidden // args.heads
    _make_model(os.path.join(tmp, "model"), args.layers, args.hidden, args.heads, head_dim)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from pagedkv.integrations.vllm.meta import PageJob

    llm = LLM(model=os.path.join(tmp, "model"), skip_tokenizer_init=True, dtype="float32", block_size=PAGE,
              max_model_len=args.tokens + 64, max_num_batched_tokens=args.tokens + 64, enforce_eager=True,
              seed=0, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
                  kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"path": os.path.join(tmp, "kv"),
                                                                "pool_bytes": 2 << 30}))
    worker = get_kv_transfer_group()._worker
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(3, 1024) for _ in range(args.tokens)]  # noqa: E731
    held = [prompt() for _ in range(args.pairs)]
    fresh = [prompt() for _ in range(args.pairs)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    want = (args.tokens - 1) // PAGE * PAGE

    def generate(ids: list[int]) -> tuple[float, int]:
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - started
        worker.flush()  # this prompt's saves land before the next measurement, outside it
        return elapsed, out.num_cached_tokens

    generate(prompt())  # warm-up: first-call costs of the engine
    for ids in held:
        generate(ids)
    hits, misses = [], []

    def hit(index: int) -> float:
        elapsed, cached = generate(held[index])
        assert cached == want, f"expected a hit of {want} tokens, got {cached}"
        return elapsed

    def miss(index: int) -> float:
        elapsed, cached = generate(fresh[index])
        assert cached == 0, cached
        return elapsed

    hits, misses = _pairs(args.pairs, hit, miss)

    # Load throughput: the worker's load of one prompt's pages vs a bare copy of the same bytes.
    pages_count = want // PAGE
    blocks = list(range(1, pages_count + 1))  # the engine is idle: no request owns any block now
    job = PageJob("bench", 0, pages_count, blocks, held[0][:want + 1], None, [])
    store = worker.store
    store.create("bench-copy", tokens=held[0][:want + 1])
    pages = store.read_pages("bench-copy", 0, pages_count)
    store.drop("bench-copy")
    nbytes = pages.nbytes

    def load(_: int) -> float:
        started = time.perf_counter()
        assert worker.load_job(job) == pages_count
        return time.perf_counter() - started

    def bare(_: int) -> float:
        started = time.perf_counter()
        worker.caches.scatter(blocks, pages)
        return time.perf_counter() - started

    loads, bares = _pairs(max(args.pairs, 25), load, bare)  # ~10 ms each: more pairs, steadier median

    # Lookup cost: pagedkv's chain over the view vs vLLM's own block hashing, same prompt.
    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(PAGE, hash_fn)

    def request(ids: list[int]) -> Any:
        return Request("bench-lookup", ids, SamplingParams(max_tokens=1), None)

    def ours(index: int) -> float:
        req = request(held[index % len(held)])
        started = time.perf_counter()
        matched = scheduler.matched_tokens(req, 0)
        elapsed = time.perf_counter() - started
        scheduler._requests.pop(req.request_id, None)
        assert matched == want
        return elapsed

    def theirs(index: int) -> float:
        req = request(held[index % len(held)])
        started = time.perf_counter()
        hashes = hasher(req)
        elapsed = time.perf_counter() - started
        assert len(hashes) == args.tokens // PAGE
        return elapsed

    rounds = max(args.pairs, 50)
    looks, vllm_hashes = _pairs(rounds, ours, theirs)

    med = statistics.median
    result = {
        "model": f"{args.layers} layers, hidden {args.hidden}, {args.heads} kv heads x {head_dim}, float32",
        "prompt_tokens": args.tokens, "pairs": args.pairs,
        "ttft_hit_ms": round(med(hits) * 1e3, 2), "ttft_miss_ms": round(med(misses) * 1e3, 2),
        "ttft_ratio": round(med(hits) / med(misses), 4),
        "load_mib": round(nbytes / (1 << 20), 1),
        "load_gib_s": round(nbytes / med(loads) / (1 << 30), 2),
        "bare_copy_gib_s": round(nbytes / med(bares) / (1 << 30), 2),
        "load_ratio": round(med(bares) / med(loads), 3),
        "lookup_us_per_request": round(med(looks) * 1e6, 1),
        "lookup_us_per_1k_tokens": round(med(looks) * 1e6 * 1000 / args.tokens, 1),
        "vllm_block_hash_us_per_request": round(med(vllm_hashes) * 1e6, 1),
        "lookup_ratio_to_vllm_hashing": round(med(looks) / med(vllm_hashes), 3),
    }
    if args.json:  # one line, the last: vLLM logs to stdout too
        print(json.dumps(result), flush=True)
    else:
        for key, value in result.items():
            print(f"{key:32} {value}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
