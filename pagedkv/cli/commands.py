"""The ``pagedkv`` command line: a thin click shell over demo, inspector, compact and the store.

Exit codes (the same table is in the README and in every command's help):
0 ok; 1 damage found (``verify``); 2 usage error; 3 locked (or no consistent
snapshot beside a live writer); 4 not a store, or it cannot be opened or
operated on; 70 an internal error (a bug); 130 interrupted (Ctrl-C); 141 the
reader of stdout went away. Every error is one ``Error: ...`` line on stderr,
and with ``--json`` also an error object on stdout (set ``PAGEDKV_DEBUG=1`` to
see the traceback instead).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, NoReturn

import click

from .. import __version__, compact as compact_mod
from ..bench import suite as bench_mod
from . import text as clitext
from ..demo import workload as demo_mod, seedload
from ..inspection import report as inspector
from ..errors import PageCorrupt, PagedKVError, SequenceNotFound, StoreCorrupt, StoreLocked
from ..inspection.cachereport import lifetime
from ..geometry import PRESETS
from ..demo.kvgen import DemoFailed
from ..storage.lockfile import lock_holder
from ..opening import open_store
from ..snapshot import LOCK_FILE, SnapshotUnavailable, open_snapshot, require_store_dir
from .. import metrics

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE, EXIT_LOCKED, EXIT_NOT_STORE = 0, 1, 2, 3, 4
EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PIPE = 70, 130, 141
JSON_SCHEMA = 1  # bumped when a key of any --json output changes meaning or goes away
DEFAULT_PRESET, DEFAULT_POOL_PAGES, DEFAULT_SEQUENCES, DEFAULT_TOKENS = "small", 64, 64, 128

# click 8.2+ raises this for a group run without a command (8.1 printed the help itself).
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())

EXIT_CODES_HELP = """\b
Exit codes:
  0    ok
  1    damage found (verify: a damaged page, record or metadata, or a store
       too damaged to open)
  2    usage error: a bad option or argument, or an id that names nothing
  3    locked: a writer holds the store, or beside a live writer no
       consistent snapshot could be taken (try again)
  4    not a pagedkv store, or it cannot be opened or operated on (an I/O
       error, a full disk, a newer format)
  70   internal error (a bug in pagedkv)
  130  interrupted (Ctrl-C)
With --json, an error is also printed on stdout as
{"schema": 1, "error": {"kind", "message", "exit_code"}}.
"""


class _BrokenPipe(Exception):
    """stdout's reader went away while a command wrote to it."""


