"""The page table: the directory plus the pool slots, and what every page operation reads or records.

The directory (``directory.py``) is a set of numpy columns indexed by a dense,
recycled row id (``pid``); a page's public identity is its ``uid``. Two views of
placement are kept: the live one (``slot``) and the committed one
(``c_where``: what the last LMDB transaction says). A slot is reusable only when
neither view references it, which is what keeps committed bytes from being
overwritten before a commit has moved them (see ``persist.py`` for the commit).

``PageTable`` holds that state and the bookkeeping every page operation shares
(placement, write marks, checksums, verification). Eviction (``evict.py``) and
restore (``restore.py``) work on a ``PageTable``; the block manager
(``manager.py``) builds allocation and residency on all three.
"""

from __future__ import annotations

import logging
from array import array
from typing import Callable

import numpy as np

from ..counters import Stats
from ..errors import PageCorrupt
from ..geometry import Geometry
from ..storage.codec import page_checksum
from ..storage.metarecord import TAG_TOKENS, dir_value, unseal
from ..storage.pool import PagePool
from ..storage.spill import SpillStore, uid_key
from .directory import CODEC_SHIFT, HAS_TOKENS, HASHED, NOWHERE, ONE, REC_CURRENT, REC_NONE, REC_STALE, Directory
from .lrulog import StampLog
from .pending import PendingRows
from .pins import SlotPins
from .prefix import PrefixIndex
from .tokens import PageTokens
from .victims import OldestSlots

log = logging.getLogger(__name__)

__all__ = ["PageTable"]


