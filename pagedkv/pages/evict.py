"""Eviction: spill least-recently-used slots to LMDB in one transaction, and apply what it spilled.

A foreground batch is planned first (``_choose`` the victims, a record for each
that has no current one, its committed directory entry repointed to SPILLED),
checked against ``spill_limit_bytes`` (``spillcap.py``), then written in one LMDB
transaction; slots are freed only after it commits, so the committed directory
never points at a slot that was reused.

One applier, ``apply_spilled``, brings the page table in line with a committed
batch, for the foreground's batches and write-behind's (``land_background``)
alike. Write-behind writes off the store lock, so what happened to a page
between plan and landing is checked for each; a foreground batch is planned,
written and applied under the lock, and passes every such check.

Cache drops and the cap at open live in ``spillcap.py``; ``drop_cache`` and
``enforce_cap_at_open`` are importable from here as well.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

from .. import faults
from ..errors import PoolExhausted, StoreFull
from ..storage.codec import encode_spill, page_checksum, record_layout
from ..storage.codecs import CODECS, LOSSY
from ..storage.spill import uid_key
from .directory import NOWHERE, ONE, REC_CURRENT, REC_STALE, SPILLED
from .spillbatch import Plan, Spilled
from .spillcap import drop_cache, enforce_cap, enforce_cap_at_open, settle_cap
from .table import PageTable

_LOSSY = frozenset(CODECS.index(name) for name in LOSSY)  # codec indexes of lossy records
_RAW = CODECS.index("raw")

__all__ = ["Spilled", "apply_spilled", "drop_cache", "enforce_cap_at_open", "evict", "land_background",
           "take_slots"]

log = logging.getLogger(__name__)


def take_slots(mgr: PageTable, count: int) -> list[int]:
    """``count`` free slots, evicting least-recently-used pages in batches as needed."""
    while len(mgr.free_slots) < count:
        need = count - len(mgr.free_slots)
        if not evict(mgr, max(need, mgr.evict_batch), need) and len(mgr.free_slots) < count:
            raise PoolExhausted(f"need {count} free slots, {len(mgr.free_slots)} free and every other slot pinned")
    taken = [mgr.free_slots.pop() for _ in range(count)]
    if mgr.on_take is not None:
        mgr.on_take()
    return taken


def evict(mgr: PageTable, count: int, need: int | None = None) -> int:
    """Free up to ``count`` unpinned slots, LRU first; return how many were freed.

    Under a spill cap a full batch may not fit where the ``need`` slots the
    caller must have still do: then only those are evicted.
    """
    if mgr.wait_background is not None:
        mgr.wait_background()
    if need is None or need >= count or mgr.spill_limit is None:
        return _evict(mgr, count, strict=False)
    try:  # a whole batch only if it fits under the cap; else just what is needed
        return _evict(mgr, count, strict=True)
    except StoreFull:
        return _evict(mgr, need, strict=False)


def _evict(mgr: PageTable, count: int, strict: bool) -> int:
    victims = _choose(mgr, count)
    if not len(victims):
        return 0
    plan = Plan()
    live = mgr.slot_pid[victims]
    cpids = mgr.slot_cpid[victims]
    freed = live < 0  # a freed page whose committed bytes must outlive its slot
    pids = np.where(freed, cpids, live)
    # Most victims keep their current record: they are planned column-wise, and only the
    # pages that need a record take a Python pass each.
    write = np.flatnonzero(freed | (mgr.rec[pids] != REC_CURRENT)).tolist()
    plan.spilled = items = list(map(Spilled._make, zip(
        victims.tolist(), pids.tolist(), mgr.gen[pids].tolist(), repeat(-1), mgr.codec[pids].tolist(),
        (cpids == pids).tolist(), mgr.uid[pids].tolist(), repeat(None), repeat(None))))
    for index in write:
        slot, pid, gen, _, _, committed, uid, _, _ = items[index]
        csum: int | None
        if freed[index]:
            fill, csum = mgr.c_fill.item(pid), mgr.c_csum.item(pid)
        else:
            # An unverified page keeps its committed checksum, so damage is caught
            # at restore instead of being laundered into a new record.
            fill, csum = mgr.fill.item(pid), mgr.csum.item(pid) if mgr.csum_ok.item(pid) else None
        items[index] = _put_record(mgr, plan, slot, pid, gen, committed, uid, fill, csum)
    for item in items:
        if item.entry:
            entry = mgr.committed_entry(item.pid, SPILLED, item.c_csum, item.codec)
            plan.puts.append((mgr.spill.dir, uid_key(item.uid), entry))
    for uid, nbytes in mgr.doomed:
        plan.deletes.append((mgr.spill.pages, uid_key(uid)))
        plan.removed += nbytes
    if mgr.spill_limit is not None:
        enforce_cap(mgr, plan, strict)
    doomed, mgr.doomed = mgr.doomed, []

    def body(txn: Any) -> None:
        for db, key in plan.deletes:
            txn.delete(key, db=db)
        for db, key, value in plan.puts:
            mgr.spill.put(txn, db, key, value)

    faults.crashpoint("evict.before_commit")
    try:
        mgr.spill.write(body, "evict")
    except BaseException:
        mgr.doomed = doomed + mgr.doomed
        raise
    faults.crashpoint("evict.after_commit")
    apply_spilled(mgr, plan.spilled)
    settle_cap(mgr, plan)
    mgr.evict_epoch += 1
    mgr.spill_bytes -= sum(nbytes for _, nbytes in doomed)
    mgr.stats.add("evictions", len(victims))
    mgr.stats.add("evict_batches")
    mgr.stats.add("bytes_spilled", plan.added)
    log.debug("evicted %d pages in one transaction: %d record bytes written, %d deleted, "
              "%d cache pages dropped", len(victims), plan.added, plan.removed, len(plan.dropped))
    return len(victims)


def _choose(mgr: PageTable, count: int) -> np.ndarray:
    """Slots to free: those holding only a dropped page's committed bytes, then LRU pages."""
    noted = mgr.pending_slots.rows()
    reclaim = noted[mgr.pending_at(noted) & ((mgr.pins[noted] | mgr.bg_pins[noted]) == 0)][:count]
    live = mgr.oldest.take(mgr.slot_pid, mgr.stamp, mgr.pins, mgr.bg_pins, count - len(reclaim))
    if not len(reclaim):
        return live
    chosen: np.ndarray = np.concatenate([reclaim, live])
    return chosen