class CommandFailed(Exception):
    """A failure with its exit code decided by the command that saw it."""

    def __init__(self, kind: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.kind, self.message, self.exit_code = kind, message, exit_code


def _wants_json(args: list[str]) -> bool:
    """Whether ``--json`` is among the options (before a ``--`` that ends them)."""
    options = args[:args.index("--")] if "--" in args else args
    return "--json" in options


def _fail(kind: str, message: str, code: int, as_json: bool) -> NoReturn:
    line = clitext.one_line(message)
    if as_json:
        _echo_out(clitext.to_json({"schema": JSON_SCHEMA,
                                   "error": {"kind": kind, "message": message, "exit_code": code}}))
    click.echo(f"Error: {line}", err=True)
    sys.exit(code)


def _echo_out(text: str) -> None:
    click.echo(clitext.fit_encoding(text, getattr(sys.stdout, "encoding", None)))


def classify(exc: BaseException) -> tuple[str, str, int]:
    """(kind, message, exit code) of an error a command raised."""
    if isinstance(exc, CommandFailed):
        return exc.kind, exc.message, exc.exit_code
    kind = type(exc).__name__
    message = str(exc) or kind
    if isinstance(exc, StoreLocked):
        return kind, message, EXIT_LOCKED
    if isinstance(exc, SequenceNotFound | inspector.PageNotFound):
        return kind, message, EXIT_USAGE  # an argument that names nothing in the store
    if isinstance(exc, DemoFailed):
        return kind, message, EXIT_DAMAGE
    if isinstance(exc, PagedKVError):
        return kind, message, EXIT_NOT_STORE
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return kind, f"{where}{exc.strerror or exc}", EXIT_NOT_STORE
    return "InternalError", f"unexpected {kind}: {exc}", EXIT_INTERNAL


class PagedKVGroup(click.Group):
    """A group whose every failure, usage errors included, is one escaped line on stderr.

    With ``--json`` anywhere among the options the failure is also an error object
    on stdout, so a script parsing stdout always gets JSON.
    """

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        as_json = _wants_json(argv)
        try:
            code = super().main(argv, prog_name, complete_var, False, **extra)
            sys.stdout.flush()  # here, so that a reader gone away (``| head``) is seen below
        except _NO_ARGS_IS_HELP as exc:  # bare ``pagedkv``: help, as --help does
            click.echo(exc.ctx.get_help() if exc.ctx else self.get_help(click.Context(self)))
            sys.exit(EXIT_OK)
        except click.UsageError as exc:
            hint = f"see '{exc.ctx.command_path} --help'" if exc.ctx else ""
            if isinstance(exc, click.NoSuchOption):
                hint += "; put '--' before a path that starts with '-'"
            _fail("UsageError", exc.format_message().rstrip(".") + (f" ({hint})" if hint else ""),
                  EXIT_USAGE, as_json)
        except click.FileError as exc:
            _fail("FileError", exc.format_message(), EXIT_NOT_STORE, as_json)
        except click.ClickException as exc:
            _fail("UsageError", exc.format_message(), EXIT_USAGE, as_json)
        except (click.Abort, KeyboardInterrupt):
            _fail("Interrupted", "interrupted", EXIT_INTERRUPTED, as_json)
        except Exception as exc:  # noqa: BLE001 - the one place that turns errors into exit codes
            self._report(exc, as_json)
        sys.exit(code if isinstance(code, int) else EXIT_OK)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a broken pipe leaves here as ``_BrokenPipe`` (click would make it exit 1)."""
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise _BrokenPipe() from exc
            raise

    @staticmethod
    def _report(exc: Exception, as_json: bool) -> NoReturn:
        if os.environ.get("PAGEDKV_DEBUG"):
            raise exc
        if isinstance(exc, _BrokenPipe) or isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            # The reader went away (``| head``): say nothing, as a tool killed by SIGPIPE
            # would, and point stdout at /dev/null so the interpreter's last flush is quiet.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, AttributeError, ValueError):
                pass  # not a real stream (a test runner's): nothing will flush to a pipe
            sys.exit(EXIT_PIPE)
        _fail(*classify(exc), as_json=as_json)


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The shared ``--json`` flag (machine output with stable keys and a ``schema`` version)."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print JSON with stable keys (\"schema\": {JSON_SCHEMA}) instead of text; "
                             "errors too.")(fn)


def _path_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    # No exists=True: click's own check prints a multi-line usage message, and a bad
    # path must be one line (T14); the commands validate the path themselves.
    return click.argument("path", type=click.Path(path_type=str))(fn)


def _emit(as_json: bool, value: Any, text: str) -> None:
    """Print ``value`` as JSON (with the schema version) or ``text`` (already escaped by clitext)."""
    if as_json:
        body = {"schema": JSON_SCHEMA, **value} if isinstance(value, dict) else value
        _echo_out(clitext.to_json(body))
    else:
        _echo_out(text)


def _command(**kwargs: Any) -> Callable[[Callable[..., Any]], click.Command]:
    """``cli.command`` with the exit-code table as every command's help epilog."""
    return cli.command(epilog=EXIT_CODES_HELP, **kwargs)


@click.group(cls=PagedKVGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_CODES_HELP)
@click.version_option(version=__version__, prog_name="pagedkv")
def cli() -> None:
    """pagedkv: a persistent, paged KV-cache store for LLM inference.

    \b
    Example:
        pagedkv demo                 # run a serving workload into ./demo.kv
        pagedkv inspect demo.kv      # look inside it (read-only)
        pagedkv verify demo.kv       # check every page checksum
        pagedkv stats demo.kv        # counters and occupancy
        pagedkv gc demo.kv           # drop cached prefix pages
        pagedkv compact demo.kv      # give LMDB's free pages back to the disk
        pagedkv bench --quick        # the benchmark suite, small
    """


@_command()
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
    _emit(as_json, result, clitext.demo_text(result))


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


def _progress(length: int, label: str, unit: str, quiet: bool) -> Any:
    """A progress bar with its rate on stderr when it is a terminal, else a silent stand-in."""
    if quiet or not sys.stderr.isatty():
        return _Silent()
    bar = click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)
    started = time.monotonic()
    bar.item_show_func = lambda _item: clitext.rate_text(bar.pos, time.monotonic() - started, unit)
    return bar


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, steps: int) -> None:
        """Ignore progress."""


