"""``KVStore.check()``: an fsck of every invariant and every page checksum."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .codec import page_checksum
from .errors import PageCorrupt
from .manager import REC_CURRENT
from .spill import key_uid
from .restore import read_record

if TYPE_CHECKING:
    from .store import KVStore


def check_store(store: KVStore) -> list[str]:
    """Every problem found, as one line each; [] when the store is consistent."""
    mgr = store._mgr
    if mgr.wait_background is not None:
        mgr.wait_background()  # a write-behind batch in flight holds slots back
    problems: list[str] = []
    live = np.flatnonzero(mgr.live)
    refs = np.zeros(len(mgr.live), np.int64)
    page_size = store.geometry.page_size
    for seq in store._seqs.values():
        table = seq.table
        if seq.npages != -(-seq.length // page_size):
            problems.append(f"sequence {seq.seq_id!r}: {seq.npages} pages for {seq.length} tokens")
            continue
        if len(table) and not mgr.live[table].all():
            problems.append(f"sequence {seq.seq_id!r} references a freed page")
            continue
        np.add.at(refs, table, 1)
        if len(table):
            need = np.full(len(table), page_size)
            need[-1] = seq.length - (len(table) - 1) * page_size
            if (mgr.fill[table] < need).any():
                problems.append(f"sequence {seq.seq_id!r}: a page holds fewer tokens than the table uses")
    wrong = live[refs[live] != mgr.ref[live]]
    problems += [f"page {int(mgr.uid[p])}: refcount {int(mgr.ref[p])}, referenced {int(refs[p])} times"
                 for p in wrong[:20]]
    problems += _check_slots(store, live)
    problems += _check_pages(store, live)
    return problems


def _check_slots(store: KVStore, live: np.ndarray) -> list[str]:
    mgr = store._mgr
    problems = []
    resident = live[mgr.slot[live] >= 0]
    if (mgr.slot_pid[mgr.slot[resident]] != resident).any():
        problems.append("a resident page's slot names another page")
    owners = np.flatnonzero(mgr.slot_pid >= 0)
    if len(owners) != len(resident):
        problems.append(f"{len(owners)} slots are occupied but {len(resident)} pages are resident")
    free = mgr.free_slots
    if len(set(free)) != len(free):
        problems.append("a slot is on the free list twice")
    expected_free = set(np.flatnonzero((mgr.slot_pid < 0) & (mgr.slot_cpid < 0)).tolist())
    if set(free) != expected_free:
        problems.append(f"free list has {len(free)} slots, {len(expected_free)} are free")
    pending = int(np.count_nonzero((mgr.slot_pid < 0) & (mgr.slot_cpid >= 0)))
    if len(owners) + len(free) + pending != store.pool_pages:
        problems.append("used + free + pending slots do not add up to the pool size")
    if (mgr.pins < 0).any():
        problems.append("a slot has a negative pin count")
    return problems


def _check_pages(store: KVStore, live: np.ndarray) -> list[str]:
    mgr = store._mgr
    problems = []
    for pid in live.tolist():
        uid, slot = int(mgr.uid[pid]), int(mgr.slot[pid])
        if slot >= 0:
            if mgr.csum_ok[pid]:
                actual = page_checksum(mgr.pool[slot], int(mgr.fill[pid]), uid, mgr.seed)
                if actual != int(mgr.csum[pid]):
                    problems.append(f"page {uid}: pool slot {slot} fails its checksum")
        elif mgr.rec[pid] != REC_CURRENT:
            problems.append(f"page {uid}: spilled without a current record")
    spilled = live[mgr.slot[live] < 0]
    with mgr.spill.begin_read() as txn:
        for pid in spilled.tolist():
            uid = int(mgr.uid[pid])
            try:
                read_record(mgr, txn, pid)
            except PageCorrupt as exc:
                problems.append(str(exc))
    # A read-only handle sees the records a crashed writer left uncommitted; the
    # next writer collects them, so they are not damage.
    if not store.readonly:
        problems += [f"spill record {uid} belongs to no page" for uid in stray_records(store)]
    return problems


def stray_records(store: KVStore) -> list[int]:
    """Uids of spill records no page owns (after a crash: left for the next writer to delete)."""
    mgr = store._mgr
    known = set(mgr.uid[np.flatnonzero(mgr.live)].tolist()) | {uid for uid, _ in mgr.doomed}
    known |= {int(mgr.uid[p]) for p in mgr.zombies}
    with mgr.spill.begin_read() as txn:
        keys = [key_uid(bytes(key)) for key in mgr.spill.iterate(txn, mgr.spill.pages, keys_only=True)]
    return [uid for uid in keys if uid not in known]
