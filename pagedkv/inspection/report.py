"""Read-only reports on a store: summary, sequences, block tables, pages, pool map, verify.

Every function takes a ``Snapshot`` (see ``snapshot.py``) and returns plain
JSON-ready data with stable keys; rendering is the CLI's job. The figures come
from the store's read API (``KVStore.describe()`` and its kin, ``describe.py``)
and from the files themselves; nothing here writes to the store.
"""

from __future__ import annotations

import ast
import math
import os
import re
import time
from typing import Any

import numpy as np

from .cachereport import lifetime, prefix_cache, spill_codecs
from ..check import Problem
from ..describe import PageInfo, PageNotFound, SequenceInfo
from ..errors import PagedKVError, SequenceNotFound
from ..pages.sequence import SeqId
from ..snapshot import DATA_FILE, POOL_FILE, SPILL_DIR, Snapshot, lmdb_meta

__all__ = ["MAP_LEGEND", "MAP_WIDTH", "PageNotFound", "disk_usage", "disk_warning", "find_sequence",
           "page_info", "pool_map", "seq_table", "sequences", "summary", "verify"]

MAP_WIDTH = 64  # cells per row of the pool map off a terminal (and in JSON)

MAP_LEGEND = {".": "free", "#": "resident (refcount 1)", "S": "shared (refcount > 1)", "P": "pinned",
              "c": "cached (refcount 0, kept for prefix reuse)",
              "o": "orphan (refcount 0, collected by the next writer)"}
_MAP_CHARS = ".#SPco"  # index = the slot's state in describe.SLOT_STATES, whose names begin each legend
# Beside a live writer a pool slot may be rewritten after the snapshot's commit:
# a page that fails its pool checksum then is unverified, not damaged.
_LIVE_RACE_KINDS = frozenset({"pool_checksum"})
# The filesystem holding a store is "nearly full" below either bound (see README).
DISK_LOW_FRACTION, DISK_LOW_BYTES = 0.10, 1 << 30
_statvfs = os.statvfs  # a seam: tests stand in a filesystem that is nearly full


def _iso(seconds: Any) -> str | None:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def summary(snap: Snapshot) -> dict[str, Any]:
    """Identity, geometry, pool and page occupancy, prefix cache, spill codecs, LMDB, commit, writer."""
    info = snap.store.describe()
    geom, pages, slots, spill, commit = info.geometry, info.pages, info.slots, info.spill, info.last_commit
    meta = lmdb_meta(snap.path) or {}
    readers = snap.readers()
    disk = disk_usage(snap.path)
    warnings = [disk_warning(snap.path, disk)] if disk["low"] else []
    return {
        "path": snap.path,
        "format_version": info.format_version,
        "metadata_checked": info.metadata_checked,  # format 1 kept no metadata checksums
        "uuid": info.uuid,
        "created": _iso(info.created),
        "geometry": geom.to_dict(),
        "model": info.model,
        "page_bytes": geom.page_nbytes,
        "token_bytes": geom.token_nbytes,
        "pool": {
            "slots": info.pool_pages,
            "free": slots["free"],
            "resident": info.pool_pages - slots["free"],
            "pinned": slots["pinned"],
            "shared": slots["shared"],
            "file_bytes": os.path.getsize(os.path.join(snap.path, POOL_FILE)),
        },
        "pages": {
            "total": pages.total,
            "resident": pages.resident,
            "spilled": pages.spilled,
            "shared": pages.shared,
            "hashed": pages.hashed,
            "cached": pages.cached,
            "orphan": pages.orphan,
            "spill_records": info.records,
            "spilled_bytes": info.record_bytes,
        },
        "prefix_cache": prefix_cache(commit, pages.shared, pages.cached),
        "lifetime": lifetime(commit),
        "spill_codecs": spill_codecs(info),
        "lmdb": {
            "map_size": meta.get("map_size", spill.map_size),
            "map_used": spill.map_used,
            "file_bytes": os.path.getsize(os.path.join(snap.path, SPILL_DIR, DATA_FILE)),
            "last_txnid": meta.get("txnid", spill.last_txnid),
            "readers": readers["readers"],
            "stale_readers": readers["stale"],
            "entries": dict(spill.entries),
        },
        "sequences": info.sequences,
        "tokens": info.tokens,
        "last_commit": {"time": _iso(commit.time), "commits": commit.commits, "durability": commit.durability},
        # the remote tier as of the last commit (None: none)
        "remote": None if commit.remote is None else dict(commit.remote),
        "writer": {"locked": snap.writer_pid is not None,
                   "pid": snap.writer_pid if snap.writer_pid and snap.writer_pid > 0 else None},
        "snapshot": snap.registered,
        "disk": disk,
        "notes": list(snap.notes),
        "warnings": warnings,
    }