def _map_style() -> tuple[int, bool]:
    """(cells per row, colour) for ``--map``: the terminal's width and colour on a terminal.

    Colour follows the NO_COLOR convention (any non-empty value turns it off) and
    is never used for a dumb terminal; off a terminal the grid is 64 wide, plain.
    """
    if not sys.stdout.isatty():
        return inspector.MAP_WIDTH, False
    columns = shutil.get_terminal_size((80, 24)).columns
    width = max(16, min(512, columns - clitext.MAP_GUTTER))
    color = not os.environ.get("NO_COLOR") and os.environ.get("TERM", "") != "dumb"
    return width, color


@_command()
@_path_argument
@click.option("--sequences", "show_sequences", is_flag=True, help="List sequences with their page counts.")
@click.option("--seq", "seq_id", metavar="ID", default=None,
              help="Show one block table; ID as --sequences shows it: 'name' (quoted) or a bare word is "
                   "a str id, a bare integer is the int id (or the str, if no int has it).")
@click.option("--page", "page_uid", metavar="UID", default=None,
              help="Show a page's header and per-layer K/V statistics.")
@click.option("--map", "show_map", is_flag=True,
              help="Draw the pool slots as a grid with a legend (terminal width and colour on a terminal; "
                   "NO_COLOR turns colour off).")
