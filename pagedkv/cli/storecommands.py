"""The commands on a store: ``inspect``, ``verify`` and ``stats`` (read-only, beside a live
writer too), ``gc`` and ``compact`` (as its writer)."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import click

from .. import compact as compact_mod, metrics
from . import storetext, text as clitext
from ..errors import PageCorrupt, StoreCorrupt, StoreLocked
from ..inspection import report as inspector
from ..inspection.cachereport import lifetime
from ..opening import open_store
from ..snapshot import LOCK_FILE, SnapshotUnavailable, open_snapshot, require_store_dir
from ..storage.lockfile import lock_holder
from .exits import EXIT_DAMAGE, CommandFailed, echo_out
from .options import ByteSize, _map_style, command, emit, json_option, path_argument


@command()
@path_argument
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
            forms.append(("sequences", inspector.sequences(snap), storetext.sequences_text))
        if seq_id is not None:
            forms.append(("seq", inspector.seq_table(snap, seq_id), storetext.seq_text))
        if uid is not None:
            forms.append(("page", inspector.page_info(snap, uid), storetext.page_text))
        if show_map:
            width, color = _map_style() if not as_json else (inspector.MAP_WIDTH, False)
            forms.append(("map", inspector.pool_map(snap, width=width),
                          lambda info: clitext.map_text(info, color=color)))
        if not forms:
            info = inspector.summary(snap)
            emit(as_json, info, storetext.summary_text(info))
            if not as_json:  # JSON carries them in "warnings"
                for warning in info["warnings"]:
                    click.echo(f"warning: {clitext.one_line(warning)}", err=True)
            return
    value = {name: data for name, data, _ in forms}
    emit(as_json, value, "\n\n".join(render(data) for _, data, render in forms))


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


@command()
@path_argument
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
    emit(as_json, result, storetext.verify_text(result))
    if not result["ok"]:
        sys.exit(EXIT_DAMAGE)


def _open_writer(path: str) -> Any:
    """The store at ``path`` opened for writing; never creates one where there is none."""
    require_store_dir(path)
    return open_store(path)


@command()
@path_argument
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
    emit(as_json, report, storetext.gc_text(report))


@command()
@path_argument
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
            echo_out(metrics.prometheus_text(snap.store).rstrip("\n"))
            return
        values = dict(snap.store.stats())
        totals = lifetime(snap)
    emit(as_json, {"path": path, "stats": values, "lifetime": totals}, storetext.stats_text(path, values, totals))


@command()
@path_argument
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
    emit(as_json, result, storetext.compact_text(result))
