"""The ``pagedkv`` command line: a thin click shell over demo, inspector and the store.

Exit codes: 0 ok; 2 invalid input, a damaged store, or any other error; 3 the
store is locked by a live writer. Every error is one ``Error: ...`` line on
stderr (set ``PAGEDKV_DEBUG=1`` to see the traceback instead).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any, Callable

import click
from click.utils import PacifyFlushWrapper

from . import __version__, bench as bench_mod, clitext, demo as demo_mod, inspector, seedload
from .errors import PagedKVError, StoreCorrupt, StoreLocked
from .geometry import PRESETS
from .lockfile import lock_holder
from .snapshot import LOCK_FILE, SnapshotUnavailable, open_snapshot

EXIT_INVALID, EXIT_LOCKED = 2, 3
DEFAULT_PRESET, DEFAULT_POOL_PAGES, DEFAULT_SEQUENCES, DEFAULT_TOKENS = "small", 64, 64, 128


def _fail(message: str, code: int) -> None:
    click.echo(f"Error: {clitext.one_line(message)}", err=True)
    sys.exit(code)


class PagedKVGroup(click.Group):
    """A group whose every failure, usage errors included, is one escaped line on stderr."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            hint = f"see '{exc.ctx.command_path} --help'" if exc.ctx else ""
            if isinstance(exc, click.NoSuchOption):
                hint += "; put '--' before a path that starts with '-'"
            _fail(exc.format_message().rstrip(".") + (f" ({hint})" if hint else ""), EXIT_INVALID)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except Exception as exc:  # noqa: BLE001 - the one place that turns errors into exit codes
            self._report(exc)
        sys.exit(code if isinstance(code, int) else 0)

    @staticmethod
    def _report(exc: Exception) -> None:
        if os.environ.get("PAGEDKV_DEBUG"):
            raise exc
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            # The reader went away (``| head``): say nothing, and keep the final flush quiet.
            sys.stdout = PacifyFlushWrapper(sys.stdout)  # type: ignore[assignment]
            sys.exit(1)
        if isinstance(exc, StoreLocked):
            _fail(str(exc), EXIT_LOCKED)
        if isinstance(exc, PagedKVError):
            _fail(str(exc) or type(exc).__name__, EXIT_INVALID)
        if isinstance(exc, OSError):
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"{where}{exc.strerror or exc}", EXIT_INVALID)
        _fail(f"unexpected {type(exc).__name__}: {exc}", EXIT_INVALID)


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The shared ``--json`` flag (machine output with stable keys)."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON with stable keys instead of text.")(fn)


def _path_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    # No exists=True: click's own check prints a multi-line usage message, and a bad
    # path must be one line (T14); the inspector validates the path itself.
    return click.argument("path", type=click.Path(path_type=str))(fn)


def _emit(as_json: bool, value: Any, text: str) -> None:
    click.echo(clitext.to_json(value) if as_json else clitext.clean(text))


@click.group(cls=PagedKVGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="pagedkv")
def cli() -> None:
    """pagedkv: a persistent, paged KV-cache store for LLM inference.

    \b
    Example:
        pagedkv demo                 # run a serving workload into ./demo.kv
        pagedkv inspect demo.kv      # look inside it (read-only)
        pagedkv verify demo.kv       # check every page checksum
        pagedkv bench --quick        # the benchmark suite, small
    """