@json_option
def inspect(path: str, show_sequences: bool, seq_id: str | None, page_uid: str | None,
            show_map: bool, as_json: bool) -> None:
    """Show what is inside the store at PATH, read-only.

    Never writes a byte when no writer holds the store (works on a read-only
    copy too); beside a live writer (whose pid is shown) it reads the snapshot
    of the writer's last commit through a reader slot in spill/lock.mdb, with
    no copy and no temporary files. Without options it prints a summary, with
    a warning when the filesystem is nearly full; --sequences, --seq, --page
    and --map can be combined (JSON: one object keyed by form).

    \b
    Example:
        pagedkv inspect demo.kv
        pagedkv inspect demo.kv --sequences
        pagedkv inspect demo.kv --seq system --json
        pagedkv inspect demo.kv --seq 7          # the int id 7; --seq "'7'" is the str
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
            width, color = _map_style() if not as_json else (inspector.MAP_WIDTH, False)
            forms.append(("map", inspector.pool_map(snap, width=width),
                          lambda info: clitext.map_text(info, color=color)))
        if not forms:
            info = inspector.summary(snap)
            _emit(as_json, info, clitext.summary_text(info))
            if not as_json:  # JSON carries them in "warnings"
                for warning in info["warnings"]:
                    click.echo(f"warning: {clitext.one_line(warning)}", err=True)
            return
    value = {name: data for name, data, _ in forms}
    _emit(as_json, value, "\n\n".join(render(data) for _, data, render in forms))


def _parse_uid(text: str) -> int:
    try:
        uid = int(text.strip(), 0)
    except ValueError:
        raise click.BadParameter(f"takes an integer page uid, got {text!r}", param_hint="'--page'") from None
    if not 0 <= uid < 1 << 64:
        raise click.BadParameter(f"page uid {uid} is outside 0..2**64-1", param_hint="'--page'")
    return uid


_LIVE_LOOKS = 4  # fresh snapshots that damage seen beside a live writer gets to show again


def _verify_looks(path: str, live: bool) -> dict[str, Any]:
    """``inspector.verify`` of a snapshot; beside a live writer, damage only if a fresh one agrees.

    A registered reader's snapshot is consistent (``snapshot.py``), but a writer
    that starts during a plain read-only open, or rewrites pool slots between
    reads, can still make one look see what the store does not hold. Real damage
    stays on every look, so beside a live writer a problem is reported only when
    two looks in a row show it; a clean fresh look wins, and looks that never
    agree are no consistent snapshot at all.
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
                result["notes"].append(f"an earlier snapshot showed {clitext.plural(len(previous), 'problem')} "
                                       "this fresh one does not: the live writer changed those pages since")
            return result
        seen = {p["message"] for p in result["damage"]}
        if previous is not None and previous & seen:
            result["unverified"] += [p for p in result["damage"] if p["message"] not in previous]
            result["damage"] = [p for p in result["damage"] if p["message"] in previous]
            return result
        previous = seen
    raise SnapshotUnavailable(
        f"{path}: could not get a consistent snapshot: what looked like damage beside the live "
        f"writer did not show again on {_LIVE_LOOKS} fresh snapshots")


def _writer_live(path: str) -> bool:
    """Whether a writer holds the store's lock now."""
    return lock_holder(os.path.join(path, LOCK_FILE)) is not None


@_command()
@_path_argument
@click.option("--live", is_flag=True,
              help="Verify the snapshot of a live writer's last commit (through a reader slot) rather "
                   "than refuse.")
@json_option
def verify(path: str, live: bool, as_json: bool) -> None:
    """Check every page checksum and invariant of the store at PATH, read-only.

    Exit 0 when clean, 1 when damaged (each problem is printed; with --json
    each is {"kind", "page", "sequence", "message"}), 3 when a live writer
    holds the lock (unless --live) or, with --live, no consistent snapshot
    could be taken ("could not get a consistent snapshot"; try again). Beside
    a live writer, damage is reported only when a fresh snapshot shows it
    again. Spill records left by an interrupted writer are reported as notes,
    not damage: the next writer open deletes them.

    \b
    Example:
        pagedkv verify demo.kv
        pagedkv verify demo.kv --json
        pagedkv verify demo.kv --live || alert "demo.kv is damaged"
    """
    try:
        result = _verify_looks(path, live)
    except (StoreCorrupt, PageCorrupt) as exc:
        # Too damaged to open is damage found, not a path that names no store.
        raise CommandFailed(type(exc).__name__, str(exc), EXIT_DAMAGE) from None
    _emit(as_json, result, clitext.verify_text(result))
    if not result["ok"]:
        sys.exit(EXIT_DAMAGE)


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?b?)\s*", re.IGNORECASE)


