"""Text rendering for the command line: escaping, numbers, and the report layouts.

Everything a command prints passes through ``clean``: sequence ids and paths come
from untrusted stores and may hold ESC, CR or NUL, which must never reach a
terminal raw. Printed text therefore matches ``[\\x20-\\x7e\\t\\n]*``.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

_UNSAFE = re.compile(r"[^\x20-\x7e\t\n]")
_UNSAFE_IN_LINE = re.compile(r"[^\x20-\x7e]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def clean(text: str) -> str:
    """``text`` with every character outside printable ASCII, tab and newline escaped."""
    return _UNSAFE.sub(_escape, text)


def one_line(text: str) -> str:
    """``clean`` that escapes tab and newline too, for a one-line error message."""
    return _UNSAFE_IN_LINE.sub(_escape, text.strip())


def show_id(seq_id: Any) -> str:
    """A sequence id for text output: ints bare, strings quoted (so 7 and '7' differ)."""
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
    return (f"{geom['layers']} layers x {geom['kv_heads']} kv heads x {geom['head_dim']} head_dim, "
            f"{geom['page_size']} tokens/page, {geom['dtype']}")


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
        ("pages", f"{result['pages']:,} allocated; at the end {result['pages_live']:,} live, "
                  f"{result['cached_pages']:,} of them cached only; {result['cow_copies']:,} copy-on-write"),
        ("evictions", f"{result['evictions']:,}"),
        ("restores", f"{result['restores']:,}"),
        ("resident hit rate", f"{100 * result['resident_hit_rate']:.1f}%"),
        ("spill hit rate", f"{100 * result['spill_hit_rate']:.1f}% ({result['misses']} misses)"),
        ("restore latency", f"p50 {result['restore_ms_p50']:.3f} ms, p99 {result['restore_ms_p99']:.3f} ms"),
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
    readers = "?" if lmdb["readers"] is None else f"{lmdb['readers']}"
    if lmdb["stale_readers"]:
        readers += f" (+{lmdb['stale_readers']} stale)"
    if writer["locked"]:
        who = f"pid {writer['pid']}" if writer["pid"] else "pid unknown"
        writer_text = f"{who} holds the lock" + (" (metadata from a private snapshot)" if info["snapshot"] else "")
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
        ("spilled on disk", f"{nbytes(pages['spilled_bytes'])} in {pages['spill_records']:,} records"),
        ("spill codecs", _codecs_text(info["spill_codecs"])),
        ("prefix cache", f"{info['prefix_cache']['shared_pages']:,} pages shared (refcount > 1), "
                         f"{info['prefix_cache']['cached_pages']:,} cached only (refcount 0, indexed)"),
        ("prefix hits", _hits_text(info["prefix_cache"])),
        ("lifetime", _lifetime_text(info["lifetime"])),
        ("lmdb", f"map {nbytes(lmdb['map_size'])}, used {nbytes(lmdb['map_used'])}, data.mdb "
                 f"{nbytes(lmdb['file_bytes'])}, {readers} readers, txn {lmdb['last_txnid']}"),
        ("sequences", f"{info['sequences']:,} ({info['tokens']:,} tokens)"),
        ("last commit", f"{commit['time'] or 'never'} (commit #{commit['commits']}, "
                        f"{commit['durability'] or 'unknown'} mode)"),
        ("writer", writer_text),
    ]
    notes = "".join(f"\nnote: {one_line(note)}" for note in info["notes"])
    return clean(pairs(items) + notes)


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _codecs_text(codecs: dict[str, dict[str, Any]]) -> str:
    used = [f"{name}: {c['pages']:,} pages in {nbytes(c['bytes'])}, ratio {c['ratio']:.2f}"
            for name, c in codecs.items() if c["pages"]]
    return "; ".join(used) or "no page records"


def _hits_text(cache: dict[str, Any]) -> str:
    if all(cache[key] is None for key in ("queries", "query_tokens", "hit_tokens", "hit_pages")):
        return "not recorded (last committed by a pagedkv that kept no counters)"
    if cache["queries"] == 0:
        return "0.0%: no create(tokens=...) so far"
    rate = "?" if cache["hit_rate"] is None else f"{100 * cache['hit_rate']:.1f}%"
    return (f"{rate}: {_count(cache['hit_tokens'])} of {_count(cache['query_tokens'])} prompt tokens "
            f"reused ({_count(cache['hit_pages'])} pages) in {_count(cache['queries'])} create(tokens=...)")


def _lifetime_text(counts: dict[str, int | None]) -> str:
    if all(value is None for value in counts.values()):
        return "not recorded"
    return (f"{_count(counts['evictions'])} evictions, {_count(counts['restores'])} restores, "
            f"{_count(counts['cache_drops'])} cached pages dropped (all sessions, to the last commit)")


def sequences_text(rows: list[dict[str, Any]]) -> str:
    """``pagedkv inspect --sequences``."""
    if not rows:
        return "no sequences"
    body = [[show_id(r["id"]), f"{r['length']:,}", str(r["pages"]), str(r["resident"]), str(r["spilled"])]
            for r in rows]
    return clean(table(["id", "tokens", "pages", "resident", "spilled"], body))


def seq_text(info: dict[str, Any]) -> str:
    """``pagedkv inspect --seq ID``: the block table."""
    head = f"sequence {show_id(info['id'])}: {info['length']:,} tokens in {len(info['pages'])} pages"
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
             ("fill", f"{info['fill']} tokens"), ("refcount", str(info["refcount"])),
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


def map_text(info: dict[str, Any]) -> str:
    """``pagedkv inspect --map``: the pool grid and its legend."""
    unit = "slot" if info["slots_per_cell"] == 1 else f"{info['slots_per_cell']} slots (majority state)"
    lines = [f"pool: {info['slots']:,} slots, one character = {unit}"]
    lines += [f"{i * info['width'] * info['slots_per_cell']:>8}  {row}" for i, row in enumerate(info["rows"])]
    lines.append("")
    lines += [f"  {ch}  {meaning}: {info['counts'][meaning.split(' ')[0]]:,}"
              for ch, meaning in info["legend"].items()]
    return clean("\n".join(lines))


def verify_text(result: dict[str, Any]) -> str:
    """``pagedkv verify``: one line when clean, each problem otherwise."""
    scope = (f"{result['pages_checked']:,} pages ({result['resident_pages']:,} resident, "
             f"{result['spilled_pages']:,} spilled), {result['sequences']:,} sequences")
    path = one_line(result["path"])
    lines = [f"damage: {one_line(problem)}" for problem in result["damage"]]
    lines += [f"unverified: {one_line(problem)} (the live writer may have reused the slot)"
              for problem in result["unverified"]]
    if result["garbage"]:
        lines.append(f"note: {len(result['garbage'])} spill records belong to no page (left by an "
                     "interrupted writer; the next writer open deletes them)")
    lines += [f"note: {one_line(note)}" for note in result["notes"]]
    if result["ok"]:
        lines.append(f"ok: {path}: {scope} checked, no damage")
    else:
        lines.append(f"DAMAGED: {path}: {len(result['damage'])} problems in {scope}")
    return clean("\n".join(lines))
