"""The benchmark suite (``pagedkv bench``, ``python tools/bench.py``): scenarios B1-B8 of docs/performance.md, B9 (prefetch), B10 (remote tier).

Every figure with a reference is a ratio measured in one process, interleaved
with its reference (A B A B ..., median of the per-pair ratios), because absolute
times on a shared machine mean little from one run to the next. Scenarios and
targets are those of docs/performance.md; ``quick=True`` shrinks every scenario so CI
can check that the suite runs (not its numbers).

A row is a dict with the keys of ``ROW_KEYS``: ``scenario`` ("B1".."B8"),
``name``, ``pagedkv`` and ``reference`` (figures in ``unit``; the reference is
None where there is none), ``ratio`` (pagedkv / reference, None without a
reference), ``target`` (text), ``meets`` (bool, or None when there is nothing to
check here), ``params`` (sizes, geometry), ``notes`` (what was measured) and
``metrics`` (extra figures: restore latency, hits, ...).
"""

from __future__ import annotations

import math
import tempfile
from typing import Any, Callable, Iterable

from .churn import b4_churn
from .decode import b2_all
from .growth import b7_all
from .prefetch import b9_prefetch
from .remote import b10_remote
from .data import b1_prefill, b3_read
from .mem import b8_memory
from .meta import b6_reopen
from .seedread import b5_all
from .util import ROW_KEYS, Ctx
from ..errors import PagedKVError

__all__ = ["SCENARIOS", "ROW_KEYS", "run", "format_table", "scenario_ids"]

Scenario = Callable[[Ctx], list[dict[str, Any]]]

# id -> (title, function); the order is the run order.
SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "B1": ("prefill append vs page-by-page memmap copy", b1_prefill),
    "B2": ("decode bookkeeping: step() vs a pure-Python block manager; with token ids, also vs vLLM's "
           "KVCacheManager; a one-sequence step's fixed cost, and on a pool 1,000x larger", b2_all),
    "B3": ("read whole sequences vs numpy copy", b3_read),
    "B4": ("spill/restore churn vs raw LMDB (and one file per page), per spill codec", b4_churn),
    "B5": ("the seed workload: 20,000 60-byte tokens, 0.5 MB pool; a spilled page's read vs a bare LMDB get",
           b5_all),
    "B6": ("reopen time at 10k/100k/1M pages", b6_reopen),
    "B7": ("commit after a 256-sequence decode step vs a bare LMDB commit and the same records; "
           "at 10k vs 1M directory pages", b7_all),
    "B8": ("anonymous memory per page of metadata", b8_memory),
    "B9": ("decode loop over spilled sequences with prefetch one step ahead vs without", b9_prefetch),
    "B10": ("remote tier: fetch from Redis vs raw redis-py GETs; a reused prompt on host B vs computing it",
            b10_remote),
}


def scenario_ids(scenarios: Iterable[str] | None) -> list[str]:
    """Validate scenario ids (case-insensitive); return them in run order, once each.

    Raises ``PagedKVError`` naming the unknown ones.
    """
    if scenarios is None:
        return list(SCENARIOS)
    wanted = {str(name).strip().upper() for name in scenarios}
    unknown = sorted(wanted - set(SCENARIOS))
    if unknown:
        raise PagedKVError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    return [name for name in SCENARIOS if name in wanted]


def run(scenarios: list[str] | None = None, quick: bool = False, seed: int = 0, *,
        workdir: str | None = None, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run the scenarios (all when None) and return their rows.

    Params:
        scenarios: ids such as ["B1", "B4"]; None runs all (B1-B10).
        quick: small sizes for CI (the whole suite in well under a minute).
        seed: seeds every random choice (contents, prompt lengths, access orders).
        workdir: parent directory of the temporary stores (default: the system
            temp dir); use a local disk, since the durable rows measure syncs.
        progress: called with a line of text as each scenario (or phase) starts.
    Raises:
        PagedKVError for an unknown scenario id.
    """
    ids = scenario_ids(scenarios)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-", dir=workdir) as tmp:
        ctx = Ctx(workdir=tmp, quick=quick, seed=seed, progress=progress)
        for name in ids:
            title, fn = SCENARIOS[name]
            ctx.say(f"{name}: {title}{' (quick)' if quick else ''}")
            rows.extend(fn(ctx))
    return rows


def _fmt(value: Any) -> str:
    """A figure with 4 significant digits (no exponent for everyday magnitudes)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0 or math.isnan(value) or math.isinf(value):
            return str(value)
        if 1e-3 <= abs(value) < 1e7:
            digits = max(0, 3 - int(math.floor(math.log10(abs(value)))))
            return f"{value:.{digits}f}"
        return f"{value:.3e}"
    return str(value)


def format_table(rows: list[dict[str, Any]], details: bool = True) -> str:
    """A plain-text table of rows (scenario, name, figures, ratio, target, meets), then their metrics.

    The ratio column is pagedkv / reference in the row's unit: above 1 is better
    for a rate (GiB/s), below 1 is better for a time (us, ms).
    """
    header = ("id", "scenario", "pagedkv", "reference", "unit", "ratio", "target", "meets")
    table = [header] + [
        (row["scenario"], row["name"], _fmt(row["pagedkv"]), _fmt(row["reference"]), row["unit"],
         _fmt(row["ratio"]), row["target"], "-" if row["meets"] is None else _fmt(row["meets"]))
        for row in rows
    ]
    widths = [max(len(str(line[col])) for line in table) for col in range(len(header))]
    right = {2, 3, 5}  # numbers align right
    lines = []
    for index, line in enumerate(table):
        cells = [str(cell).rjust(width) if col in right else str(cell).ljust(width)
                 for col, (cell, width) in enumerate(zip(line, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    misses = [row for row in rows if row["meets"] is False]
    lines.append("")
    lines.append(f"{len(rows)} rows; {len(misses)} miss their target"
                 + (": " + ", ".join(f"{row['scenario']} {row['name']}" for row in misses) if misses else ""))
    if details:
        for row in rows:
            # Per-pass counters stay in the JSON; the table keeps the headline metrics.
            shown = {key: value for key, value in row["metrics"].items() if not key.endswith("_per_pass")}
            if shown:
                text = ", ".join(f"{key}={_fmt(value)}" for key, value in shown.items())
                lines.append(f"  {row['scenario']} {row['name']}: {text}")
    return "\n".join(lines)
