"""Text rendering for the command line: escaping, numbers, plurals, and the report layouts.

Everything a command prints passes through ``clean``: sequence ids and paths come
from untrusted stores and may hold ESC, CR, NUL or bidirectional overrides, which
must never reach a terminal raw. Printable characters of any script are shown as
they are (``café-🚀``); control, format, separator and unassigned characters are
escaped (``\\x1b``, ``\\u202e``), so printed text holds only printable
characters, tab and newline. Where stdout cannot encode a character (an ASCII
locale), ``fit_encoding`` escapes it too.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Mapping

from ..remote.report import remote_text

MAP_GUTTER = 10  # characters before each row of the pool map (the slot number)


def _escape_char(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _escape(text: str, keep: str) -> str:
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() or char in keep else _escape_char(char) for char in text)


def clean(text: str) -> str:
    """``text`` with every character that is not printable, tab or newline escaped."""
    return "\n".join(_escape(line, "\t") for line in text.split("\n"))


def one_line(text: str) -> str:
    """``clean`` that escapes tab and newline too, for a one-line error message."""
    return _escape(text.strip(), "")


def fit_encoding(text: str, encoding: str | None) -> str:
    """``text`` with the characters ``encoding`` cannot represent written as escapes."""
    if not encoding:
        return text
    try:
        text.encode(encoding)
        return text
    except UnicodeEncodeError:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 page``, ``2 pages``, ``0 pages`` (``many`` when the plural is not ``word + "s"``)."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def show_id(seq_id: Any) -> str:
    """A sequence id for text output: ints bare, strings quoted (so 7 and '7' differ).

    The quoted form is a Python string literal (non-printable characters escaped),
    which ``inspect --seq`` accepts as it is shown.
    """
    return clean(str(seq_id) if isinstance(seq_id, int) else repr(seq_id))


def to_json(value: Any) -> str:
    """Indented JSON; ``ensure_ascii`` escapes every non-ASCII and control character."""
    return json.dumps(value, indent=2, ensure_ascii=True, allow_nan=False)


def nbytes(count: int | None) -> str:
    """Bytes in binary units (``4.0 MiB``)."""
    if count is None:
        return "?"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def num(value: float | None, digits: int = 3) -> str:
    """A float for a table cell (``-`` when there is none)."""
    return "-" if value is None else f"{value:.{digits}g}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces, with a dashed rule under the headers."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [headers, ["-" * w for w in widths], *rows]]
    return "\n".join(lines)


def pairs(items: list[tuple[str, str]]) -> str:
    """``label  value`` lines with the values aligned."""
    width = max(len(label) for label, _ in items)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in items)


def geometry_text(geom: dict[str, Any]) -> str:
    """One line describing a geometry dict."""
    return (f"{plural(geom['layers'], 'layer')} x {plural(geom['kv_heads'], 'kv head')} x "
            f"{geom['head_dim']} head_dim, {plural(geom['page_size'], 'token')}/page, {geom['dtype']}")


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
    return clean(pairs(items) + f"\n\nnext: pagedkv inspect {one_line(_arg(result['path']))}")


def _latency_text(result: dict[str, Any]) -> str:
    if not result["restores"]:
        return "no restores"
    return f"p50 {result['restore_ms_p50']:.3f} ms, p99 {result['restore_ms_p99']:.3f} ms"


def rate_text(done: int, seconds: float, unit: str) -> str | None:
    """A progress bar's rate (``12.5 requests/s``); None before there is one to show."""
    if done <= 0 or seconds <= 0:
        return None
    return f"{done / seconds:,.1f} {unit}/s"


def _arg(path: str) -> str:
    quoted = shlex.quote(path)
    return f"-- {quoted}" if path.startswith("-") else quoted


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
    return clean(pairs(items) + "\n\n" + grid + f"\n\nnext: pagedkv inspect {one_line(_arg(result['path']))}")