class ByteSize(click.ParamType):  # type: ignore[type-arg]  # generic only in newer click
    """A byte count: ``1000000``, ``64MiB``, ``2G`` (units are binary: K = 1024), ``0``."""

    name = "BYTES"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """The number of bytes ``value`` spells; a usage error otherwise."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        match = _SIZE.fullmatch(str(value))
        if match is None:
            self.fail(f"{value!r} is not a byte count (e.g. 1000000, 64MiB, 2G)", param, ctx)
        number, unit = float(match.group(1)), match.group(2).lower()
        return int(number * 1024 ** "_kmgtp".index(unit or "_"))


def _open_writer(path: str) -> Any:
    """The store at ``path`` opened for writing; never creates one where there is none."""
    require_store_dir(path)
    return open_store(path)


@_command()
@_path_argument
@click.option("--max-bytes", type=ByteSize(), default=None,
              help="Keep the most recently used cached pages whose spill records fit in this many bytes "
                   "(e.g. 2GiB); default: drop every cached page.")
@json_option
def gc(path: str, max_bytes: int | None, as_json: bool) -> None:
    """Drop cached prefix pages of the store at PATH (pages no sequence uses).

    Pages of dropped sequences stay as a prefix cache, and a store opened
    without spill_limit_bytes never drops them by itself: the spill store
    grows with every prompt ever cached. gc drops the least recently used
    ones (all of them by default) in one committed transaction, the writer
    lock held (exit 3 if a writer holds it). LMDB reuses the pages it frees,
    but data.mdb does not shrink: 'pagedkv compact' gives them back.

    \b
    Example:
        pagedkv gc demo.kv
        pagedkv gc demo.kv --max-bytes 4GiB --json
        pagedkv gc demo.kv && pagedkv compact demo.kv
    """
    with _open_writer(path) as store:
        before = store.stats()
        result = dict(store.clear_cache(max_bytes))
        after = store.stats()
    report = {"path": path, "max_bytes": max_bytes, **result,
              "cached_pages_before": int(before["cached_pages"]), "cached_pages_after": int(after["cached_pages"])}
    _emit(as_json, report, clitext.gc_text(report))


@_command()
@_path_argument
@click.option("--prometheus", is_flag=True, help="Print the Prometheus text exposition format instead.")
@json_option
def stats(path: str, prometheus: bool, as_json: bool) -> None:
    """Print the figures of the store at PATH (KVStore.stats()), read-only.

    Opens the store as inspect does: no byte written with no writer, a reader
    slot beside a live one. Occupancy, sizes and codec figures are the store's
    as of its last commit; the activity counters (evictions, restores, hits...)
    count this command's own read-only handle, so they read zero: an engine's
    live counters are its process's KVStore.stats() or pagedkv.metrics. The
    totals the store records over every session to its last commit are shown
    apart ("lifetime").

    \b
    Example:
        pagedkv stats demo.kv
        pagedkv stats demo.kv --json
        pagedkv stats demo.kv --prometheus > /var/lib/node_exporter/pagedkv.prom
    """
    if prometheus and as_json:
        raise click.UsageError("--prometheus and --json cannot be combined")
    with open_snapshot(path, live=True) as snap:
        if prometheus:
            _echo_out(metrics.prometheus_text(snap.store).rstrip("\n"))
            return
        values = dict(snap.store.stats())
        totals = lifetime(snap)
    _emit(as_json, {"path": path, "stats": values, "lifetime": totals}, clitext.stats_text(path, values, totals))


@_command()
@_path_argument
@json_option
def compact(path: str, as_json: bool) -> None:
    """Rewrite the spill store of PATH without its free pages, returning them to the disk.

    LMDB never shrinks data.mdb: pages freed by evictions, restores, drops and
    gc are reused, not returned. compact takes the writer lock (exit 3 if a
    writer holds it), opens the store as a writer (damage refuses it: exit 4),
    writes LMDB's compacting copy to a new file in spill/, syncs it, checks
    it, and renames it over data.mdb. A crash at any point leaves the old file
    or the new one, whole; a leftover copy is deleted by the next open or
    compact. It needs free space for the copy (about the data in use).

    \b
    Example:
        pagedkv compact demo.kv
        pagedkv gc demo.kv && pagedkv compact demo.kv --json
    """
    result = compact_mod.compact(path)
    _emit(as_json, result, clitext.compact_text(result))


@_command()
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
    _emit(as_json, {"rows": rows}, clitext.clean(bench_mod.format_table(rows)))