def _put_record(mgr: PageTable, plan: Plan, slot: int, pid: int, gen: int, committed: bool, uid: int,
                fill: int, csum: int | None) -> Spilled:
    """Plan a record of ``pid``'s first ``fill`` tokens (checksum ``csum``) from ``slot``.

    ``committed``: the slot holds its committed bytes, so the entry goes to SPILLED.
    ``csum`` None: the page's current checksum is not known yet; a raw record
    computes it from its copy of the slot, and the directory keeps it.
    """
    new_csum = new_c_csum = None
    if mgr.spill_codec == "raw":
        layout = record_layout(mgr.geom)
        at = slot * layout.page_nbytes
        record, known = layout.raw_record(uid, fill, mgr.pool_file.slot_bytes[at:at + layout.page_nbytes], csum,
                                          mgr.seed)
        if csum is None:
            mgr.csum[pid], mgr.csum_ok[pid] = known, True
        codec = _RAW
    else:
        record, used, decoded = encode_spill(mgr.geom, uid, fill, mgr.checksum(pid) if csum is None else csum,
                                             mgr.pool[slot], mgr.spill_codec, mgr.seed)
        codec = CODECS.index(used)
        if decoded is not None:
            # Lossy: from now on the page *is* its dequantised values, committed tokens included.
            new_csum = page_checksum(decoded, fill, uid, mgr.seed)
            if mgr.c_where[pid] != NOWHERE:
                new_c_csum, committed = page_checksum(decoded, int(mgr.c_fill[pid]), uid, mgr.seed), True
    plan.puts.append((mgr.spill.pages, uid_key(uid), record))
    plan.added += len(record)
    plan.removed += mgr.rec_bytes.item(pid)
    return Spilled(slot, pid, gen, len(record), codec, committed, uid, new_csum, new_c_csum)


def apply_spilled(mgr: PageTable, landed: Sequence[Spilled], slots: Sequence[int] | None = None) -> int:
    """Bring the page table in line with a committed spill transaction; return how many pages left the pool.

    ``landed`` are the pages the transaction spilled, as their planner saw them.
    Each is checked against what happened to it since; a foreground batch,
    planned, written and applied under the store lock, passes every check:

    - its row still holds it (same ``uid``, and live or committed: a page freed
      with no committed entry, whose row may hold another page now, dooms the
      record instead);
    - the record is the page's, and so is the committed entry if it was rewritten;
    - it still lives in its slot (a zombie leaves it to its committed bytes);
    - it was not written since (``gen``; else its record is stale and it stays);
    - no step pins it (else it stays resident, its record current).

    A page passing all of them leaves its slot. Then each of ``slots`` (by
    default the landed pages' own) that neither the live nor the committed view
    names and no background batch pins goes to the free list, in that order.
    Column-wise for the whole batch: a pid and a slot appear in it once each.
    """
    left = 0
    fields = list(zip(*landed))  # a tuple per field (none for an empty batch)
    if slots is None:
        slots = fields[0] if fields else ()
    if landed:
        pid = np.array(fields[1], np.int64)
        # A row is still the batch's page if its uid matches and it is live, or the batch
        # rewrote its entry (a freed page's committed bytes); entries are rare, so looked for in C.
        held = mgr.live[pid] | np.array(fields[5], np.bool_) if True in fields[5] else mgr.live[pid]
        mine = (mgr.uid[pid] == np.array(fields[6], np.uint64)) & held
        if not mine.all():
            for item in (item for item, ok in zip(landed, mine.tolist()) if not ok and item.nbytes >= 0):
                mgr.doomed.append((item.uid, item.nbytes))
                mgr.spill_bytes += item.nbytes
            landed = [item for item, ok in zip(landed, mine.tolist()) if ok]
            fields = list(zip(*landed))
        if landed:
            left = _apply_mine(mgr, landed, fields)
    if len(slots):
        at = np.asarray(slots, np.int64)
        free = (mgr.slot_pid[at] < 0) & (mgr.slot_cpid[at] < 0) & (mgr.bg_pins[at] == 0)
        mgr.free_slots.extend(at[free].tolist())
    return left


