"""Eviction: spill least-recently-used slots to LMDB in one transaction, under the spill cap.

A batch is planned first (records to write, directory placements to update,
cache-only pages to drop), checked against ``spill_limit_bytes``, then written in
one LMDB transaction; slots are freed only after it commits, so the committed
directory never points at a slot that was reused.

Dropping cache-only pages on their own (``KVStore.clear_cache``, a lowered cap at
open) plans the same deletions as the cap does (``_drop``) and commits them in a
transaction of their own.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import faults
from ..storage.codec import encode_spill, page_checksum
from ..errors import PoolExhausted, StoreFull
from ..storage.spill import uid_key
from ..storage.codecs import CODECS
from .directory import NOWHERE, REC_CURRENT, REC_NONE, REC_STALE, SPILLED
from .table import PageTable


log = logging.getLogger(__name__)


class _Plan:
    """What one eviction transaction writes, deletes and frees."""

    def __init__(self) -> None:
        self.puts: list[tuple[Any, bytes, bytes | bytearray]] = []
        self.deletes: list[tuple[Any, bytes]] = []
        self.spilled: list[tuple[int, int, int]] = []  # (slot, pid, record bytes or -1 kept)
        self.dropped: list[int] = []
        self.csums: dict[int, int] = {}  # pid -> checksum of its lossily encoded content
        self.c_csums: dict[int, int] = {}  # pid -> the same over its committed tokens
        self.codecs: dict[int, int] = {}  # pid -> codec index of its new record
        self.repointed: list[int] = []  # resident pages whose redundant record goes
        self.added = 0
        self.removed = 0


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
    if not victims:
        return 0
    plan = _Plan()
    live = mgr.slot_pid[victims]
    cpids = mgr.slot_cpid[victims]
    recs = mgr.rec[np.maximum(live, 0)]
    for slot, pid, cpid, rec in zip(victims, live.tolist(), cpids.tolist(), recs.tolist()):
        if pid < 0:  # a freed page whose committed bytes must outlive its slot
            pid = cpid
            _put_record(mgr, plan, slot, pid, int(mgr.c_fill[pid]), int(mgr.c_csum[pid]))
        elif rec != REC_CURRENT:
            # An unverified page keeps its committed checksum, so damage is caught
            # at restore instead of being laundered into a new record.
            _put_record(mgr, plan, slot, pid, int(mgr.fill[pid]), mgr.checksum(pid))
        else:
            plan.spilled.append((slot, pid, -1))
        if cpid == pid or pid in plan.c_csums:
            entry = mgr.committed_entry(pid, SPILLED, plan.c_csums.get(pid), plan.codecs.get(pid))
            plan.puts.append((mgr.spill.dir, uid_key(int(mgr.uid[pid])), entry))
    for uid, nbytes in mgr.doomed:
        plan.deletes.append((mgr.spill.pages, uid_key(uid)))
        plan.removed += nbytes
    if mgr.spill_limit is not None:
        _enforce_cap(mgr, plan, strict)
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
    _settle(mgr, plan.spilled)
    for pid in plan.repointed:
        mgr.spill_bytes -= int(mgr.rec_bytes[pid])
        mgr.rec_bytes[pid] = 0
        mgr.rec[pid] = REC_NONE
        if mgr.c_where[pid] == SPILLED:
            mgr.c_where[pid] = mgr.slot[pid]
            mgr.slot_cpid[mgr.slot[pid]] = pid
    for pid, csum in plan.csums.items():
        mgr.csum[pid] = csum
    for pid, csum in plan.c_csums.items():
        mgr.c_csum[pid] = csum
    for pid, codec in plan.codecs.items():
        mgr.codec[pid] = codec
    _forget_dropped(mgr, plan)
    mgr.evict_epoch += 1
    mgr.spill_bytes -= sum(nbytes for _, nbytes in doomed)
    mgr.stats.add("evictions", len(victims))
    mgr.stats.add("evict_batches")
    mgr.stats.add("bytes_spilled", plan.added)
    log.debug("evicted %d pages in one transaction: %d record bytes written, %d deleted, "
              "%d cache pages dropped", len(victims), plan.added, plan.removed, len(plan.dropped))
    return len(victims)


def _forget_dropped(mgr: PageTable, plan: _Plan) -> None:
    """After the transaction that deleted them: the dropped cache pages leave memory."""
    for pid in plan.dropped:
        mgr.forget(pid)
    mgr.stats.add("cache_drops", len(plan.dropped))


def _settle(mgr: PageTable, spilled: list[tuple[int, int, int]]) -> None:
    """After the commit: the spilled pages leave their slots, which become free.

    Column-wise for the whole batch: a victim's pid is unique to it (a page is
    resident in one slot, and a slot kept for committed bytes holds a freed page).
    """

    if not spilled:
        return
    slots, pids, nbytes = np.array(spilled, np.int64).T
    moved = mgr.slot_pid[slots] == pids
    mgr.pstamp[pids[moved]] = mgr.stamp[slots[moved]]
    mgr.slot[pids[moved]] = -1
    mgr.slot_pid[slots[moved]] = -1
    wrote = nbytes >= 0
    mgr.spill_bytes += int(nbytes[wrote].sum()) - int(mgr.rec_bytes[pids[wrote]].sum())
    mgr.rec_bytes[pids[wrote]] = nbytes[wrote]
    mgr.rec[pids] = REC_CURRENT
    committed = mgr.slot_cpid[slots] == pids
    mgr.c_where[pids[committed]] = SPILLED
    mgr.slot_cpid[slots[committed]] = -1
    mgr.free_slots.extend(slots.tolist())


def land_background(mgr: PageTable, victims: list[dict[str, Any]], written: set[int]) -> None:
    """Bring the page table in line with what a write-behind transaction wrote (under the store lock).

    ``victims`` are the batch the write-behind thread planned (slot, pid, uid, gen,
    record, entry, checksums), ``written`` the slots whose page its transaction spilled.
    Pages freed, rewritten or pinned meanwhile stay as they are now.
    """
    freed = 0
    for v in victims:
        slot = v["slot"]
        mgr.bg_pins[slot] -= 1
        if slot in written:
            freed += _landed_page(mgr, v)
        # A page freed during the batch left its slot to us (see BlockManager._free).
        if mgr.slot_pid[slot] < 0 and mgr.slot_cpid[slot] < 0 and mgr.bg_pins[slot] == 0:
            mgr.free_slots.append(slot)
    if freed:
        mgr.evict_epoch += 1
        mgr.stats.add("evictions", freed)
        mgr.stats.add("background_evictions", freed)
        mgr.stats.add("evict_batches")


def _landed_page(mgr: PageTable, v: dict[str, Any]) -> int:
    """Account one page a write-behind transaction spilled; return 1 if its slot is now free."""
    slot, pid = v["slot"], v["pid"]
    mine = int(mgr.uid[pid]) == v["uid"] and (mgr.live[pid] or v["entry"] is not None)
    if not mine:  # freed (and perhaps reused) before it was ever committed
        if v["record"] is not None:
            mgr.doomed.append((v["uid"], len(v["record"])))
            mgr.spill_bytes += len(v["record"])
        return 0
    if v["record"] is not None:
        mgr.spill_bytes += len(v["record"]) - int(mgr.rec_bytes[pid])
        mgr.rec_bytes[pid], mgr.codec[pid] = len(v["record"]), v["codec"]
        mgr.rec[pid] = REC_CURRENT
    if v["entry"] is not None:  # the disk now says "spilled", whatever happens next
        mgr.c_where[pid], mgr.c_csum[pid] = SPILLED, v["new_c_csum"]
        if mgr.slot_cpid[slot] == pid:
            mgr.slot_cpid[slot] = -1
    if not mgr.live[pid] or int(mgr.slot[pid]) != slot:
        return 0
    if int(mgr.gen[pid]) != v["gen"]:
        mgr.rec[pid] = REC_STALE  # written meanwhile: the record holds an older fill
        return 0
    mgr.csum[pid], mgr.csum_ok[pid] = v["csum"], True
    if mgr.pins[slot]:
        return 0  # a step uses it now: stays resident, its record is current
    mgr.pstamp[pid] = mgr.stamp[slot]
    mgr.slot[pid] = -1
    mgr.slot_pid[slot] = -1
    return 1


def _choose(mgr: PageTable, count: int) -> list[int]:
    """Slots to free: those holding only a dropped page's committed bytes, then LRU pages."""
    idle = (mgr.pins == 0) & (mgr.bg_pins == 0)
    reclaim = np.flatnonzero((mgr.slot_pid < 0) & (mgr.slot_cpid >= 0) & idle)
    live = np.flatnonzero((mgr.slot_pid >= 0) & idle)
    if len(live) > count:
        live = live[np.argpartition(mgr.stamp[live], count - 1)[:count]]
    live = live[np.argsort(mgr.stamp[live], kind="stable")]
    chosen: list[int] = np.concatenate([reclaim[:count], live[: max(0, count - len(reclaim))]]).tolist()
    return chosen


