"""What the store commands print: ``inspect`` (its summary, ``--sequences``, ``--seq``,
``--page``), ``verify``, ``gc``, ``compact`` and ``stats``.

Every layout ends in ``text.clean``: ids, paths and messages come from the store.
``inspect --map`` is drawn by ``text.map_text``.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..remote.report import remote_text
from .text import clean, geometry_text, nbytes, num, one_line, pairs, plural, shell_arg, show_id, table


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
                     f"'pagedkv compact {one_line(shell_arg(report['path']))}' gives them back to the disk")
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