def _apply_mine(mgr: PageTable, landed: Sequence[Spilled], fields: list[tuple[Any, ...]]) -> int:
    """``apply_spilled`` for pages whose rows are still theirs (``fields``: theirs, a tuple per field).

    Returns how many left their slot. The rare cases (rewritten entries, checksums
    brought along) are found in the field tuples, in C, before any numpy call on them.
    """
    slot, pid, gen, nbytes, codec = np.array(fields[:5], np.int64)
    wrote = nbytes >= 0
    rows = pid[wrote]
    mgr.spill_bytes += int(nbytes[wrote].sum() - mgr.rec_bytes[rows].sum())
    mgr.rec_bytes[rows], mgr.codec[rows], mgr.rec[rows] = nbytes[wrote], codec[wrote], REC_CURRENT
    if True in fields[5]:
        entry = np.array(fields[5], np.bool_)
        # The disk now says "spilled", whatever happened to the page since.
        mgr.c_where[pid[entry]] = SPILLED
        held = entry & (mgr.slot_cpid[slot] == pid)
        mgr.slot_cpid[slot[held]] = -1
    there = mgr.live[pid] & (mgr.slot[pid] == slot)
    same = there & (mgr.gen[pid] == gen)
    mgr.rec[pid[there ^ same]] = REC_STALE  # rewritten since: its record holds an older fill
    out = same & (mgr.pins[slot] == 0)  # a pinned page stays resident, its record current
    adopts = None  # which pages take the checksums the batch brought (all, if None)
    if _LOSSY.intersection(fields[4]):
        # A lossy record holds the page's dequantised values. A page that stays resident (pinned,
        # or written since) keeps its own bytes: its record is not them (it is rewritten when the
        # page leaves), its checksums stay its own, and the next commit rewrites its entry (the
        # disk says spilled), deleting that record in the same transaction.
        stays = there & ~out & wrote & np.isin(codec, list(_LOSSY))
        if stays.any():
            mgr.rec[pid[stays]] = REC_STALE
            mgr.note_changed_many(pid[stays])
            adopts = ~stays
            same = same & adopts
    # Few pages bring checksums, if any (a lossy record's, write-behind's).
    lossy = [] if fields[8].count(None) == len(landed) else [
        (row, item.c_csum) for row, item, ok in zip(pid.tolist(), landed,
                                                    repeat(True) if adopts is None else adopts.tolist())
        if ok and item.c_csum is not None and item.entry]
    if lossy:
        mgr.c_csum[[row for row, _ in lossy]] = np.array([value for _, value in lossy], np.uint64)
    known = [] if fields[7].count(None) == len(landed) else [
        (row, item.csum) for row, item, ok in zip(pid.tolist(), landed, same.tolist())
        if ok and item.csum is not None]
    if known:
        rows = np.array([row for row, _ in known], np.int64)
        mgr.csum[rows], mgr.csum_ok[rows] = np.array([value for _, value in known], np.uint64), True
    leaving, emptied = pid[out], slot[out]
    mgr.pstamp[leaving] = mgr.stamp[emptied]
    mgr.slot[leaving] = -1
    mgr.slot_pid[emptied] = -1
    mgr.pending_slots.add_many(emptied[mgr.slot_cpid[emptied] >= 0])  # still holding committed bytes
    return len(leaving)


def land_background(mgr: PageTable, slots: list[int], landed: list[Spilled]) -> None:
    """Bring the page table in line with what a write-behind transaction wrote (under the store lock).

    ``slots`` are the batch the write-behind thread pinned, ``landed`` the pages
    its transaction spilled (``apply_spilled`` checks each against what happened
    meanwhile). A page freed during the batch left its slot to the batch (see
    ``BlockManager._free``), which hands it back here.
    """
    if slots:
        np.subtract.at(mgr.bg_pins, np.asarray(slots, np.int64), ONE)
    freed = apply_spilled(mgr, landed, slots)
    if freed:
        mgr.evict_epoch += 1
        mgr.stats.add("evictions", freed)
        mgr.stats.add("background_evictions", freed)
        mgr.stats.add("evict_batches")