class PageTable(Directory, SlotPins):
    """Every page's state: directory columns, pool slots, LRU stamps, pins and spill bookkeeping."""

    def __init__(self, geom: Geometry, pool: PagePool, spill: SpillStore, seed: int,
                 sync: bool, evict_batch: int, stats: Stats, salt: bytes,
                 spill_limit: int | None = None, spill_codec: str = "raw") -> None:
        self.geom = geom
        self.pool = pool.array  # the pool file's pages, one per slot: pool[slot]
        self.pool_file = pool
        self.spill = spill
        self.seed = seed  # the store's: every checksum and seal is bound to it
        self.sync = sync  # durability="durable": pool slots are flushed before a commit names them
        self.stats = stats
        self.pool_pages = pool.pool_pages  # slots
        # A batch amortises one synced transaction over many pages, but never empties
        # a small pool in one go.
        self.evict_batch = max(1, min(evict_batch, self.pool_pages // 4))
        self.tick = 0  # the LRU clock: bumped per use, stamps are its values
        self._init_directory(max(64, self.pool_pages), geom.page_size)
        # Per slot. A slot is free only when neither the live view (slot_pid) nor the
        # committed one (slot_cpid) holds it.
        self.slot_pid = np.full(self.pool_pages, -1, np.int64)  # the page resident there now (-1: none)
        self.slot_cpid = np.full(self.pool_pages, -1, np.int64)  # the page whose committed bytes it holds
        self.stamp = np.zeros(self.pool_pages, np.int64)  # tick of its last use (LRU; committed by lrulog)
        self.oldest = OldestSlots()  # eviction's view of the stamps: the least recently used slots, in order
        # Slots stamped since the last commit, which writes their stamps as one delta of the log.
        self.stamped = PendingRows(lambda rows: rows)
        self.stamp_log = StampLog()  # the committed base and deltas
        self._init_pins(self.pool_pages)
        self.free_slots: list[int] = list(range(self.pool_pages - 1, -1, -1))  # taken from the end
        # Slots written since the last commit (what a durable commit flushes), noted as they are
        # written: a commit then costs the slots it flushes, not the pool.
        self.dirty = PendingRows(lambda rows: rows)
        # Slots that hold only a freed page's committed bytes until a commit forgets it (the
        # first victims), noted as pages are freed: eviction then need not scan the pool for them.
        self.pending_slots = PendingRows(lambda rows: rows[self.pending_at(rows)])
        # Rows the next commit visits, so that it costs what changed rather than the directory:
        # every row set in chg is noted in `changed`, every row whose ref moved in `refs_moved`.
        self.changed = PendingRows(lambda rows: rows[self.chg[rows]])
        self.refs_moved = PendingRows(lambda rows: rows[self.ref[rows] != self.c_ref[rows]])
        self.evict_epoch = 0  # bumped whenever resident pages leave the pool
        self.zombies: list[int] = []  # rows of freed pages the last commit still records (freed by the next)
        self.doomed: list[tuple[int, int]] = []  # (uid, bytes) of uncommitted records to delete
        self.prefix = PrefixIndex(salt, geom.page_size)  # hashed pages by chained hash
        self.page_tokens = PageTokens(geom.page_size)  # token ids not yet committed (or partial)
        self.tokens_seen = False  # whether any page was ever given token ids (HAS_TOKENS)
        self.spill_bytes = 0  # bytes of page records in LMDB
        self.spill_limit = spill_limit  # cap on spill_bytes (None: none)
        self.spill_codec = spill_codec  # codec of new spill records
        self.on_take: Callable[[], None] | None = None  # write-behind's low-water check
        self.on_seal: Callable[[int, int], None] | None = None  # the remote tier: (page, parent) just hashed
        # Write-behind's batch in flight: its pins, and a wait for it to land. Every
        # foreground LMDB write waits first, so no commit falls between its steps.
        self.bg_pins = np.zeros(self.pool_pages, np.int32)  # per slot, like pins
        self.wait_background: Callable[[], None] | None = None
        self.sealed = True  # committed metadata carries checksums (false while format 1 loads)
        self.pool_exposed = False  # whether store.pool was handed out (anyone may write it since)

    # -- bookkeeping of writes and placement --------------------------------
    def place(self, pid: int, slot: int) -> None:
        """Record that page ``pid`` now lives in ``slot`` (a free slot its bytes were written into).

        The slot counts as just used (LRU) and as written since the last commit,
        which flushes it and records the page's new placement.
        """
        self.slot[pid] = slot
        self.slot_pid[slot] = pid
        self.stamp_one(slot)
        self.note_changed(pid)
        self.dirty.add(slot)

    def mark_written(self, pid: int, fill: int) -> None:
        """Record that ``pid``'s bytes changed and now hold ``fill`` tokens."""
        self.fill[pid] = fill
        self.gen[pid] += 1
        self.csum_ok[pid] = False
        if self.rec[pid] == REC_CURRENT:
            self.rec[pid] = REC_STALE
        self.note_changed(pid)
        self.dirty.add(self.slot.item(pid))

    def mark_written_many(self, pids: np.ndarray, fills: np.ndarray) -> None:
        """``mark_written`` for many distinct resident pages at once."""
        self.fill[pids] = fills
        self.gen[pids] += 1
        self.csum_ok[pids] = False
        rec = self.rec[pids]
        self.rec[pids] = np.where(rec == REC_CURRENT, REC_STALE, rec)
        self.note_changed_many(pids)
        self.dirty.add_many(self.slot[pids])

    def note_changed(self, pid: int) -> None:
        """Have the next commit rewrite ``pid``'s directory entry."""
        self.chg[pid] = True
        self.changed.add(pid)

    def note_changed_many(self, pids: np.ndarray) -> None:
        """``note_changed`` for each row of ``pids``."""
        self.chg[pids] = True
        self.changed.add_many(pids)

    def note_refs(self, pids: np.ndarray) -> None:
        """Record that the refcounts of ``pids`` moved (the next commit copies them to ``c_ref``)."""
        self.refs_moved.add_many(pids)

    # -- residency -----------------------------------------------------------
    def touch(self, slots: np.ndarray) -> None:
        """Mark ``slots`` as used now (one tick for the whole call)."""
        self.tick += 1
        self.stamp[slots] = self.tick
        self.stamped.add_many(slots)

    def stamp_one(self, slot: int) -> None:
        """Mark one slot as used now (``touch`` without an array)."""
        self.tick = tick = self.tick + 1
        self.stamp[slot] = tick
        self.stamped.add(slot)

    def settle_stamps(self, log: StampLog) -> None:
        """A commit made ``log`` the committed stamp log: nothing is stamped since."""
        self.stamp_log = log
        self.stamped.clear()

    def pending_at(self, slots: np.ndarray | slice) -> np.ndarray:
        """For each of ``slots``: whether it holds only a freed page's committed bytes (until a commit)."""
        pending: np.ndarray = (self.slot_pid[slots] < 0) & (self.slot_cpid[slots] >= 0)
        return pending

    def droppable(self) -> np.ndarray:
        """Cache-only pages that no sequence, committed or live, references and no step pins."""
        rows = np.flatnonzero(self.live & (self.ref == 0) & (self.c_ref == 0))
        resident = self.slot[rows] >= 0
        pinned = np.zeros(len(rows), bool)
        pinned[resident] = self.pins[self.slot[rows[resident]]] > 0
        droppable: np.ndarray = rows[~pinned]
        return droppable

    def cache_bytes(self) -> int:
        """Record bytes of cache-only pages (refcount 0), droppable or not."""
        rows = np.flatnonzero(self.live & (self.ref == 0) & (self.rec != REC_NONE))
        return int(self.rec_bytes[rows].sum())

    def last_use(self, pid: int) -> int:
        """The tick of a page's last use (its slot's stamp, or the stamp it was spilled with)."""
        slot = int(self.slot[pid])
        return int(self.stamp[slot]) if slot >= 0 else int(self.pstamp[pid])

    def forget(self, pid: int) -> None:
        """Remove a dropped cache page from memory (its LMDB entries are already gone)."""
        self.prefix.discard(bytes(self.hash[pid]), pid)
        slot = int(self.slot[pid])
        if slot >= 0:
            self.slot_pid[slot] = -1
            if self.slot_cpid[slot] == pid:
                self.slot_cpid[slot] = -1
            self.free_slots.append(slot)
            self.slot[pid] = -1
        self.spill_bytes -= int(self.rec_bytes[pid])
        self.chg[pid] = False
        self.page_tokens.drop(pid)
        self._recycle(pid)

    def page_tokens_of(self, pid: int) -> np.ndarray | None:
        """A page's token ids: from memory, else from the committed tokens table.

        A committed list that fails its checksum (or is malformed) counts as
        unknown, so it can never confirm a prefix hit.
        """
        token_ids = self.page_tokens.get(pid)
        if token_ids is None and self.flags[pid] & HAS_TOKENS:
            key = uid_key(int(self.uid[pid]))
            with self.spill.begin_read() as txn:
                raw = txn.get(key, db=self.spill.tokens)
                body = None if raw is None else self.token_body(key, raw)
            if body is not None and len(body) % 4 == 0 and len(body) <= 4 * self.geom.page_size:
                token_ids = np.frombuffer(body, dtype="<u4")
        return token_ids

    def token_body(self, key: bytes, raw: bytes | memoryview) -> bytes | None:
        """The token ids of a committed tokens value, or None if it fails its checksum."""
        return unseal(TAG_TOKENS, key, raw, self.seed) if self.sealed else bytes(raw)

    def committed_entry(self, pid: int, where: int, csum: int | None = None,
                        codec: int | None = None) -> bytes:
        """Directory value of ``pid``'s committed state at a new placement (and record codec)."""
        codec = int(self.codec[pid]) if codec is None else codec
        return dir_value(uid_key(int(self.uid[pid])), where, int(self.c_fill[pid]),
                         int(self.c_csum[pid]) if csum is None else csum,
                         int(self.c_flags[pid]) | codec << CODEC_SHIFT, bytes(self.hash[pid]),
                         int(self.parent[pid]), int(self.chain[pid]), self.seed)

    # -- token ids and hashes -------------------------------------------------
    def know_ids(self, pid: int) -> None:
        """Every id of ``pid``'s tokens is known (held in ``page_tokens`` or committed)."""
        self.flags[pid] |= HAS_TOKENS
        self.tokens_seen = True

    def forget_ids(self, pid: int) -> None:
        """``pid``'s token ids are no longer all known: the page can no longer be hashed."""
        self.flags[pid] = int(self.flags[pid]) & ~HAS_TOKENS
        self.page_tokens.drop(pid)

    def hash_page(self, pid: int, digest: bytes, parent_class: int, token_ids: np.ndarray) -> None:
        """``pid`` (full, its ids known) has the chained hash ``digest`` after chain class
        ``parent_class``: index it and give it the chain class of an equal page, or its own."""
        self.hash[pid] = digest  # before the index holds it: a rebuild reads every held row's hash
        chain = self.prefix.insert(digest, pid, parent_class, token_ids, self) or self.uid.item(pid)
        self.parent[pid] = parent_class
        self.chain[pid] = chain
        self.flags[pid] |= HASHED
        self.note_changed(pid)

    # -- the committed state ------------------------------------------------
    def load_committed(self, uids: np.ndarray, rows: np.ndarray, record_bytes: list[int],
                       spill_bytes: int, stamps: np.ndarray | None, next_uid: int, tick: int) -> None:
        """Become the state a commit recorded: directory ``rows`` (checked) of pages ``uids``.

        Rows take the directory's first rows in key order; a resident page's slot is
        both its live and its committed placement, a spilled one has a current
        record of ``record_bytes``; ``stamps`` are the slots' LRU stamps as committed.
        """
        count = len(uids)
        if self._cap < count + 1:
            self._grow(count + max(64, count // 8))
        self.free_pids = array("q", range(self._cap - 1, count - 1, -1))
        self._freed = array("q")
        pids = np.arange(count)
        where = rows["where"].astype(np.int32)
        fill = rows["fill"].astype(np.int64)
        resident = where >= 0
        self.uid[:count] = uids
        self.live[:count] = True
        self.c_where[:count] = where
        self.slot[:count] = np.where(resident, where, -1)
        self.fill[:count] = self.c_fill[:count] = fill
        self.csum[:count] = self.c_csum[:count] = rows["csum"]
        self.csum_ok[:count] = True
        self.verified[:count] = ~resident  # resident bytes are checked on first use
        self.rec[:count] = np.where(resident, REC_NONE, REC_CURRENT)
        flags = rows["flags"]
        self.flags[:count] = self.c_flags[:count] = flags & ((1 << CODEC_SHIFT) - 1)
        self.codec[:count] = (flags >> CODEC_SHIFT) & 3
        self.tokens_seen = bool((flags & HAS_TOKENS).any())
        if (flags & HASHED).any() or rows["parent"].any():
            self.track_hashes()
            self.hash[:count] = rows["hash"]
            self.parent[:count] = rows["parent"]
            self.chain[:count] = rows["chain"]
        self.rec_bytes[:count] = record_bytes
        self.spill_bytes = spill_bytes
        self.prefix.add_many(np.flatnonzero(flags & HASHED), self.hash)
        self.slot_pid[where[resident]] = pids[resident]
        self.slot_cpid[where[resident]] = pids[resident]
        if stamps is not None:
            self.stamp[:] = stamps
        self.oldest.reset()
        self.free_slots = np.flatnonzero(self.slot_pid < 0)[::-1].tolist()
        self.next_uid = next_uid
        self.tick = max(tick, int(self.stamp.max()))

    def set_references(self, pids: np.ndarray) -> None:
        """The committed block tables reference ``pids`` (duplicates count): live and committed refcounts."""
        self.ref[:] = 0
        np.add.at(self.ref, pids, ONE)
        self.c_ref[:] = self.ref

    def settle_commit(self, noted: np.ndarray, pids: np.ndarray, where: np.ndarray, zombies: np.ndarray,
                      gone: np.ndarray) -> None:
        """Make the state a commit just wrote the committed view (``persist.commit``, after LMDB returned).

        ``noted`` are the rows noted changed, ``pids`` those of them written, at
        placements ``where``; ``zombies`` are freed pages the commit forgot, ``gone``
        the pages whose records it deleted. Slots whose committed page moved away
        join the free list here; every other slot's standing is unchanged by a
        commit, so the list need not be rebuilt.
        """
        if len(gone) or self.doomed:  # a decode step's commit deletes no record
            self.spill_bytes -= int(self.rec_bytes[gone].sum()) + sum(nbytes for _, nbytes in self.doomed)
            self.rec_bytes[gone] = 0
            self.rec[gone] = REC_NONE
        moved = np.concatenate([pids, zombies]) if len(zombies) else pids
        old = self.c_where[moved]
        held = old >= 0
        slots = old[held]
        clear = slots[self.slot_cpid[slots] == moved[held]]
        self.slot_cpid[clear] = -1
        self.c_where[pids], self.c_fill[pids], self.c_csum[pids] = where, self.fill[pids], self.csum[pids]
        self.c_flags[pids] = self.flags[pids]
        resident = where >= 0
        self.slot_cpid[where[resident]] = pids[resident]
        if self.page_tokens:  # token ids of full pages now live in the tokens table
            self.page_tokens.drop_many(pids[self.fill[pids] == self.geom.page_size].tolist())
        if len(zombies):
            self.c_where[zombies] = NOWHERE
            for pid in zombies.tolist():
                self._recycle(pid)
        moved_refs = self.refs_moved.rows()
        self.c_ref[moved_refs] = self.ref[moved_refs]
        if len(clear):
            freed = clear[(self.slot_pid[clear] < 0) & (self.slot_cpid[clear] < 0) & (self.bg_pins[clear] == 0)]
            self.free_slots.extend(freed.tolist())
        self.chg[noted] = False
        self.changed.clear()
        self.refs_moved.clear()
        self.dirty.clear()
        self.pending_slots.retain()
        self.zombies = []
        self.doomed = []

    # -- integrity -----------------------------------------------------------
    def checksum(self, pid: int) -> int:
        """The checksum of ``pid``'s current content (computed if it changed)."""
        if not self.csum_ok[pid]:
            self.csum[pid] = page_checksum(self.pool[self.slot[pid]], int(self.fill[pid]),
                                           int(self.uid[pid]), self.seed)
            self.csum_ok[pid] = True
        return int(self.csum[pid])

    def verify(self, pid: int) -> None:
        """Check a resident page against its committed checksum once after reopen."""
        if self.corrupt[pid]:
            raise PageCorrupt(f"page {int(self.uid[pid])} is corrupt", int(self.uid[pid]))
        if self.verified[pid]:
            return
        actual = page_checksum(self.pool[self.slot[pid]], int(self.fill[pid]),
                               int(self.uid[pid]), self.seed)
        if actual != int(self.csum[pid]):
            self.corrupt[pid] = True
            self.stats.add("misses")
            log.warning("page %d: pool slot %d fails its checksum", int(self.uid[pid]), int(self.slot[pid]))
            raise PageCorrupt(f"page {int(self.uid[pid])}: pool slot {int(self.slot[pid])} "
                              "fails its checksum", int(self.uid[pid]))
        self.verified[pid] = True

    def stable_copy(self, pid: int) -> np.ndarray:
        """A verified copy of a resident page, checked every time.

        For read-only handles: a live writer may reuse the slot at any moment, so
        the bytes are copied first and the copy is what gets checked and returned.
        """
        uid = int(self.uid[pid])
        if self.corrupt[pid]:
            raise PageCorrupt(f"page {uid} is corrupt", uid)
        page: np.ndarray = self.pool[self.slot[pid]].copy()
        if page_checksum(page, int(self.fill[pid]), uid, self.seed) != int(self.csum[pid]):
            raise PageCorrupt(f"page {uid}: pool slot {int(self.slot[pid])} fails its checksum "
                              "(damaged, or reused by a live writer since this handle opened)", uid)
        return page

    def verify_committed(self, pids: np.ndarray) -> None:
        """Check the committed tokens of resident pages ``pids`` against their committed checksum.

        Done on every read, not once, once ``store.pool`` was handed out: it is the
        engine's to write, and a write through a stale slot mapping lands in
        whatever page holds that slot now. A handle whose pool no one outside
        pagedkv holds skips it. Tokens written since the last commit have no
        checksum yet.
        """
        if not self.pool_exposed:
            return
        for pid in pids[self.c_where[pids] != NOWHERE].tolist():
            fill, uid = int(self.c_fill[pid]), int(self.uid[pid])
            if fill and page_checksum(self.pool[self.slot[pid]], fill, uid, self.seed) != int(self.c_csum[pid]):
                self.corrupt[pid] = True
                self.stats.add("misses")
                log.warning("page %d: pool slot %d no longer holds its committed bytes (a checksum "
                            "failure: written outside its step?)", uid, int(self.slot[pid]))
                raise PageCorrupt(f"page {uid}: pool slot {int(self.slot[pid])} no longer holds its "
                                  "committed bytes (written outside its step?)", uid)

    def verify_many(self, pids: np.ndarray) -> None:
        """``verify`` each page that has not been verified since reopen."""
        for pid in pids[~self.verified[pids]].tolist():
            self.verify(pid)