def summary_text(info: dict[str, Any]) -> str:
    """The default ``pagedkv inspect`` report."""
    pool, pages, lmdb, commit, writer = (info[k] for k in ("pool", "pages", "lmdb", "last_commit", "writer"))
    readers = "? readers" if lmdb["readers"] is None else plural(lmdb["readers"], "reader")
    if lmdb["stale_readers"]:
        readers += f" (+{lmdb['stale_readers']} stale)"
    if writer["locked"]:
        who = f"pid {writer['pid']}" if writer["pid"] else "pid unknown"
        writer_text = f"{who} holds the lock" + (
            " (metadata: its last commit, held by a reader slot)" if info["snapshot"] else "")
    else:
        writer_text = "none"
    items = [
        ("store", one_line(info["path"])),
        ("format version", str(info["format_version"]) + (
            "" if info["metadata_checked"] else " (metadata without checksums; a writer's open adds them)")),
        ("uuid", info["uuid"]),
        ("created", info["created"] or "-"),
        ("geometry", geometry_text(info["geometry"])),
        ("model", info["model"] or "-"),
        ("page bytes", f"{info['page_bytes']:,} ({info['token_bytes']:,} per token)"),
        ("pool slots", f"{pool['slots']:,}: {pool['free']:,} free, {pool['resident']:,} resident "
                       f"({pool['shared']:,} shared), {pool['pinned']:,} pinned; pool.bin {nbytes(pool['file_bytes'])}"),
        ("pages", f"{pages['total']:,}: {pages['resident']:,} resident, {pages['spilled']:,} spilled, "
                  f"{pages['shared']:,} shared, {pages['cached']:,} cached for prefix reuse"
                  + (f", {pages['orphan']:,} orphan" if pages["orphan"] else "")),
        ("spilled on disk", f"{nbytes(pages['spilled_bytes'])} in {plural(pages['spill_records'], 'record')}"),
        ("spill codecs", _codecs_text(info["spill_codecs"])),
        ("prefix cache", f"{plural(info['prefix_cache']['shared_pages'], 'page')} shared (refcount > 1), "
                         f"{info['prefix_cache']['cached_pages']:,} cached only (refcount 0, indexed)"),
        ("prefix hits", _hits_text(info["prefix_cache"])),
        ("lifetime", _lifetime_text(info["lifetime"])),
        ("lmdb", f"map {nbytes(lmdb['map_size'])}, used {nbytes(lmdb['map_used'])}, data.mdb "
                 f"{nbytes(lmdb['file_bytes'])}, {readers}, txn {lmdb['last_txnid']}"),
        ("disk", _disk_text(info["disk"])),
        ("sequences", f"{info['sequences']:,} ({plural(info['tokens'], 'token')})"),
        ("last commit", f"{commit['time'] or 'never'} (commit #{commit['commits']}, "
                        f"{commit['durability'] or 'unknown'} mode)"),
        ("writer", writer_text),
    ]
    if info.get("remote"):
        items.insert(-2, ("remote tier", remote_text(info["remote"])))
    notes = "".join(f"\nnote: {one_line(note)}" for note in info["notes"])
    notes += "".join(f"\nwarning: {one_line(warning)}" for warning in info["warnings"])
    return clean(pairs(items) + notes)


def _disk_text(disk: dict[str, Any]) -> str:
    if disk["free_bytes"] is None:
        return "free space unknown"
    share = 100 * disk["free_bytes"] / disk["total_bytes"] if disk["total_bytes"] else 0.0
    return (f"{nbytes(disk['free_bytes'])} free of {nbytes(disk['total_bytes'])} ({share:.1f}%)"
            + (", NEARLY FULL" if disk["low"] else ""))


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _codecs_text(codecs: dict[str, dict[str, Any]]) -> str:
    used = [f"{name}: {plural(c['pages'], 'page')} in {nbytes(c['bytes'])}, ratio {c['ratio']:.2f}"
            for name, c in codecs.items() if c["pages"]]
    return "; ".join(used) or "no page records"


def _hits_text(cache: dict[str, Any]) -> str:
    if all(cache[key] is None for key in ("queries", "query_tokens", "hit_tokens", "hit_pages")):
        return "not recorded (last committed by a pagedkv that kept no counters)"
    if cache["queries"] == 0:
        return "0.0%: no create(tokens=...) so far"
    rate = "?" if cache["hit_rate"] is None else f"{100 * cache['hit_rate']:.1f}%"
    return (f"{rate}: {_count(cache['hit_tokens'])} of {_count(cache['query_tokens'])} prompt tokens "
            f"reused ({_count(cache['hit_pages'])} {'page' if cache['hit_pages'] == 1 else 'pages'}) in "
            f"{_count(cache['queries'])} create(tokens=...)")


