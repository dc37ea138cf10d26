"""What ``pagedkv demo`` prints at the end of a run: the serving workload's table, or the seed workload's."""

from __future__ import annotations

from typing import Any

from .text import clean, geometry_text, nbytes, one_line, pairs, plural, shell_arg, show_id, table


def demo_text(result: dict[str, Any]) -> str:
    """The end-of-run table of ``pagedkv demo``."""
    if result["workload"] == "seed":
        return _seed_text(result)
    items = [
        ("store", f"{one_line(result['path'])} ({result['store']})"),
        ("geometry", geometry_text(result["geometry"])),
        ("pool", f"{result['pool_pages']:,} pages = {nbytes(result['pool_bytes'])}"),
        ("requests", f"{result['sequences']:,} sharing a system prompt; {result['follow_ups']} resumed "
                     f"an earlier chat, {result['forks']} sampled twice (fork)"),
        ("tokens", f"{result['tokens']:,} computed (prefill {result['prefill_tokens']:,} + decode "
                   f"{result['decode_tokens']:,})"),
        ("prefix cache", f"{result['reused_tokens']:,} of {result['prompt_tokens']:,} prompt tokens "
                         f"reused ({100 * result['prefix_hit_rate']:.1f}%)"),
        ("steps / commits", f"{result['steps']:,} / {result['commits']:,} ({result['durability']})"),
        ("pages", f"{plural(result['pages'], 'page')} allocated; at the end {result['pages_live']:,} live, "
                  f"{result['cached_pages']:,} of them cached only; {plural(result['cow_copies'], 'copy', 'copies')} "
                  "on write"),
        ("evictions", f"{result['evictions']:,}"),
        ("restores", f"{result['restores']:,}"),
        ("resident hit rate", f"{100 * result['resident_hit_rate']:.1f}%"),
        ("spill hit rate", f"{100 * result['spill_hit_rate']:.1f}% ({plural(result['misses'], 'miss', 'misses')})"),
        ("restore latency", _latency_text(result)),
        ("bytes spilled", nbytes(result["bytes_spilled"])),
        ("bytes restored", nbytes(result["bytes_restored"])),
        ("throughput", f"{result['tokens_per_s']:,.0f} tokens/s ({result['seconds']:.2f} s)"),
        ("verified", f"{result['verified_tokens']:,} tokens read back bit-exact, "
                     f"{result['spot_checks']:,} spot checks inside steps, check() clean"),
    ]
    probe = result["reopen_prefix"]
    if probe["id"] is not None:
        items.append(("after reopen", f"{probe['cached']:,} of {probe['tokens']:,} tokens of finished "
                                      f"chat {show_id(probe['id'])} still cached for reuse"))
    return clean(pairs(items) + f"\n\nnext: pagedkv inspect {one_line(shell_arg(result['path']))}")


def _latency_text(result: dict[str, Any]) -> str:
    if not result["restores"]:
        return "no restores"
    return f"p50 {result['restore_ms_p50']:.3f} ms, p99 {result['restore_ms_p99']:.3f} ms"



def _seed_text(result: dict[str, Any]) -> str:
    first, again = result["read"], result["reread"]
    items = [
        ("store", f"{one_line(result['path'])} ({result['store']})"),
        ("geometry", geometry_text(result["geometry"])),
        ("written", f"{result['tokens']:,} tokens x {result['token_bytes']} B in "
                    f"{result['seconds']:.2f} s ({result['tokens_per_s']:,.0f} tokens/s)"),
        ("pool", f"{result['pool_pages']:,} pages = {result['pool_bytes']:,} B"),
        ("evictions", f"{result['evictions']:,} ({result['spilled_pages']:,} pages spilled, "
                      f"{nbytes(result['bytes_spilled'])})"),
    ]
    rows = [[name, str(r["memory_hits"]), str(r["disk_hits"]), str(r["misses"]),
             f"{r['restore_ms_mean']:.3f}", "bit-exact" if r["verified"] else "DIFFERS"]
            for name, r in (("read tokens 0-19", first), ("read them again", again))]
    grid = table(["", "memory hits", "disk hits", "misses", "avg restore ms", "content"], rows)
    return clean(pairs(items) + "\n\n" + grid + f"\n\nnext: pagedkv inspect {one_line(shell_arg(result['path']))}")

