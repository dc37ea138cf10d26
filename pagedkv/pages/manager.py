"""The block manager: allocation, references, copy-on-write and residency of pages.

Its verbs are what the store level calls: ``new_page``/``new_pages``,
``copy_page``, ``incref``/``decref``, ``take_slots``, ``ensure_resident`` and
``evict``; the state they change is the page table's (``table.py``), eviction
and restore are ``evict.py`` and ``restore.py``.
"""

from __future__ import annotations

import logging

import numpy as np

from ..errors import PageCorrupt
from . import evict as evict_mod
from .directory import CODEC_SHIFT, HAS_TOKENS, HASHED, NOWHERE, ONE, REC_CURRENT, REC_NONE, REC_STALE, SPILLED
from .restore import restore
from .table import PageTable

log = logging.getLogger(__name__)
_FEW = 16  # pages a restore deduplicates with Python sets rather than np.unique

__all__ = ["BlockManager", "CODEC_SHIFT", "HAS_TOKENS", "HASHED", "NOWHERE", "REC_CURRENT",
           "REC_NONE", "REC_STALE", "SPILLED"]


class BlockManager(PageTable):
    """Owns every page: where it lives, who references it, and when it is evicted."""

    # -- allocation --------------------------------------------------------
    def new_page(self) -> int:
        """A fresh, empty, resident page with refcount 1."""
        slot = self.take_slots(1)[0]
        pid = self._new_pid(self.next_uid)
        self.next_uid += 1
        self.ref[pid] = 1
        self.refs_moved.add(pid)
        self.place(pid, slot)
        self.mark_written(pid, 0)
        self.stats.add("pages_allocated")
        return pid

    def new_pages(self, fills: np.ndarray) -> np.ndarray:
        """Fresh resident pages with refcount 1, already holding ``fills`` tokens each.

        ``new_page`` for a batch: one slot grab, one reset per column. The caller
        writes the pages' bytes.
        """
        count = len(fills)
        slots = np.array(self.take_slots(count), np.int64)
        pids = self._new_pids(count)
        self.ref[pids] = 1
        self.note_refs(pids)
        self.slot[pids] = slots
        self.slot_pid[slots] = pids
        self.touch(slots)
        self.fill[pids] = fills
        self.gen[pids] = 1
        self.csum_ok[pids] = False
        self.note_changed_many(pids)
        self.dirty.add_many(slots)
        self.page_tokens.drop_many(pids.tolist())
        self.stats.add("pages_allocated", count)
        return pids

    def start_tokens(self, pids: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The first token id of each of ``pids`` (new pages holding one token each); their slab rows."""
        rows = self.page_tokens.start_one_each(pids.tolist(), ids)
        self.flags[pids] |= HAS_TOKENS
        self.tokens_seen = True
        return rows

    def copy_page(self, src: int) -> int:
        """Copy-on-write: a new private page holding ``src``'s tokens."""
        self.ensure_resident(np.array([src]))
        self.pin_slot(self.slot.item(src))
        try:
            dst = self.new_page()
        finally:
            self.unpin_slot(self.slot.item(src))
        self.verify(src)
        self.pool[self.slot[dst]] = self.pool[self.slot[src]]
        self.mark_written(dst, int(self.fill[src]))
        if self.flags[src] & HAS_TOKENS:
            self.flags[dst] |= HAS_TOKENS
            tokens = self.page_tokens_of(src)
            if tokens is not None:  # always, for a page whose ids are known
                self.page_tokens.set(dst, tokens)
        self.stats.add("cow_copies")
        return dst

    def incref(self, pids: np.ndarray) -> None:
        """One more reference to each of ``pids`` (duplicates count)."""
        np.add.at(self.ref, pids, ONE)
        self.note_refs(pids)

    def decref(self, pids: np.ndarray) -> None:
        """Drop a reference to each of ``pids``; pages reaching zero are freed."""
        np.subtract.at(self.ref, pids, ONE)
        self.note_refs(pids)
        for pid in np.unique(pids[self.ref[pids] <= 0]).tolist():
            self._free(pid)

    def collect_unreferenced(self) -> None:
        """Free every live page no block table references (after a load): indexed cache pages stay."""
        for pid in np.flatnonzero(self.live & (self.ref == 0)).tolist():
            self._free(pid)

    def _free(self, pid: int) -> None:
        if self.flags[pid] & HASHED:
            # Kept as cache (evictable like any page, found again by its hash), unless
            # an equal page of its chain class is indexed: that one serves its prefix.
            if self.prefix.holds(bytes(self.hash[pid]), pid) and self.prefix.equal_page(pid, self) < 0:
                return
            self.prefix.discard(bytes(self.hash[pid]), pid)
        slot = int(self.slot[pid])
        if slot >= 0:
            self.slot_pid[slot] = -1
            self.slot[pid] = -1
            # A slot write-behind is reading from is handed back when its batch lands.
            if self.slot_cpid[slot] >= 0:
                self.pending_slots.add(slot)
            elif self.bg_pins[slot] == 0:
                self.free_slots.append(slot)
        self.chg[pid] = False
        self.page_tokens.drop(pid)
        if self.c_where[pid] != NOWHERE:
            self.zombies.append(pid)  # the commit that forgets it also frees its row
            self.live[pid] = False
            return
        if self.rec[pid] != REC_NONE:
            self.doomed.append((int(self.uid[pid]), int(self.rec_bytes[pid])))
        self._recycle(pid)

    # -- residency -----------------------------------------------------------
    def take_slots(self, count: int) -> list[int]:
        """``count`` free slots, evicting least-recently-used pages in batches as needed."""
        return evict_mod.take_slots(self, count)

    def ensure_resident(self, pids: np.ndarray) -> np.ndarray:
        """Restore any of ``pids`` that are spilled; return their slots.

        The resident ones are pinned while the others are restored, so a restore
        never evicts a page of the same request; pinning afterwards is the caller's.
        """
        slots = self.slot[pids]
        held: np.ndarray | list[int]
        if len(pids) <= _FEW:  # a step's few pages, sorted out in Python: each numpy call costs more
            here = slots.tolist()
            gone = [pid for pid, slot in zip(pids.tolist(), here) if slot < 0]
            nmissing = len(gone)
            if nmissing:
                held = [slot for slot in here if slot >= 0]
                wanted = np.array(sorted(set(gone)), np.int64)
        else:
            missing = slots < 0
            nmissing = int(np.count_nonzero(missing))
            if nmissing:
                held, wanted = slots[~missing], np.unique(pids[missing])
        self.stats.counts["resident_hits"] += len(pids) - nmissing
        if nmissing:
            if len(held):
                self.pin(held)
            known = self.corrupt[wanted]
            try:
                restore(self, wanted)
            except PageCorrupt:
                for pid in wanted[self.corrupt[wanted] & ~known].tolist():  # said once per page
                    log.warning("page %d: its spill record fails its checksum (or is missing); the page "
                                "is unreadable until it is rewritten", int(self.uid[pid]))
                raise
            finally:
                if len(held):
                    self.unpin(held)
            slots = self.slot[pids]
        self.touch(slots)
        resident: np.ndarray = slots
        return resident

    def evict(self, count: int, need: int | None = None) -> int:
        """Spill up to ``count`` LRU unpinned slots in one transaction; return how many were freed."""
        return evict_mod.evict(self, count, need)