def _lifetime_text(counts: dict[str, int | None]) -> str:
    if all(value is None for value in counts.values()):
        return "not recorded"
    def count(key: str, word: str) -> str:
        value = counts[key]
        return f"? {word}s" if value is None else plural(value, word)

    return (f"{count('evictions', 'eviction')}, {count('restores', 'restore')}, "
            f"{count('cache_drops', 'cached page')} dropped (all sessions, to the last commit)")


def sequences_text(rows: list[dict[str, Any]]) -> str:
    """``pagedkv inspect --sequences``."""
    if not rows:
        return "no sequences"
    body = [[show_id(r["id"]), f"{r['length']:,}", str(r["pages"]), str(r["resident"]), str(r["spilled"])]
            for r in rows]
    return clean(table(["id", "tokens", "pages", "resident", "spilled"], body))


def seq_text(info: dict[str, Any]) -> str:
    """``pagedkv inspect --seq ID``: the block table."""
    head = f"sequence {show_id(info['id'])}: {plural(info['length'], 'token')} in {plural(len(info['pages']), 'page')}"
    body = [[str(p["index"]), str(p["uid"]), "spilled" if p["slot"] is None else str(p["slot"]),
             str(p["fill"]), str(p["refcount"]), p["checksum"], (p["prefix_hash"] or "-")[:12], p["state"]]
            for p in info["pages"]]
    text = head + "\n" + table(["index", "uid", "slot", "fill", "refcount", "checksum", "prefix hash",
                                 "state"], body)
    problems = "".join(f"\n{one_line(p['problem'])}" for p in info["pages"] if p["problem"])
    return clean(text + problems)


def page_text(info: dict[str, Any]) -> str:
    """``pagedkv inspect --page UID``: header and per-layer statistics."""
    items = [("uid", str(info["uid"])),
             ("where", info["where"] + ("" if info["slot"] is None else f" (slot {info['slot']})")),
             ("fill", plural(info["fill"], "token")), ("refcount", str(info["refcount"])),
             ("checksum", f"{info['checksum']} ({info['state']})"),
             ("prefix hash", info["prefix_hash"] or "- (not shareable)"),
             ("sequences", ", ".join(show_id(s) for s in info["sequences"]) or "-")]
    if info["record"] is not None:
        rec = info["record"]
        items.append(("record", f"{nbytes(info['record_bytes'])}: v{rec['v']} codec {rec['codec']} "
                                f"dtype {rec['dtype']} shape {rec['shape']} fill {rec['fill']} "
                                f"csum {rec['csum']} payload {rec['nbytes']:,} B"))
    text = pairs(items)
    if info["problem"]:
        text += f"\nproblem: {one_line(info['problem'])}"
    if info["layers"]:
        body = []
        for layer in info["layers"]:
            for part in ("k", "v"):
                st = layer[part]
                body.append([str(layer["layer"]), part.upper(), num(st["min"]), num(st["max"]),
                             num(st["mean"]), str(st["nan"]), str(st["inf"])])
        text += "\n\n" + table(["layer", "", "min", "max", "mean", "nan", "inf"], body)
    return clean(text)


# SGR colours of the map's states: free dim, resident green, shared cyan, pinned bold
# yellow, cached blue, orphan magenta.
_MAP_COLOURS = {".": "2", "#": "32", "S": "36", "P": "1;33", "c": "34", "o": "35"}


def _paint(text: str, color: bool) -> str:
    """A row of map characters, coloured run by run (only characters of the legend pass)."""
    text = "".join(ch if ch in _MAP_COLOURS else "?" for ch in text)
    if not color:
        return text
    out, start = [], 0
    for end in range(1, len(text) + 1):
        if end == len(text) or text[end] != text[start]:
            out.append(f"\x1b[{_MAP_COLOURS[text[start]]}m{text[start:end]}\x1b[0m")
            start = end
    return "".join(out)