def _id(seq_id: Any) -> Any:
    """A sequence id for output: str and int as they are; anything a hostile store holds as repr."""
    return seq_id if type(seq_id) in (str, int) else repr(seq_id)


def sequences(snap: Snapshot) -> list[dict[str, Any]]:
    """Every sequence: id, length, pages, and how many are resident or spilled."""
    return [{"id": _id(seq.id), "length": seq.length, "pages": len(seq.pages),
             "resident": seq.resident, "spilled": len(seq.pages) - seq.resident}
            for seq in snap.store.describe_sequences()]


def find_sequence(snap: Snapshot, text: str) -> SequenceInfo:
    """The sequence ``text`` names, read the way ``inspect --sequences`` shows ids.

    * A quoted string (``'chat-1'``, ``"7"``, ``'caf\\xe9'``: a Python literal, as
      shown) is that str id; if no sequence has it, the text as typed.
    * A bare integer (``7``, ``-3``) is the int id 7, or, if there is none, the str
      id ``"7"``: so ``7`` and ``'7'`` each select one sequence when both exist.
    * Any other text is the str id exactly as typed.
    """
    candidates: list[SeqId] = []
    if len(text) >= 2 and text[0] in "'\"" and text[-1] == text[0]:
        try:
            literal = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            literal = None
        if isinstance(literal, str):
            candidates.append(literal)
    elif re.fullmatch(r"-?[0-9]+", text):
        candidates.append(int(text))
    candidates.append(text)
    # Match on (type, value) over the listed sequences rather than the store's own lookup,
    # so "7" never finds 7 by accident and the lookup's leniency stays the library's business.
    by_id = {(type(seq.id), seq.id): seq for seq in snap.store.describe_sequences()
             if type(seq.id) in (str, int)}
    for candidate in candidates:
        seq = by_id.get((type(candidate), candidate))
        if seq is not None:
            return seq
    raise SequenceNotFound(f"no sequence {text!r} in {snap.path}")


def _state(snap: Snapshot, page: PageInfo) -> str:
    """What a checked page is in the report: verified, unverified or corrupt."""
    if page.ok:
        return "verified"
    # A live writer may have reused a pool slot after our metadata snapshot.
    return "unverified" if page.ok is None or (page.resident and snap.writer_pid) else "corrupt"


def _page_row(snap: Snapshot, page: PageInfo) -> dict[str, Any]:
    return {"uid": page.uid, "where": "resident" if page.resident else "spilled",
            "slot": page.slot, "fill": page.tokens,
            "refcount": page.refcount, "checksum": f"{page.checksum:016x}",
            "prefix_hash": None if page.prefix_hash is None else page.prefix_hash.hex(),
            "state": _state(snap, page), "problem": page.problem}


def seq_table(snap: Snapshot, text: str) -> dict[str, Any]:
    """One sequence's block table, each page checked against its checksum."""
    seq = find_sequence(snap, text)
    rows = [{"index": index, **_page_row(snap, page)}
            for index, page in enumerate(snap.store.describe_pages(seq.pages, check=True))]
    return {"id": _id(seq.id), "length": seq.length, "pages": rows}


def _layer_stats(values: np.ndarray) -> dict[str, Any]:
    data = values.astype(np.float64).ravel()
    finite = data[np.isfinite(data)]
    return {
        "min": float(finite.min()) if len(finite) else None,
        "max": float(finite.max()) if len(finite) else None,
        "mean": float(finite.mean()) if len(finite) else None,
        "nan": int(np.count_nonzero(np.isnan(data))),
        "inf": int(np.count_nonzero(np.isinf(data))),
    }


