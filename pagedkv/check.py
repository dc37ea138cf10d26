"""``KVStore.check()``: an fsck of every invariant and every page checksum.

Each problem is a ``Problem``: a stable ``kind``, the page uid and sequence id
it concerns (when it concerns one) and a one-line message. ``check()`` returns
the messages; ``check(detailed=True)`` the ``Problem`` values themselves, so
that tools can tell kinds apart without matching message text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .core import StoreCore
from .storage.codec import page_checksum
from .errors import PageCorrupt
from .pages.directory import REC_CURRENT
from .pages.sequence import SeqId
from .storage.spill import key_uid
from .pages.restore import read_record

# Every kind ``check_store`` reports; a new kind is a new entry here (and in the README).
KINDS = {
    "metadata": "a metadata record failed its checksum or is malformed (a read-only open left it out)",
    "page_count": "a sequence's page count does not cover its length",
    "freed_page": "a sequence references a page that is no longer allocated",
    "short_page": "a page holds fewer tokens than the block table uses",
    "refcount": "a page's refcount differs from the number of block-table references",
    "slot_owner": "a resident page's pool slot names another page",
    "slot_count": "occupied slots and resident pages disagree",
    "free_list": "the free-slot list is inconsistent",
    "pin_count": "a slot has a negative pin count, or the pins held are not the pins counted",
    "pool_checksum": "a resident page's pool slot fails its checksum",
    "missing_record": "a spilled page has no current spill record",
    "record": "a spill record is missing, malformed or fails its checksum",
    "stray_record": "a spill record belongs to no page (left by an interrupted writer)",
}


@dataclass(frozen=True)
class Problem:
    """One problem found by ``KVStore.check(detailed=True)``.

    Attributes:
        kind: one of ``pagedkv.check.KINDS`` (e.g. ``"pool_checksum"``, ``"record"``).
        message: the one-line description ``check()`` returns for it.
        page: the uid of the page concerned, if one is.
        sequence: the id of the sequence concerned, if one is.
    """

    kind: str
    message: str
    page: int | None = None
    sequence: SeqId | None = None

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"kind", "page", "sequence", "message"}`` (an id that is not str or int as its repr)."""
        seq = self.sequence
        return {"kind": self.kind, "page": self.page,
                "sequence": seq if seq is None or type(seq) in (str, int) else repr(seq),
                "message": self.message}