def map_text(info: dict[str, Any], color: bool = False) -> str:
    """``pagedkv inspect --map``: the pool grid, its legend with counts, and a summary line.

    ``color`` adds ANSI colours to the grid and legend characters (the only escape
    sequences any command prints, and only on a terminal).
    """
    per_cell, slots, width = info["slots_per_cell"], info["slots"], info["width"]
    unit = "slot" if per_cell == 1 else f"{per_cell:,} slots (the state most of them are in)"
    lines = [clean(f"pool: {plural(slots, 'slot')}, one character = {unit}")]
    if per_cell > 1:
        lines.append(clean(f"too large to draw a slot per character: {len(info['rows'])} rows of {width} "
                           f"characters stand for {slots:,} slots"))
    lines += [f"{i * width * per_cell:>{MAP_GUTTER - 2}}  {_paint(row, color)}" for i, row in enumerate(info["rows"])]
    lines.append("")
    for ch, meaning in info["legend"].items():
        count = info["counts"][meaning.split(" ")[0]]
        share = 100 * count / slots if slots else 0.0
        lines.append(f"  {_paint(ch, color)}  " + clean(f"{meaning}: {count:,} ({share:.1f}%)"))
    counts = info["counts"]
    lines.append(clean("summary: " + ", ".join(f"{counts[name]:,} {name}" for name in counts)
                       + f" of {plural(slots, 'slot')}"))
    return "\n".join(lines)


def verify_text(result: dict[str, Any]) -> str:
    """``pagedkv verify``: one line when clean, each problem otherwise."""
    scope = (f"{plural(result['pages_checked'], 'page')} ({result['resident_pages']:,} resident, "
             f"{result['spilled_pages']:,} spilled), {plural(result['sequences'], 'sequence')}")
    path = one_line(result["path"])
    lines = [f"damage: {one_line(problem['message'])}" for problem in result["damage"]]
    lines += [f"unverified: {one_line(problem['message'])} (the live writer may have reused the slot)"
              for problem in result["unverified"]]
    strays = len(result["garbage"])
    if strays:
        lines.append(f"note: {plural(strays, 'spill record')} {'belongs' if strays == 1 else 'belong'} to no "
                     f"page (left by an interrupted writer; the next writer open deletes "
                     f"{'it' if strays == 1 else 'them'})")
    lines += [f"note: {one_line(note)}" for note in result["notes"]]
    if result["ok"]:
        lines.append(f"ok: {path}: {scope} checked, no damage")
    else:
        lines.append(f"DAMAGED: {path}: {plural(len(result['damage']), 'problem')} in {scope}")
    return clean("\n".join(lines))


def gc_text(report: dict[str, Any]) -> str:
    """``pagedkv gc``: what was dropped, and what is left."""
    kept = "every cached page" if report["max_bytes"] is None else f"down to {nbytes(report['max_bytes'])}"
    lines = [f"gc {one_line(report['path'])}: dropped {plural(report['pages'], 'cached page')} ({kept}): "
             f"{nbytes(report['bytes'])} of spill records, {plural(report['slots'], 'pool slot')} freed; "
             f"{plural(report['cached_pages_after'], 'cached page')} left"]
    if report["bytes"]:
        lines.append("note: LMDB reuses the freed pages but data.mdb keeps its size; "
                     f"'pagedkv compact {one_line(_arg(report['path']))}' gives them back to the disk")
    return clean("\n".join(lines))


def compact_text(result: Mapping[str, Any]) -> str:
    """``pagedkv compact``: data.mdb's size before and after."""
    before, after = result["bytes_before"], result["bytes_after"]
    return clean(f"compacted {one_line(result['path'])}: spill/data.mdb {nbytes(before)} -> {nbytes(after)} "
                 f"({nbytes(max(before - after, 0))} returned to the filesystem) in {result['seconds']:.2f} s")


def stats_text(path: str, values: dict[str, Any], totals: dict[str, int | None]) -> str:
    """``pagedkv stats``: one ``name  value`` line per figure of ``KVStore.stats()``, then the lifetime totals."""
    def show(value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return one_line(str(value))
        if isinstance(value, int) or float(value).is_integer() and abs(value) < 1 << 53:
            return f"{int(value):,}"
        return f"{value:.6g}"

    items = [("store", one_line(path))] + [(one_line(str(key)), show(value)) for key, value in values.items()]
    items.append(("lifetime", _lifetime_text(totals)))
    return clean(pairs(items))
