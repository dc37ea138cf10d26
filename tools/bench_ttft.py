"""Time to first token: a prompt restored from pagedkv against recomputing its prefill.

A randomly initialised Llama-architecture model (no download) answers the same prompt
two ways, interleaved in one process: with the default cache (the whole prompt is
prefilled) and with a ``PagedKVCache`` whose sequence starts from the prompt's pages
cached by an earlier run (``store.create(seq, tokens=prompt)``), after the store was
closed and reopened as a restarted server would. Both must give the same first token.
The result is the median of each and the median of the per-pair ratios.

Usage, from the repository root (needs the ``hf`` extra)::

    python tools/bench_ttft.py                    # 1024-token prompt, 5 pairs
    python tools/bench_ttft.py --prompt 2048 --pairs 7 --json
    python tools/bench_ttft.py --spilled          # the prompt's pages come back from the LMDB spill
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

# Runnable from a checkout without installing: the package sits next to tools/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pagedkv  # noqa: E402

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)


def build_model(seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised float32 ``LlamaForCausalLM`` (``MODEL`` updated by ``overrides``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**MODEL, **overrides})).eval()


def measure_ttft(prompt_len: int = 1024, pairs: int = 5, page_size: int = 16, threads: int | None = 1,
                 spilled: bool = False, model: Any = None, path: str | None = None) -> dict[str, Any]:
    """Measure TTFT restored vs recomputed; return a dict of milliseconds, the ratio and the setup.

    Params:
        prompt_len: tokens of the prompt (random ids).
        pairs: interleaved (recompute, restore) pairs measured after one warm-up pair (>= 5
            for a stable median).
        threads: torch intra-op threads (None: leave torch's setting). One by default: on a
            small shared machine more threads than free cores make every op erratic.
        spilled: a pool of 8 pages, so the prompt's pages are restored from the spill store
            on every run instead of lying in the pool file.
        model: a model to use instead of ``build_model()``.
        path: the store directory (default: a temporary one, removed afterwards).
    """
    import torch

    from pagedkv.integrations.hf import PagedKVCache, geometry_for, model_fingerprint

    if pairs < 1 or prompt_len < 2:
        raise ValueError("need pairs >= 1 and prompt_len >= 2")
    if threads is not None:
        torch.set_num_threads(threads)
    model = model if model is not None else build_model()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    fingerprint = model_fingerprint(model)
    geom = geometry_for(model, page_size=page_size)
    pool_pages = 8 if spilled else -(-prompt_len // page_size) + 8

    with tempfile.TemporaryDirectory(prefix="pagedkv-ttft-") as tmp:
        where = path or os.path.join(tmp, "store")
        store = pagedkv.open(where, geom, pool_pages, model=fingerprint, durability="nosync")
        cache = PagedKVCache(store, "seed", model=model, prompt=prompt)
        expected = model.generate(prompt, past_key_values=cache, max_new_tokens=1, do_sample=False)[0, -1].item()
        cache.close()
        store.close()  # a restart: everything below comes from disk
        store = pagedkv.open(where, model=fingerprint, durability="nosync")

        def recompute() -> tuple[float, int]:
            began = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=1, do_sample=False)
            return time.perf_counter() - began, int(out[0, -1])

        def restore(run: int) -> tuple[float, int]:
            seq = f"run-{run}"
            began = time.perf_counter()
            cache = PagedKVCache(store, seq, model=model, prompt=prompt)
            out = model.generate(prompt, past_key_values=cache, max_new_tokens=1, do_sample=False)
            elapsed = time.perf_counter() - began
            reused.append(cache.reused)
            cache.close()
            store.drop(seq)
            return elapsed, int(out[0, -1])

        reused: list[int] = []
        times: dict[str, list[float]] = {"recompute": [], "restore": []}
        before = store.stats()
        with torch.inference_mode():
            for run in range(pairs + 1):  # run 0 warms both paths up and is not counted
                order = ("recompute", "restore") if run % 2 else ("restore", "recompute")
                for kind in order:
                    elapsed, token = recompute() if kind == "recompute" else restore(run)
                    if token != expected:
                        raise AssertionError(f"{kind} gave first token {token}, expected {expected}")
                    if run:
                        times[kind].append(elapsed)
        after = store.stats()
        store.close()

    ratios = [a / b for a, b in zip(times["recompute"], times["restore"])]
    params = sum(p.numel() for p in model.parameters())
    return {
        "prompt_tokens": prompt_len, "reused_tokens": reused[-1], "pairs": pairs,
        "recompute_ms": 1e3 * statistics.median(times["recompute"]),
        "restore_ms": 1e3 * statistics.median(times["restore"]),
        "ratio": statistics.median(ratios),
        "params_m": params / 1e6,
        "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "layers": model.config.num_hidden_layers, "kv_mb": prompt_len * geom.token_nbytes / 2**20,
        "page_size": page_size, "pool_pages": pool_pages, "threads": torch.get_num_threads(),
        "restores": after["restores"] - before["restores"],
    }


def format_result(result: dict[str, Any]) -> str:
    """A short human-readable report of ``measure_ttft``'s result."""
    return (f"prompt {result['prompt_tokens']} tokens ({result['reused_tokens']} restored, "
            f"{result['kv_mb']:.1f} MiB of KV), model {result['params_m']:.1f} M params "
            f"({result['weights_mb']:.0f} MiB, {result['layers']} layers), {result['threads']} thread(s)\n"
            f"TTFT recompute {result['recompute_ms']:.1f} ms, restored from pagedkv "
            f"{result['restore_ms']:.1f} ms: {result['ratio']:.1f}x faster "
            f"(median of {result['pairs']} interleaved pairs; {result['restores']} page restores)")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print the report (or JSON); return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs to measure (>= 5)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--spilled", action="store_true", help="restore the prompt's pages from the spill")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        result = measure_ttft(args.prompt, args.pairs, args.page_size, args.threads or None, args.spilled)
    except ImportError as exc:
        print(f"bench_ttft needs the hf extra (pip install -e '.[hf]'): {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
