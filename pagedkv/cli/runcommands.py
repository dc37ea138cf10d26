"""The commands that run workloads: ``demo`` (a serving or seeding workload into a store)
and ``bench`` (the benchmark suite)."""

from __future__ import annotations

import sys
import time

import click

from ..bench import suite as bench_mod
from . import demotext, text as clitext
from ..demo import seedload, workload as demo_mod
from ..errors import PagedKVError, StoreLocked
from ..geometry import PRESETS
from .options import _progress, command, emit, json_option

DEFAULT_PRESET, DEFAULT_POOL_PAGES, DEFAULT_SEQUENCES, DEFAULT_TOKENS = "small", 64, 64, 128


@command()
@click.argument("path", default="demo.kv", required=False, type=click.Path(path_type=str))
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None,
              help=f"Page geometry (default {DEFAULT_PRESET}).")
@click.option("--pool-pages", type=click.IntRange(min=1), default=None,
              help=f"Pool slots; keep it far below the working set (default {DEFAULT_POOL_PAGES}).")
@click.option("--sequences", type=click.IntRange(min=1), default=None,
              help=f"Requests to serve (default {DEFAULT_SEQUENCES}).")
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help=f"Most new tokens a request generates (default {DEFAULT_TOKENS}).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the K/V content and arrivals.")
@click.option("--durability", type=click.Choice(["durable", "nosync"]), default="durable",
              show_default=True, help="Commit mode of the store.")
@click.option("--seed-workload", is_flag=True,
              help="Instead: 20,000 tokens of 60 bytes into a 0.5 MB pool, then read tokens 0-19 back.")
@click.option("--force", is_flag=True,
              help="Replace a pagedkv store at PATH even if no demo made it (its data is lost).")
@json_option
def demo(path: str, preset: str | None, pool_pages: int | None, sequences: int | None,
         tokens: int | None, seed: int, durability: str, seed_workload: bool, force: bool,
         as_json: bool) -> None:
    """Run a serving workload under memory pressure into a fresh store at PATH.

    Requests share a system prompt, prefill then decode through store.step()
    with K/V written through the slot mapping, finish and arrive, and commit
    periodically, while a pool far smaller than the working set spills pages
    to LMDB and restores them. Everything read back is checked bit-exact
    (exit 1 if anything differs). PATH (default ./demo.kv) may be missing,
    empty, or a store an earlier demo made (replaced). Any other pagedkv store
    is refused unless --force; any other non-empty directory is refused,
    --force or not (exit 2).

    \b
    Example:
        pagedkv demo
        pagedkv demo /tmp/kv --preset tiny --pool-pages 32 --sequences 100
        pagedkv demo --seed-workload --json
    """
    if seed_workload:
        given = [name for name, value in (("--preset", preset), ("--pool-pages", pool_pages),
                                          ("--sequences", sequences), ("--tokens", tokens)) if value is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} cannot be combined with --seed-workload")
        action = _prepare(path, force)  # before the bar: a refusal stays one line
        # Made here, marked as the demo's, so that a later demo may replace it.
        demo_mod.create_demo_store(path, seedload.SEED_GEOMETRY,
                                   seedload.SEED_POOL_BYTES // seedload.SEED_GEOMETRY.page_nbytes, durability)
        with _progress(seedload.SEED_TOKENS, "seeding", "tokens", as_json) as bar:
            result = seedload.run_seed(path, seed, durability, bar.update, action=action)
    else:
        geom = PRESETS[preset or DEFAULT_PRESET]
        sequences, tokens = sequences or DEFAULT_SEQUENCES, tokens or DEFAULT_TOKENS
        try:
            demo_mod.serving_limits(geom, pool_pages or DEFAULT_POOL_PAGES, tokens)  # before touching PATH
        except PagedKVError as exc:
            raise click.UsageError(str(exc)) from None
        action = _prepare(path, force)
        with _progress(sequences, "serving", "requests", as_json) as bar:
            result = demo_mod.run_serving(path, geom, pool_pages or DEFAULT_POOL_PAGES, sequences,
                                          tokens, seed, durability, bar.update, action=action)
    result["preset"] = None if seed_workload else (preset or DEFAULT_PRESET)
    emit(as_json, result, demotext.demo_text(result))


def _prepare(path: str, force: bool) -> str:
    """``demo.prepare_path``; a PATH it refuses is a usage error, a store in use stays locked."""
    try:
        return demo_mod.prepare_path(path, force)
    except StoreLocked:
        raise
    except PagedKVError as exc:
        if type(exc) is not PagedKVError:
            raise  # an I/O failure removing the old store is not the argument's fault
        raise click.BadParameter(str(exc), param_hint="PATH") from None


@command()
@click.option("--quick", is_flag=True, help="Small sizes, as CI runs it (checks that it runs, not its numbers).")
@click.option("--scenario", "scenarios", metavar="ID", multiple=True,
              help=f"Run only this scenario (repeatable, any case): {', '.join(bench_mod.SCENARIOS)}.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--workdir", type=click.Path(exists=True, file_okay=False, path_type=str), default=None,
              help="Where the temporary stores go (default: the temp dir); durable rows measure its disk.")
@json_option
def bench(quick: bool, scenarios: tuple[str, ...], seed: int, workdir: str | None, as_json: bool) -> None:
    """Run the benchmarks of docs/performance.md (B1-B8), B9 (prefetch), B10 (remote tier) and print their table.

    Each row is a pagedkv figure beside its reference measured in the same
    process, interleaved (A B A B ...), their ratio and the target. Progress
    goes to stderr when it is a terminal. --json prints {"schema": 1, "rows":
    [...]}, each row with stable keys: scenario, name, pagedkv, reference,
    unit, ratio, target, meets, params, notes, metrics. The full suite takes
    minutes and gigabytes of disk.

    \b
    Example:
        pagedkv bench --quick
        pagedkv bench --scenario B4 --scenario b7
        pagedkv bench --quick --json > bench.json
    """
    try:
        ids = bench_mod.scenario_ids(scenarios or None)  # refuse an unknown id before running anything
    except PagedKVError as exc:
        raise click.BadParameter(str(exc), param_hint="'--scenario'") from None
    started = time.perf_counter()

    def progress(line: str) -> None:
        click.echo(clitext.one_line(f"[{time.perf_counter() - started:7.1f}s] {line}"), err=True)

    rows = bench_mod.run(ids, quick=quick, seed=seed, workdir=workdir,
                         progress=progress if sys.stderr.isatty() else None)
    emit(as_json, {"rows": rows}, clitext.clean(bench_mod.format_table(rows)))
