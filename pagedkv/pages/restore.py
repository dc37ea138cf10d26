"""Restoring spilled pages: fetch a record, validate it against both checksums, place it."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from .. import faults
from ..storage.codec import RecordLayout, decode_record, page_checksum, record_layout, runs_checksum
from ..errors import PageCorrupt, PoolExhausted
from ..storage.spill import uid_key
from .evict import take_slots
from .table import PageTable

log = logging.getLogger(__name__)
_clock = time.perf_counter
_ALL_PINNED = "every pool slot is pinned by active steps"


def resident_slot(mgr: PageTable, pid: int) -> int:
    """The slot of page ``pid`` for a one-page read: resident (restored first if spilled) and verified.

    A read's chunks (``BlockManager.ensure_resident``, ``PageTable.verify``,
    ``PageTable.verify_committed``) for one page, counted as they count (a
    resident hit, or a restore's counters and latency); the slot is marked
    used. ``PoolExhausted`` when no slot is unpinned: the page's own slot, or
    else the free slot a restore takes, is probed first, and every slot
    counted only when that one is pinned. A restore that fails hands its slot
    back and marks the page corrupt, logged the first time. One function
    written with scalars: numpy's per-call costs on one-element arrays, and
    then each layer of calls, were most of a one-page read.
    """
    slot: int = mgr.slot.item(pid)
    if slot >= 0:
        if mgr.pins.item(slot) and not mgr.has_room(1):
            raise PoolExhausted(_ALL_PINNED)
        mgr.stats.counts["resident_hits"] += 1
        mgr.stamp_one(slot)  # the slot was used now
        mgr.verify(pid)
    else:
        free = mgr.free_slots
        if (not free or mgr.pins.item(free[-1])) and not mgr.has_room(1):
            raise PoolExhausted(_ALL_PINNED)
        known: bool = mgr.corrupt.item(pid)
        uid: int = mgr.uid.item(pid)
        fill: int = mgr.fill.item(pid)
        csum: int = mgr.csum.item(pid)
        if free:  # take_slots(mgr, 1) without the loop an eviction needs
            slot = free.pop()
            if mgr.on_take is not None:
                mgr.on_take()
        else:
            slot = take_slots(mgr, 1)[0]
        stats = mgr.stats
        started = _clock()
        try:
            if known:
                raise PageCorrupt(f"page {uid} is corrupt", uid)
            with mgr.spill.locked_read() as txn:
                # The slot is checked against the page's checksum here, as verify would check it.
                size = _fetch_into(mgr, record_layout(mgr.geom), txn, uid, fill, csum, slot)
                faults.crashpoint("restore.after_copy")
        except PageCorrupt:
            free.append(slot)
            mgr.corrupt[pid] = True
            stats.counts["misses"] += 1
            if not known:
                log.warning("page %d: its spill record fails its checksum (or is missing); the page "
                            "is unreadable until it is rewritten", uid)
            raise
        except BaseException:
            free.append(slot)
            raise
        mgr.place(pid, slot)  # marks the slot used
        counts = stats.counts
        counts["restores"] += 1
        counts["spill_hits"] += 1
        counts["bytes_restored"] += size
        stats.restore_latency(_clock() - started)
    if mgr.pool_exposed:
        mgr.verify_committed(np.array([pid]))
    return slot


def restore(mgr: PageTable, pids: np.ndarray) -> None:
    """Bring spilled pages back into free slots (evicting as needed); PageCorrupt if one fails."""
    count = len(pids)
    # Under a spill cap, restore a batch at a time: each batch's eviction can then
    # free the records the previous batch made redundant, so the cap is never
    # passed by more than one batch. Restored batches stay pinned until the end.
    if mgr.spill_limit is None:  # one batch
        _, bad = _restore_batch(mgr, pids, take_slots(mgr, count))
        if bad is not None:
            raise bad
        return
    chunk = mgr.evict_batch
    bad = None
    held: list[int] = []
    try:
        for start in range(0, count, chunk):
            part = pids[start:start + chunk]
            slots = take_slots(mgr, len(part))
            filled, failed = _restore_batch(mgr, part, slots)
            bad = bad or failed
            if start + chunk < count:  # only a later batch's eviction could take them
                mgr.pin(filled)
                held += filled
    finally:
        if held:
            mgr.unpin(held)
    if bad is not None:
        raise bad


def _restore_batch(mgr: PageTable, pids: np.ndarray,
                   slots: list[int]) -> tuple[list[int], PageCorrupt | None]:
    """Restore ``pids`` into ``slots`` in one read transaction; return the slots filled and the first failure.

    A corrupt page hands its slot back and is marked corrupt. On any other
    exception the slots not yet filled are handed back; pages already copied
    are placed (each is whole and verified).
    """
    layout, stats = record_layout(mgr.geom), mgr.stats
    # A page's scalars are read one by one: a step restores a few pages, where a gather
    # and a list per column cost more than the reads.
    uid_of, fill_of, csum_of, corrupt_of = mgr.uid.item, mgr.fill.item, mgr.csum.item, mgr.corrupt.item
    filled: list[int] = []
    bad: PageCorrupt | None = None
    done = nbytes = misses = 0
    try:
        with mgr.spill.locked_read() as txn:  # restores run under the store lock
            started = _clock()  # a page's latency runs from the end of the one before: one clock read a page
            for pid, slot in zip(pids.tolist(), slots):
                uid, fill, csum = uid_of(pid), fill_of(pid), csum_of(pid)
                try:
                    if corrupt_of(pid):
                        raise PageCorrupt(f"page {uid} is corrupt", uid)
                    size = _fetch_into(mgr, layout, txn, uid, fill, csum, slot)
                    faults.crashpoint("restore.after_copy")
                except PageCorrupt as exc:
                    mgr.free_slots.append(slot)
                    mgr.corrupt[pid] = True
                    misses += 1
                    bad = bad or exc
                    done += 1
                    started = _clock()
                    continue
                mgr.place(pid, slot)
                filled.append(slot)
                done += 1
                nbytes += size
                now = _clock()
                stats.restore_latency(now - started)
                started = now
    except BaseException:
        mgr.free_slots.extend(slots[done:])
        raise
    finally:
        counts = stats.counts
        counts["restores"] += len(filled)
        counts["spill_hits"] += len(filled)
        counts["bytes_restored"] += nbytes
        counts["misses"] += misses
    return filled, bad


def read_record(mgr: PageTable, txn: object, pid: int) -> tuple[np.ndarray, int]:
    """Fetch and validate ``pid``'s spilled record; return a view of its page and its size.

    Both the record's own checksum and the directory's (which may cover fewer
    tokens, after a crash) must hold; otherwise ``PageCorrupt``.
    """
    uid = int(mgr.uid[pid])
    if mgr.corrupt[pid]:
        raise PageCorrupt(f"page {uid} is corrupt", uid)
    return fetch_record(mgr, txn, uid, int(mgr.fill[pid]), int(mgr.csum[pid]))


def fetch_record(mgr: PageTable, txn: object, uid: int, fill: int, csum: int) -> tuple[np.ndarray, int]:
    """``read_record`` for a page known by its uid, fill and checksum (safe off the lock)."""
    return _fetch(mgr, record_layout(mgr.geom), txn, uid, fill, csum)


def _fetch(mgr: PageTable, layout: RecordLayout, txn: Any, uid: int, fill: int,
           csum: int) -> tuple[np.ndarray, int]:
    """The checked page (a view of the record) and the record's size."""
    value = _get(mgr, txn, uid)
    start = layout.raw_payload_at(value, uid, fill, csum)
    if start < 0:  # any other record: the full checks, which also name what is wrong
        return _fetch_checked(mgr, value, uid, fill, csum)
    page = np.ndarray(layout.page_shape, layout.np_dtype, value, start)
    if page_checksum(page, fill, uid, mgr.seed) != csum:
        raise PageCorrupt(f"page {uid}: spilled record fails its checksum", uid)
    return page, len(value)


def _fetch_into(mgr: PageTable, layout: RecordLayout, txn: Any, uid: int, fill: int, csum: int,
                slot: int) -> int:
    """``_fetch`` copied into ``slot`` (a free slot); return the record's size.

    The payload is copied first and the slot checked, where the bytes are then
    hot in cache: 1-2 us a page cheaper than hashing the record's cold bytes. A
    failure has written only a free slot.
    """
    value = _get(mgr, txn, uid)
    start = layout.raw_payload_at(value, uid, fill, csum)
    if start < 0:
        page, size = _fetch_checked(mgr, value, uid, fill, csum)
        mgr.pool[slot] = page
        return size
    nbytes = layout.page_nbytes
    at = slot * nbytes
    dest = mgr.pool_file.slot_bytes[at:at + nbytes]
    dest[:] = value[start:]  # a slice of a buffer is a view, of bytes a copy: either fills the slot
    if runs_checksum(dest, fill, layout.page_shape[2], layout.runs, uid, mgr.seed) != csum:
        raise PageCorrupt(f"page {uid}: spilled record fails its checksum", uid)
    return len(value)


def _get(mgr: PageTable, txn: Any, uid: int) -> Any:
    """The spill record of page ``uid``; ``PageCorrupt`` when it is missing."""
    value = txn.get(uid_key(uid), db=mgr.spill.pages)
    if value is None:
        raise PageCorrupt(f"page {uid}: spilled record is missing", uid)
    return value


def _fetch_checked(mgr: PageTable, value: Any, uid: int, fill: int, csum: int) -> tuple[np.ndarray, int]:
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