@cli.command()
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
    to LMDB and restores them. Everything read back is checked bit-exact.
    PATH (default ./demo.kv) may be missing, empty, or a store an earlier
    demo made (replaced). Any other pagedkv store is refused unless --force;
    any other non-empty directory is refused, --force or not.

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
        action = demo_mod.prepare_path(path, force)  # before the bar: a refusal stays one line
        # Made here, marked as the demo's, so that a later demo may replace it.
        demo_mod.create_demo_store(path, seedload.SEED_GEOMETRY,
                                   seedload.SEED_POOL_BYTES // seedload.SEED_GEOMETRY.page_nbytes, durability)
        with _progress(seedload.SEED_TOKENS, "seeding", as_json) as bar:
            result = seedload.run_seed(path, seed, durability, bar.update, action=action)
    else:
        geom = PRESETS[preset or DEFAULT_PRESET]
        sequences, tokens = sequences or DEFAULT_SEQUENCES, tokens or DEFAULT_TOKENS
        demo_mod.serving_limits(geom, pool_pages or DEFAULT_POOL_PAGES, tokens)  # before touching PATH
        action = demo_mod.prepare_path(path, force)
        with _progress(sequences, "serving", as_json) as bar:
            result = demo_mod.run_serving(path, geom, pool_pages or DEFAULT_POOL_PAGES, sequences,
                                          tokens, seed, durability, bar.update, action=action)
    result["preset"] = None if seed_workload else (preset or DEFAULT_PRESET)
    _emit(as_json, result, clitext.demo_text(result))


def _progress(length: int, label: str, quiet: bool) -> Any:
    """A progress bar on stderr when it is a terminal, else a silent stand-in."""
    if quiet or not sys.stderr.isatty():
        return _Silent()
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=False)


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, steps: int) -> None:
        """Ignore progress."""


@cli.command()
@_path_argument
@click.option("--sequences", "show_sequences", is_flag=True, help="List sequences with their page counts.")
@click.option("--seq", "seq_id", metavar="ID", default=None,
              help="Show one block table (a str id, or an int id when no such str exists).")
@click.option("--page", "page_uid", metavar="UID", default=None,
              help="Show a page's header and per-layer K/V statistics.")
@click.option("--map", "show_map", is_flag=True, help="Draw the pool slots as a grid.")
@json_option
def inspect(path: str, show_sequences: bool, seq_id: str | None, page_uid: str | None,
            show_map: bool, as_json: bool) -> None:
    """Show what is inside the store at PATH, read-only.

    Never writes a byte: works with no writer, on a read-only copy, and beside
    a live writer (whose pid is shown; metadata then comes from a private
    snapshot). Without options it prints a summary; --sequences, --seq, --page
    and --map can be combined (JSON: one object keyed by form).

    \b
    Example:
        pagedkv inspect demo.kv
        pagedkv inspect demo.kv --sequences
        pagedkv inspect demo.kv --seq system --json
        pagedkv inspect demo.kv --page 12 --map
    """
    uid = _parse_uid(page_uid) if page_uid is not None else None
    with open_snapshot(path, live=True) as snap:
        forms: list[tuple[str, Any, Callable[[Any], str]]] = []
        if show_sequences:
            forms.append(("sequences", inspector.sequences(snap), clitext.sequences_text))
        if seq_id is not None:
            forms.append(("seq", inspector.seq_table(snap, seq_id), clitext.seq_text))
        if uid is not None:
            forms.append(("page", inspector.page_info(snap, uid), clitext.page_text))
        if show_map:
            forms.append(("map", inspector.pool_map(snap), clitext.map_text))
        if not forms:
            info = inspector.summary(snap)
            _emit(as_json, info, clitext.summary_text(info))
            return
    value = {name: data for name, data, _ in forms}
    _emit(as_json, value, "\n\n".join(render(data) for _, data, render in forms))


def _parse_uid(text: str) -> int:
    try:
        uid = int(text.strip(), 0)
    except ValueError:
        raise PagedKVError(f"--page takes an integer page uid, got {text!r}") from None
    if not 0 <= uid < 1 << 64:
        raise PagedKVError(f"page uid {uid} is outside 0..2**64-1")
    return uid


_LIVE_LOOKS = 4  # fresh snapshots that damage seen beside a live writer gets to show again