def page_info(snap: Snapshot, uid: int) -> dict[str, Any]:
    """A page's directory entry, its record header when spilled, and per-layer K/V stats."""
    if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 1 << 64:
        raise PagedKVError(f"page uid must be an integer in 0..2**64-1, got {uid!r}")
    store, geom = snap.store, snap.store.geometry
    (page,) = store.describe_pages([uid], check=True)
    row = _page_row(snap, page)
    content = store.page_content(uid)
    row["problem"] = row["problem"] or content.problem
    fill = page.tokens
    layers = []
    if content.page is not None:
        for layer in range(geom.layers):
            layers.append({"layer": layer, "k": _layer_stats(content.page[layer, 0, :fill]),
                           "v": _layer_stats(content.page[layer, 1, :fill])})
    record = None if content.record is None else {**content.record, "csum": f"{content.record['csum']:016x}"}
    users = [_id(seq.id) for seq in store.describe_sequences() if uid in seq.pages]
    return {**row, "record": record, "record_bytes": content.record_bytes,
            "committed_record": page.record != "none", "sequences": users,
            "layers": layers}


def pool_map(snap: Snapshot, width: int = MAP_WIDTH, max_rows: int = 64) -> dict[str, Any]:
    """The pool as rows of characters, one per slot (or per group of slots in big pools)."""
    codes = snap.store.slot_states()
    slots = len(codes)
    per_cell = max(1, -(-slots // (width * max_rows)))
    cells = -(-slots // per_cell)
    if per_cell == 1:
        cell_codes = codes
    else:  # the state most slots of the group are in
        padded = np.full(cells * per_cell, 0, np.int8)
        padded[:slots] = codes
        per_state = np.stack([(padded.reshape(cells, per_cell) == c).sum(axis=1)
                              for c in range(len(_MAP_CHARS))])
        cell_codes = per_state.argmax(axis=0)
    text = "".join(_MAP_CHARS[int(c)] for c in cell_codes)
    rows = [text[i:i + width] for i in range(0, len(text), width)]
    counts = {MAP_LEGEND[ch].split(" ")[0]: int(np.count_nonzero(codes == i))
              for i, ch in enumerate(_MAP_CHARS)}
    return {"slots": slots, "slots_per_cell": per_cell, "width": width, "rows": rows,
            "legend": dict(MAP_LEGEND), "counts": counts}


def verify(snap: Snapshot) -> dict[str, Any]:
    """Every checksum and invariant (``KVStore.check``), split into damage, unverified and garbage.

    Each entry is a ``Problem.to_dict()``: ``{"kind", "page", "sequence", "message"}``.
    """
    store = snap.store
    problems = [p for p in store.check(detailed=True) if isinstance(p, Problem)]
    live_writer = snap.writer_pid is not None
    # A read-only check() leaves out records no page owns; after a crash these are
    # uncommitted evictions that the next writer open deletes, not damage.
    garbage = store.garbage()
    unverified = [p for p in problems if live_writer and p.kind in _LIVE_RACE_KINDS]
    damage = [p for p in problems if p.kind != "stray_record" and p not in unverified]
    counts = store.stats()
    return {
        "path": snap.path,
        "ok": not damage,
        "damage": [p.to_dict() for p in damage],
        "garbage": [p.to_dict() for p in garbage],
        "unverified": [p.to_dict() for p in unverified],
        "pages_checked": counts["pages"],
        "resident_pages": counts["pages"] - counts["spilled_pages"],
        "spilled_pages": counts["spilled_pages"],
        "sequences": counts["sequences"],
        "live": live_writer,
        "writer_pid": snap.writer_pid if snap.writer_pid and snap.writer_pid > 0 else None,
        "notes": list(snap.notes),
    }


def disk_usage(path: str) -> dict[str, Any]:
    """Free and total bytes of the filesystem holding ``path``; ``low`` when it is nearly full.

    Nearly full: under ``DISK_LOW_FRACTION`` of it free, or under ``DISK_LOW_BYTES``.
    Free means available to this user (root may dip into the reserved blocks, but
    LMDB growing into them leaves nothing for anyone else).
    """
    try:
        fs = _statvfs(path)
    except OSError:
        return {"free_bytes": None, "total_bytes": None, "low": False}
    free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    low = total > 0 and (free < DISK_LOW_FRACTION * total or free < DISK_LOW_BYTES)
    return {"free_bytes": free, "total_bytes": total, "low": bool(low)}


def disk_warning(path: str, disk: dict[str, Any]) -> str:
    """The warning ``inspect`` prints when ``disk_usage`` says the filesystem is nearly full."""
    free, total = disk["free_bytes"], disk["total_bytes"]
    return (f"the filesystem holding {path} is nearly full: {free:,} of {total:,} bytes free "
            f"({100 * free / total:.1f}%); a store has no spill cap unless opened with spill_limit_bytes: "
            f"run 'pagedkv gc' to drop cached pages, 'pagedkv compact' to return free LMDB pages, "
            f"or set a cap")