def _put_record(mgr: PageTable, plan: _Plan, slot: int, pid: int, fill: int, csum: int) -> None:

    uid = int(mgr.uid[pid])
    record, used, decoded = encode_spill(mgr.geom, uid, fill, csum, mgr.pool[slot], mgr.spill_codec,
                                         mgr.seed)
    plan.codecs[pid] = CODECS.index(used)
    if decoded is not None:
        # Lossy: from now on the page *is* its dequantised values, committed tokens included.
        plan.csums[pid] = page_checksum(decoded, fill, uid, mgr.seed)
        if mgr.c_where[pid] != NOWHERE:
            plan.c_csums[pid] = page_checksum(decoded, int(mgr.c_fill[pid]), uid, mgr.seed)
    plan.puts.append((mgr.spill.pages, uid_key(uid), record))
    plan.spilled.append((slot, pid, len(record)))
    plan.added += len(record)
    plan.removed += int(mgr.rec_bytes[pid])


def _enforce_cap(mgr: PageTable, plan: _Plan, strict: bool) -> None:
    """Make room under the cap: redundant records first, then LRU cache-only pages.

    The cap is never exceeded by more than the batch being written.
    """
    limit = mgr.spill_limit
    assert limit is not None
    projected = mgr.spill_bytes + plan.added - plan.removed
    if projected <= limit:
        return
    spilling = {pid for _, pid, _ in plan.spilled}
    projected = _repoint(mgr, plan, spilling, projected, limit)
    # Cache-only pages already spilled free their record; cache-only victims are
    # dropped rather than spilled. Both in least-recently-used order.
    candidates = mgr.droppable()
    candidates_set = set(candidates.tolist())
    order = sorted(candidates.tolist(), key=lambda pid: (pid not in spilling and mgr.slot[pid] >= 0,
                                                          int(mgr.last_use(pid))))
    for pid in order:
        if projected <= limit:
            break
        if mgr.slot[pid] >= 0 and pid not in spilling:
            # A resident cache page frees a slot: it stands in for the costliest victim.
            costly = [item for item in plan.spilled if item[2] > 0 and item[1] not in candidates_set]
            if not costly:
                continue
            projected -= _unplan(mgr, plan, costly[-1])
        elif pid in spilling:
            _unplan(mgr, plan, next(item for item in plan.spilled if item[1] == pid))
            projected = mgr.spill_bytes + plan.added - plan.removed
        projected -= _drop(mgr, plan, pid)
    # One batch may overshoot (a swap needs the evicted page's record before the
    # restored one's can go); what was stored before it may not, unless the batch
    # adds nothing (re-evicting pages whose records are still there).
    if plan.added and (projected - plan.added > limit or (strict and projected > limit)):
        raise StoreFull(
            f"spill cap of {limit} bytes reached: {projected} bytes would be stored and only pages "
            "of live (or not yet committed) sequences remain; raise spill_limit_bytes or commit")


