"""The spill cap and cache drops: what a batch removes to stay under ``spill_limit_bytes``.

An eviction batch over the cap (``enforce_cap``) first frees the redundant
records of restored pages (``_repoint``), then drops least recently used
cache-only pages (``_drop``), and raises ``StoreFull`` when only live pages
remain over it. The deletions ride in the batch's own transaction; once it
commits, ``settle_cap`` brings memory in line.

Dropping cache-only pages on their own (``KVStore.clear_cache``, a lowered cap at
open) plans the same deletions and commits them in a transaction of their own
(``drop_cache``, ``enforce_cap_at_open``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..errors import StoreFull
from ..storage.spill import uid_key
from .directory import NOWHERE, REC_NONE, SPILLED
from .spillbatch import Plan, Spilled
from .table import PageTable

__all__ = ["drop_cache", "enforce_cap", "enforce_cap_at_open", "settle_cap"]

# The eviction module's logger: operators filter the cap's and the cache drops'
# messages by the name they have always had.
log = logging.getLogger("pagedkv.pages.evict")


def enforce_cap(mgr: PageTable, plan: Plan, strict: bool) -> None:
    """Make room under the cap: redundant records first, then LRU cache-only pages.

    The cap is never exceeded by more than the batch being written.
    """
    limit = mgr.spill_limit
    assert limit is not None
    projected = mgr.spill_bytes + plan.added - plan.removed
    if projected <= limit:
        return
    spilling = {item.pid for item in plan.spilled}
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
            costly = [item for item in plan.spilled if item.nbytes > 0 and item.pid not in candidates_set]
            if not costly:
                continue
            projected -= _unplan(mgr, plan, costly[-1])
        elif pid in spilling:
            _unplan(mgr, plan, next(item for item in plan.spilled if item.pid == pid))
            projected = mgr.spill_bytes + plan.added - plan.removed
        projected -= _drop(mgr, plan, pid)
    # One batch may overshoot (a swap needs the evicted page's record before the
    # restored one's can go); what was stored before it may not, unless the batch
    # adds nothing (re-evicting pages whose records are still there).
    if plan.added and (projected - plan.added > limit or (strict and projected > limit)):
        raise StoreFull(
            f"spill cap of {limit} bytes reached: {projected} bytes would be stored and only pages "
            "of live (or not yet committed) sequences remain; raise spill_limit_bytes or commit")


def settle_cap(mgr: PageTable, plan: Plan) -> None:
    """After the batch's transaction: repointed pages lose their record, dropped ones leave memory."""
    for pid in plan.repointed:
        mgr.spill_bytes -= int(mgr.rec_bytes[pid])
        mgr.rec_bytes[pid] = 0
        mgr.rec[pid] = REC_NONE
        if mgr.c_where[pid] == SPILLED:
            mgr.c_where[pid] = mgr.slot[pid]
            mgr.slot_cpid[mgr.slot[pid]] = pid
    _forget_dropped(mgr, plan)


def _repoint(mgr: PageTable, plan: Plan, spilling: set[int], projected: int, limit: int) -> int:
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


def _unplan(mgr: PageTable, plan: Plan, item: Spilled) -> int:
    """Take a victim out of the batch (its checksums and codec go with it); return the stored bytes that saves."""
    plan.spilled.remove(item)
    key = uid_key(item.uid)
    plan.puts = [put for put in plan.puts if put[1] != key]
    if item.nbytes < 0:
        return 0
    plan.added -= item.nbytes
    plan.removed -= int(mgr.rec_bytes[item.pid])
    return item.nbytes - int(mgr.rec_bytes[item.pid])


def _drop(mgr: PageTable, plan: Plan, pid: int) -> int:
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


def _forget_dropped(mgr: PageTable, plan: Plan) -> None:
    """After the transaction that deleted them: the dropped cache pages leave memory."""
    for pid in plan.dropped:
        mgr.forget(pid)
    mgr.stats.add("cache_drops", len(plan.dropped))


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
    plan = Plan()
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
