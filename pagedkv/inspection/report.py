"""Read-only reports on a store: summary, sequences, block tables, pages, pool map, verify.

Every function takes a ``Snapshot`` (see ``snapshot.py``) and returns plain
JSON-ready data with stable keys; rendering is the CLI's job. Nothing here
writes to the store.
"""

from __future__ import annotations

import ast
import math
import os
import re
import time
from typing import Any

import numpy as np

from .cachereport import cached_mask, lifetime, prefix_cache, spill_codecs
from ..check import Problem, stray_problems
from ..storage.codec import decode_record, page_checksum
from ..errors import PageCorrupt, PagedKVError, SequenceNotFound
from ..pages.directory import HASHED, REC_NONE
from ..pages.sequence import SeqId, Sequence
from ..snapshot import DATA_FILE, POOL_FILE, SPILL_DIR, Snapshot, lmdb_meta
from ..storage.spill import uid_key
from ..pages.restore import read_record
from ..remote.report import committed_section

MAP_WIDTH = 64  # cells per row of the pool map off a terminal (and in JSON)


class PageNotFound(PagedKVError):
    """No live page has the uid asked for."""


MAP_LEGEND = {".": "free", "#": "resident (refcount 1)", "S": "shared (refcount > 1)", "P": "pinned",
              "c": "cached (refcount 0, kept for prefix reuse)",
              "o": "orphan (refcount 0, collected by the next writer)"}