def check_store(store: StoreCore) -> list[Problem]:
    """Every problem found; [] when the store is consistent."""
    mgr = store._mgr
    if mgr.wait_background is not None:
        mgr.wait_background()  # a write-behind batch in flight holds slots back
    problems: list[Problem] = []
    live = np.flatnonzero(mgr.live)
    refs = np.zeros(len(mgr.live), np.int64)
    page_size = store.geometry.page_size
    for seq in store._seqs.values():
        table, sid = seq.table, seq.seq_id
        if seq.npages != -(-seq.length // page_size):
            problems.append(Problem("page_count", f"sequence {sid!r}: {seq.npages} pages for {seq.length} tokens",
                                    sequence=sid))
            continue
        if len(table) and not mgr.live[table].all():
            problems.append(Problem("freed_page", f"sequence {sid!r} references a freed page", sequence=sid))
            continue
        np.add.at(refs, table, 1)
        if len(table):
            need = np.full(len(table), page_size)
            need[-1] = seq.length - (len(table) - 1) * page_size
            short = np.flatnonzero(mgr.fill[table] < need)
            if len(short):
                problems.append(Problem("short_page", f"sequence {sid!r}: a page holds fewer tokens than the "
                                        "table uses", page=int(mgr.uid[table[short[0]]]), sequence=sid))
    wrong = live[refs[live] != mgr.ref[live]]
    problems += [Problem("refcount", f"page {int(mgr.uid[p])}: refcount {int(mgr.ref[p])}, referenced "
                         f"{int(refs[p])} times", page=int(mgr.uid[p]))
                 for p in wrong[:20]]
    problems += _check_slots(store, live)
    problems += _check_pages(store, live)
    return problems


def _check_slots(store: StoreCore, live: np.ndarray) -> list[Problem]:
    mgr = store._mgr
    problems = []
    resident = live[mgr.slot[live] >= 0]
    if (mgr.slot_pid[mgr.slot[resident]] != resident).any():
        problems.append(Problem("slot_owner", "a resident page's slot names another page"))
    owners = np.flatnonzero(mgr.slot_pid >= 0)
    if len(owners) != len(resident):
        problems.append(Problem("slot_count", f"{len(owners)} slots are occupied but {len(resident)} pages "
                                "are resident"))
    free = mgr.free_slots
    if len(set(free)) != len(free):
        problems.append(Problem("free_list", "a slot is on the free list twice"))
    expected_free = set(np.flatnonzero((mgr.slot_pid < 0) & (mgr.slot_cpid < 0)).tolist())
    if set(free) != expected_free:
        problems.append(Problem("free_list", f"free list has {len(free)} slots, {len(expected_free)} are free"))
    pending_slots = np.flatnonzero(mgr.pending_at(slice(None)))
    pending = len(pending_slots)
    if not np.isin(pending_slots, mgr.pending_slots.rows()).all():
        problems.append(Problem("slot_count", "a slot holding only committed bytes is not noted for eviction"))
    if len(owners) + len(free) + pending != store.pool_pages:
        problems.append(Problem("slot_count", "used + free + pending slots do not add up to the pool size"))
    if (mgr.pins < 0).any():
        problems.append(Problem("pin_count", "a slot has a negative pin count"))
    if int(mgr.pins.sum()) != mgr.pin_refs:
        problems.append(Problem("pin_count", f"{int(mgr.pins.sum())} pins are held but {mgr.pin_refs} "
                                "are counted"))
    return problems


def _check_pages(store: StoreCore, live: np.ndarray) -> list[Problem]:
    mgr = store._mgr
    problems = []
    for pid in live.tolist():
        uid, slot = int(mgr.uid[pid]), int(mgr.slot[pid])
        if slot >= 0:
            if mgr.csum_ok[pid]:
                actual = page_checksum(mgr.pool[slot], int(mgr.fill[pid]), uid, mgr.seed)
                if actual != int(mgr.csum[pid]):
                    problems.append(Problem("pool_checksum", f"page {uid}: pool slot {slot} fails its checksum",
                                            page=uid))
        elif mgr.rec[pid] != REC_CURRENT:
            problems.append(Problem("missing_record", f"page {uid}: spilled without a current record", page=uid))
    spilled = live[mgr.slot[live] < 0]
    with mgr.spill.begin_read() as txn:
        for pid in spilled.tolist():
            uid = int(mgr.uid[pid])
            try:
                read_record(mgr, txn, pid)
            except PageCorrupt as exc:
                problems.append(Problem("record", str(exc), page=uid))
    # A read-only handle sees the records a crashed writer left uncommitted; the
    # next writer collects them, so they are not damage.
    if not store.readonly:
        problems += stray_problems(store)
    return problems


def stray_problems(store: StoreCore) -> list[Problem]:
    """``stray_records`` as problems of kind ``"stray_record"``."""
    return [Problem("stray_record", f"spill record {uid} belongs to no page", page=uid)
            for uid in stray_records(store)]


def stray_records(store: StoreCore) -> list[int]:
    """Uids of spill records no page owns (after a crash: left for the next writer to delete)."""
    mgr = store._mgr
    known = set(mgr.uid[np.flatnonzero(mgr.live)].tolist()) | {uid for uid, _ in mgr.doomed}
    known |= {int(mgr.uid[p]) for p in mgr.zombies}
    with mgr.spill.begin_read() as txn:
        keys = [key_uid(bytes(key)) for key in mgr.spill.iterate(txn, mgr.spill.pages, keys_only=True)]
    return [uid for uid in keys if uid not in known]