def _repoint(mgr: PageTable, plan: _Plan, spilling: set[int], projected: int, limit: int) -> int:
    """Free the records of restored pages: the committed directory moves to their slots.

    A restored page keeps its record until the next commit; under the cap that
    copy is the first thing to go. Its slot is flushed first, so the directory
    never points at bytes that are not durable.
    """

    rows = np.flatnonzero(mgr.live & (mgr.slot >= 0) & (mgr.rec != REC_NONE))
    flush = []
    for pid in rows.tolist():
        if projected <= limit:
            break
        if pid in spilling:
            continue
        key = uid_key(int(mgr.uid[pid]))
        plan.deletes.append((mgr.spill.pages, key))
        plan.removed += int(mgr.rec_bytes[pid])
        projected -= int(mgr.rec_bytes[pid])
        if mgr.c_where[pid] == SPILLED:
            slot = int(mgr.slot[pid])
            flush.append(slot)
            plan.puts.append((mgr.spill.dir, key, mgr.committed_entry(pid, slot)))
        else:
            assert mgr.c_where[pid] == NOWHERE
        plan.repointed.append(pid)
    if flush and mgr.sync:
        mgr.pool_file.flush_slots(flush)
    return projected


def _unplan(mgr: PageTable, plan: _Plan, item: tuple[int, int, int]) -> int:
    """Take a victim out of the batch; return the stored bytes that saves."""
    slot, pid, nbytes = item
    plan.spilled.remove(item)
    key = uid_key(int(mgr.uid[pid]))
    plan.puts = [put for put in plan.puts if put[1] != key]
    if nbytes < 0:
        return 0
    plan.added -= nbytes
    plan.removed -= int(mgr.rec_bytes[pid])
    return nbytes - int(mgr.rec_bytes[pid])