_MAP_CHARS = ".#SPco"  # index = slot state code
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
    store, mgr, geom = snap.store, snap.mgr, snap.store.geometry
    live = np.flatnonzero(mgr.live)
    resident = live[mgr.slot[live] >= 0]
    cached = cached_mask(snap, live)
    shared = int(np.count_nonzero(mgr.ref[live] > 1))
    slot_codes = _slot_codes(snap)
    record_count, record_bytes = 0, 0
    spill = store._spill
    with spill.begin_read() as txn:
        for _, value in spill.iterate(txn, spill.pages):
            record_count += 1
            record_bytes += len(value)
    info = spill.info()
    meta = lmdb_meta(snap.path) or {}
    readers = snap.readers()
    state = store._state
    sb = store.superblock
    disk = disk_usage(snap.path)
    warnings = [disk_warning(snap.path, disk)] if disk["low"] else []
    return {
        "path": snap.path,
        "format_version": sb["format"],
        "metadata_checked": bool(store._mgr.sealed),  # format 1 kept no metadata checksums
        "uuid": store.uuid,
        "created": _iso(sb.get("created")),
        "geometry": geom.to_dict(),
        "model": sb.get("model") if isinstance(sb.get("model"), str) else None,
        "page_bytes": geom.page_nbytes,
        "token_bytes": geom.token_nbytes,
        "pool": {
            "slots": store.pool_pages,
            "free": int(np.count_nonzero(slot_codes == 0)),
            "resident": int(np.count_nonzero(slot_codes > 0)),
            "pinned": int(np.count_nonzero(mgr.pins)),
            "shared": int(np.count_nonzero(slot_codes == 2)),
            "file_bytes": os.path.getsize(os.path.join(snap.path, POOL_FILE)),
        },
        "pages": {
            "total": len(live),
            "resident": len(resident),
            "spilled": len(live) - len(resident),
            "shared": shared,
            "hashed": int(np.count_nonzero(mgr.flags[live] & HASHED)),
            "cached": int(np.count_nonzero(cached)),
            "orphan": int(np.count_nonzero((mgr.ref[live] == 0) & ~cached)),
            "spill_records": record_count,
            "spilled_bytes": record_bytes,
        },
        "prefix_cache": prefix_cache(snap, shared, int(np.count_nonzero(cached))),
        "lifetime": lifetime(snap),
        "spill_codecs": spill_codecs(snap),
        "lmdb": {
            "map_size": meta.get("map_size", info["map_size"]),
            "map_used": info["map_used"],
            "file_bytes": os.path.getsize(os.path.join(snap.path, SPILL_DIR, DATA_FILE)),
            "last_txnid": meta.get("txnid", info["last_txnid"]),
            "readers": readers["readers"],
            "stale_readers": readers["stale"],
            "entries": info["entries"],
        },
        "sequences": len(store._seqs),
        "tokens": sum(seq.length for seq in store._seqs.values()),
        "last_commit": {
            "time": _iso(state.get("time")),
            "commits": int(state.get("commits", 0)) if type(state.get("commits", 0)) is int else None,
            "durability": state.get("durability") if isinstance(state.get("durability"), str) else None,
        },
        "remote": committed_section(state),  # the remote tier as of the last commit (None: none)
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


def _slot_codes(snap: Snapshot) -> np.ndarray:
    """Per slot: 0 free, 1 resident, 2 shared, 3 pinned, 4 cached, 5 orphan (see ``_MAP_CHARS``)."""
    mgr = snap.mgr
    owner = mgr.slot_pid
    used = owner >= 0
    ref = np.where(used, mgr.ref[np.maximum(owner, 0)], 0)
    codes = np.zeros(len(owner), np.int8)
    codes[used] = 1
    codes[used & (ref > 1)] = 2
    unowned = np.flatnonzero(used & (ref == 0))
    codes[unowned] = np.where(cached_mask(snap, owner[unowned]), 4, 5)
    codes[mgr.pins > 0] = 3
    return codes


def sequences(snap: Snapshot) -> list[dict[str, Any]]:
    """Every sequence: id, length, pages, and how many are resident or spilled."""
    mgr, out = snap.mgr, []
    for seq in snap.store._seqs.values():
        resident = int(np.count_nonzero(mgr.slot[seq.table] >= 0))
        out.append({"id": _id(seq.seq_id), "length": seq.length, "pages": seq.npages,
                    "resident": resident, "spilled": seq.npages - resident})
    return out


def find_sequence(snap: Snapshot, text: str) -> Sequence:
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
    # Match on (type, value) over the loaded sequences rather than the store's own index,
    # so "7" never finds 7 by accident and the index's keying stays the library's business.
    by_id = {(type(seq.seq_id), seq.seq_id): seq for seq in snap.store._seqs.values()
             if type(seq.seq_id) in (str, int)}
    for candidate in candidates:
        seq = by_id.get((type(candidate), candidate))
        if seq is not None:
            return seq
    raise SequenceNotFound(f"no sequence {text!r} in {snap.path}")


def page_state(snap: Snapshot, pid: int, txn: Any) -> tuple[str, str | None]:
    """("verified" | "unverified" | "corrupt", problem) for one page, checked now."""
    mgr = snap.mgr
    slot = int(mgr.slot[pid])
    if slot >= 0:
        actual = page_checksum(mgr.pool[slot], int(mgr.fill[pid]), int(mgr.uid[pid]), mgr.seed)
        if actual == int(mgr.csum[pid]):
            return "verified", None
        problem = f"page {int(mgr.uid[pid])}: pool slot {slot} fails its checksum"
        # A live writer may have reused the slot after our metadata snapshot.
        return ("unverified" if snap.writer_pid else "corrupt"), problem
    try:
        read_record(mgr, txn, pid)
    except PageCorrupt as exc:
        return "corrupt", str(exc)
    return "verified", None


def _page_row(snap: Snapshot, pid: int, txn: Any) -> dict[str, Any]:
    mgr = snap.mgr
    slot = int(mgr.slot[pid])
    state, problem = page_state(snap, pid, txn)
    return {"uid": int(mgr.uid[pid]), "where": "resident" if slot >= 0 else "spilled",
            "slot": slot if slot >= 0 else None, "fill": int(mgr.fill[pid]),
            "refcount": int(mgr.ref[pid]), "checksum": f"{int(mgr.csum[pid]):016x}",
            "prefix_hash": bytes(mgr.hash[pid]).hex() if mgr.flags[pid] & HASHED else None,
            "state": state, "problem": problem}


def seq_table(snap: Snapshot, text: str) -> dict[str, Any]:
    """One sequence's block table, each page checked against its checksum."""
    seq = find_sequence(snap, text)
    spill = snap.store._spill
    with spill.begin_read() as txn:
        rows = [{"index": index, **_page_row(snap, pid, txn)}
                for index, pid in enumerate(seq.table.tolist())]
    return {"id": _id(seq.seq_id), "length": seq.length, "pages": rows}


def _find_pid(snap: Snapshot, uid: int) -> int:
    mgr = snap.mgr
    hits = np.flatnonzero(mgr.live & (mgr.uid == np.uint64(uid)))
    if not len(hits):
        raise PageNotFound(f"no page with uid {uid} in {snap.path}")
    return int(hits[0])


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
    mgr, geom = snap.mgr, snap.store.geometry
    pid = _find_pid(snap, uid)
    spill = snap.store._spill
    record, record_bytes, page = None, None, None
    with spill.begin_read() as txn:
        row = _page_row(snap, pid, txn)
        if row["slot"] is not None:
            page = np.array(mgr.pool[row["slot"]])
        else:
            value = txn.get(uid_key(uid), db=spill.pages)
            if value is not None:
                record_bytes = len(value)
                try:
                    record, view = decode_record(geom, value, uid)
                    page = np.array(view)  # copy: the buffer dies with the transaction
                except PageCorrupt as exc:
                    row["problem"] = row["problem"] or str(exc)
    fill = row["fill"]
    layers = []
    if page is not None:
        for layer in range(geom.layers):
            layers.append({"layer": layer, "k": _layer_stats(page[layer, 0, :fill]),
                           "v": _layer_stats(page[layer, 1, :fill])})
    if record is not None:
        record = {**record, "csum": f"{record['csum']:016x}"}
    users = [_id(seq.seq_id) for seq in snap.store._seqs.values() if pid in set(seq.table.tolist())]
    return {**row, "record": record, "record_bytes": record_bytes,
            "committed_record": bool(mgr.rec[pid] != REC_NONE), "sequences": users,
            "layers": layers}


def pool_map(snap: Snapshot, width: int = MAP_WIDTH, max_rows: int = 64) -> dict[str, Any]:
    """The pool as rows of characters, one per slot (or per group of slots in big pools)."""
    codes = _slot_codes(snap)
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
    mgr = snap.mgr
    problems = [p for p in snap.store.check(detailed=True) if isinstance(p, Problem)]
    live_writer = snap.writer_pid is not None
    # A read-only check() leaves out records no page owns; after a crash these are
    # uncommitted evictions that the next writer open deletes, not damage.
    garbage = stray_problems(snap.store)
    unverified = [p for p in problems if live_writer and p.kind in _LIVE_RACE_KINDS]
    damage = [p for p in problems if p.kind != "stray_record" and p not in unverified]
    live = np.flatnonzero(mgr.live)
    resident = int(np.count_nonzero(mgr.slot[live] >= 0))
    return {
        "path": snap.path,
        "ok": not damage,
        "damage": [p.to_dict() for p in damage],
        "garbage": [p.to_dict() for p in garbage],
        "unverified": [p.to_dict() for p in unverified],
        "pages_checked": len(live),
        "resident_pages": resident,
        "spilled_pages": len(live) - resident,
        "sequences": len(snap.store._seqs),
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