def _verify_looks(path: str, live: bool) -> dict[str, Any]:
    """``inspector.verify`` of a snapshot; beside a live writer, damage only if a fresh one agrees.

    A copied snapshot is consistent (``snapshot.py``), but a writer that starts
    during a plain read-only open, or rewrites pool slots between reads, can
    still make one look see what the store does not hold. Real damage stays on
    every look, so beside a live writer a problem is reported only when two
    looks in a row show it; a clean fresh look wins, and looks that never agree
    are no consistent snapshot at all.
    """
    previous: set[str] | None = None  # the problems of the previous look, if it found any
    open_failed = False
    for _ in range(_LIVE_LOOKS):
        try:
            snap = open_snapshot(path, live=live)
        except SnapshotUnavailable:
            raise
        except StoreLocked as exc:
            raise StoreLocked(f"{exc}; use --live to verify a snapshot beside it") from None
        except StoreCorrupt:
            if open_failed or not _writer_live(path):
                raise
            open_failed, previous = True, None
            continue
        open_failed = False
        with snap:
            result = inspector.verify(snap)
        if result["ok"] or not (result["live"] or _writer_live(path)):
            if previous:
                result["notes"].append(f"an earlier snapshot showed {len(previous)} problems this fresh one "
                                       "does not: the live writer changed those pages since")
            return result
        if previous is not None and previous & set(result["damage"]):
            result["unverified"] += [p for p in result["damage"] if p not in previous]
            result["damage"] = [p for p in result["damage"] if p in previous]
            return result
        previous = set(result["damage"])
    raise SnapshotUnavailable(
        f"{path}: could not get a consistent snapshot: what looked like damage beside the live "
        f"writer did not show again on {_LIVE_LOOKS} fresh snapshots")


def _writer_live(path: str) -> bool:
    """Whether a writer holds the store's lock now."""
    return lock_holder(os.path.join(path, LOCK_FILE)) is not None


@cli.command()
@_path_argument
@click.option("--live", is_flag=True,
              help="Verify a private snapshot even while a writer holds the lock.")
@json_option
def verify(path: str, live: bool, as_json: bool) -> None:
    """Check every page checksum and invariant of the store at PATH, read-only.

    Exit 0 when clean, 2 when damaged (each problem is printed), 3 when a
    live writer holds the lock (unless --live) or, with --live, commits too
    busily for a consistent snapshot ("could not get a consistent snapshot";
    try again). Beside a live writer, damage is reported only when a fresh
    snapshot shows it again. Spill records left by an interrupted writer are
    reported as notes, not damage: the next writer open deletes them.

    \b
    Example:
        pagedkv verify demo.kv
        pagedkv verify demo.kv --json
        pagedkv verify demo.kv --live
    """
    result = _verify_looks(path, live)
    _emit(as_json, result, clitext.verify_text(result))
    if not result["ok"]:
        sys.exit(EXIT_INVALID)



@cli.command()
@click.option("--quick", is_flag=True, help="Small sizes, as CI runs it (checks that it runs, not its numbers).")
@click.option("--scenario", "scenarios", metavar="ID", multiple=True,
              help=f"Run only this scenario (repeatable, any case): {', '.join(bench_mod.SCENARIOS)}.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--workdir", type=click.Path(exists=True, file_okay=False, path_type=str), default=None,
              help="Where the temporary stores go (default: the temp dir); durable rows measure its disk.")
@json_option
def bench(quick: bool, scenarios: tuple[str, ...], seed: int, workdir: str | None, as_json: bool) -> None:
    """Run the benchmarks of PERFORMANCE.md (B1-B8) and B9 (prefetch) and print their table.

    Each row is a pagedkv figure beside its reference measured in the same
    process, interleaved (A B A B ...), their ratio and the target. Progress
    goes to stderr when it is a terminal. --json prints the rows with stable
    keys: scenario, name, pagedkv, reference, unit, ratio, target, meets,
    params, notes, metrics. The full suite takes minutes and gigabytes of disk.

    \b
    Example:
        pagedkv bench --quick
        pagedkv bench --scenario B4 --scenario b7
        pagedkv bench --quick --json > bench.json
    """
    ids = bench_mod.scenario_ids(scenarios or None)  # refuse an unknown id before running anything
    started = time.perf_counter()

    def progress(line: str) -> None:
        click.echo(clitext.one_line(f"[{time.perf_counter() - started:7.1f}s] {line}"), err=True)

    rows = bench_mod.run(ids, quick=quick, seed=seed, workdir=workdir,
                         progress=progress if sys.stderr.isatty() else None)
    _emit(as_json, rows, bench_mod.format_table(rows))