def _drop(mgr: PageTable, plan: _Plan, pid: int) -> int:
    """Plan to forget a cache-only page entirely; return the spill bytes it frees."""

    key = uid_key(int(mgr.uid[pid]))
    freed = 0
    if mgr.rec[pid] != REC_NONE:
        plan.deletes.append((mgr.spill.pages, key))
        freed = int(mgr.rec_bytes[pid])
        plan.removed += freed
    if mgr.c_where[pid] != NOWHERE:
        plan.deletes.append((mgr.spill.dir, key))
    plan.deletes.append((mgr.spill.tokens, key))
    plan.dropped.append(pid)
    return freed


def drop_cache(mgr: PageTable, max_bytes: int | None) -> dict[str, int]:
    """Drop least recently used cache-only pages until their records take at most ``max_bytes``.

    ``KVStore.clear_cache``. The candidates are ``droppable()`` pages, resident
    or spilled, oldest first; every page older than the last one that must go
    goes too (what stays is the most recently used part of the cache). None
    drops them all. One LMDB transaction deletes their records, directory
    entries and token ids (``_drop``, as the spill cap does), with any
    uncommitted records already doomed; nothing else is committed by it.
    Returns ``{"pages", "bytes", "slots"}``: pages dropped, record bytes freed,
    pool slots freed.
    """
    order = _oldest_first(mgr, mgr.droppable())
    if max_bytes is not None:
        excess = mgr.cache_bytes() - max_bytes
        order = order[:_cut(mgr, order, excess)]
    return _drop_now(mgr, order, "clear cache")


def enforce_cap_at_open(mgr: PageTable) -> dict[str, int]:
    """Bring a store whose records exceed a (lowered) ``spill_limit_bytes`` under it at once.

    Spilled cache-only pages go, oldest first, until the records fit; resident
    ones hold no record and stay. If only pages of live sequences remain above
    the cap, that is logged and the cap applies from the next eviction on.
    """
    limit = mgr.spill_limit
    if limit is None or mgr.spill_bytes <= limit:
        return {"pages": 0, "bytes": 0, "slots": 0}
    spilled = mgr.droppable()
    spilled = spilled[mgr.slot[spilled] < 0]
    order = _oldest_first(mgr, spilled)
    doomed = sum(nbytes for _, nbytes in mgr.doomed)  # deleted by the same transaction
    order = order[:_cut(mgr, order, mgr.spill_bytes - doomed - limit)]
    before = mgr.spill_bytes
    dropped = _drop_now(mgr, order, "enforce spill cap")
    if dropped["pages"]:
        log.info("spill_limit_bytes=%d: dropped %d cache-only pages (%d record bytes) at open; "
                 "%d bytes of records were stored", limit, dropped["pages"], dropped["bytes"], before)
    if mgr.spill_bytes > limit:
        log.warning("spill_limit_bytes=%d: %d bytes of records remain, all of pages of live (or "
                    "committed) sequences; the cap applies from the next eviction on",
                    limit, mgr.spill_bytes)
    return dropped


def _oldest_first(mgr: PageTable, pids: np.ndarray) -> list[int]:
    return sorted(pids.tolist(), key=mgr.last_use)


def _cut(mgr: PageTable, order: list[int], excess: int) -> int:
    """How many of ``order`` must go for their records to free ``excess`` bytes (all, if they cannot)."""

    freed = 0
    for count, pid in enumerate(order):
        if freed >= excess:
            return count
        if mgr.rec[pid] != REC_NONE:
            freed += int(mgr.rec_bytes[pid])
    return len(order)


def _drop_now(mgr: PageTable, pids: list[int], what: str) -> dict[str, int]:
    """Forget cache-only pages ``pids`` in one transaction of their own (see ``drop_cache``)."""
    if mgr.wait_background is not None:
        mgr.wait_background()
    if not pids and not mgr.doomed:
        return {"pages": 0, "bytes": 0, "slots": 0}
    plan = _Plan()
    freed = sum(_drop(mgr, plan, pid) for pid in pids)
    slots = int(np.count_nonzero(mgr.slot[np.asarray(pids, np.int64)] >= 0)) if pids else 0
    for uid, nbytes in mgr.doomed:
        plan.deletes.append((mgr.spill.pages, uid_key(uid)))
    doomed, mgr.doomed = mgr.doomed, []

    def body(txn: Any) -> None:
        for db, key in plan.deletes:
            txn.delete(key, db=db)

    try:
        mgr.spill.write(body, what)
    except BaseException:
        mgr.doomed = doomed + mgr.doomed
        raise
    _forget_dropped(mgr, plan)
    mgr.spill_bytes -= sum(nbytes for _, nbytes in doomed)
    if slots:
        mgr.evict_epoch += 1
    if pids:
        log.debug("%s: dropped %d cache-only pages, %d record bytes, %d pool slots", what, len(pids),
                  freed, slots)
    return {"pages": len(pids), "bytes": freed, "slots": slots}
