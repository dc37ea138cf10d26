"""Restoring spilled pages: fetch a record, validate it against both checksums, place it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from . import faults
from .codec import decode_record, page_checksum
from .errors import PageCorrupt
from .spill import uid_key

if TYPE_CHECKING:
    from .manager import BlockManager


def restore(mgr: BlockManager, pids: np.ndarray) -> None:
    """Bring spilled pages back into free slots (evicting as needed); PageCorrupt if one fails."""
    order = pids.tolist()
    # Under a spill cap, restore a batch at a time: each batch's eviction can then
    # free the records the previous batch made redundant, so the cap is never
    # passed by more than one batch. Restored batches stay pinned until the end.
    chunk = mgr.evict_batch if mgr.spill_limit is not None else max(len(order), 1)
    bad: PageCorrupt | None = None
    held: list[int] = []
    try:
        for start in range(0, len(order), chunk):
            part = order[start:start + chunk]
            slots = mgr.take_slots(len(part))
            used: set[int] = set()  # slots placed, or handed back after a corrupt page
            try:
                with mgr.spill.begin_read() as txn:
                    for pid, slot in zip(part, slots):
                        started = time.perf_counter()
                        try:
                            _restore_one(mgr, txn, pid, slot)
                        except PageCorrupt as exc:
                            used.add(slot)
                            mgr.free_slots.append(slot)
                            mgr.corrupt[pid] = True
                            mgr.stats.add("misses")
                            bad = bad or exc
                            continue
                        used.add(slot)
                        mgr.pins[slot] += 1
                        held.append(slot)
                        mgr.stats.add("restores")
                        mgr.stats.add("spill_hits")
                        mgr.stats.restore_latency(time.perf_counter() - started)
            except BaseException:
                mgr.free_slots.extend(slot for slot in slots if slot not in used)
                raise
    finally:
        np.subtract.at(mgr.pins, np.asarray(held, np.int64), 1)
    if bad is not None:
        raise bad

def _restore_one(mgr: BlockManager, txn: object, pid: int, slot: int) -> None:
    page, nbytes = read_record(mgr, txn, pid)
    mgr.pool[slot] = page
    faults.crashpoint("restore.after_copy")
    mgr.stats.add("bytes_restored", nbytes)
    mgr._place(pid, slot)

def read_record(mgr: BlockManager, txn: object, pid: int) -> tuple[np.ndarray, int]:
    """Fetch and validate ``pid``'s spilled record; return a view of its page and its size.

    Both the record's own checksum and the directory's (which may cover fewer
    tokens, after a crash) must hold; otherwise ``PageCorrupt``.
    """
    uid = int(mgr.uid[pid])
    if mgr.corrupt[pid]:
        raise PageCorrupt(f"page {uid} is corrupt", uid)
    return fetch_record(mgr, txn, uid, int(mgr.fill[pid]), int(mgr.csum[pid]))

def fetch_record(mgr: BlockManager, txn: object, uid: int, fill: int, csum: int) -> tuple[np.ndarray, int]:
    """``read_record`` for a page known by its uid, fill and checksum (safe off the lock)."""
    value = txn.get(uid_key(uid), db=mgr.spill.pages)  # type: ignore[attr-defined]
    if value is None:
        raise PageCorrupt(f"page {uid}: spilled record is missing", uid)
    header, page = decode_record(mgr.geom, value, uid, mgr.seed)
    raw = header["codec"] == "raw"
    # An encoded payload was checked before decoding; a raw one is checked here.
    ok = not raw or page_checksum(page, header["fill"], uid, mgr.seed) == header["csum"]
    if ok and (header["fill"] != fill or not raw):
        ok = fill <= header["fill"] and page_checksum(page, fill, uid, mgr.seed) == csum
    elif ok:
        ok = header["csum"] == csum
    if not ok:
        raise PageCorrupt(f"page {uid}: spilled record fails its checksum", uid)
    return page, len(value)
