"""Write-behind eviction: a background thread keeps free slots ready.

When free slots fall below a low-water mark, the thread takes a batch of least
recently used pages (pinning them), and off the store lock checksums and encodes
them and writes their records in one synced LMDB transaction; then, under the
lock, frees the slots of pages that did not change meanwhile. ``append`` and
``step()`` therefore wait for spill I/O only when the pool is truly out of free
slots (they then evict synchronously, as without this thread).

Safety rests on two facts. The bytes of a resident page's first ``fill`` tokens
never change while it lives, so they can be read off the lock. And inside its
transaction the thread re-reads each page's committed directory entry and
updates it only if it is still the one it saw, so a commit landing in between
is never overwritten with older placement.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..storage.codec import encode_spill, page_checksum
from ..pages import evict
from ..pages.directory import CODEC_SHIFT, NOWHERE, ONE, REC_CURRENT, SPILLED
from ..pages.spillbatch import Spilled
from ..storage.metarecord import dir_value, read_dir_value
from ..storage.spill import uid_key
from ..storage.codecs import CODECS
from .host import BackgroundHost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Victim:
    """One page of a batch as the thread saw it under the store lock."""

    slot: int
    pid: int
    uid: int
    gen: int  # its write generation: landing compares it with the page's
    fill: int
    csum: int | None  # its checksum if known, else computed off the lock
    current: bool  # its spill record is already the page: nothing to write
    codec: int  # that record's codec, as its committed entry has it
    c_fill: int
    entry: bytes | None  # its committed directory entry (None: no commit recorded it)


@dataclass(frozen=True)
class _Encoded:
    """A victim encoded off the lock: its new record (if any) and what landing it means."""

    victim: _Victim
    record: bytearray | None
    spilled: Spilled


class WriteBehind:
    """The background evictor of one store."""

    def __init__(self, host: BackgroundHost) -> None:
        # The handle's background surface is all this thread keeps of it; the host holds
        # the handle weakly, so the thread keeps no released handle alive.
        self._host = host
        self.low_water = 0  # set by attach() once the manager exists
        self._wake = threading.Event()
        self._txn_done = threading.Event()
        # The batch whose transaction ended: its pinned slots, the pages it spilled, its failure.
        self._state: tuple[list[int], list[Spilled], BaseException | None] | None = None
        self.in_flight = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the thread stopped, if it failed

    def attach(self) -> None:
        """Start watching the manager's free slots (after the store has loaded)."""
        mgr = self._host.manager
        self.low_water = max(mgr.evict_batch, mgr.pool_pages // 8)
        mgr.on_take = self.kick
        mgr.wait_background = self.wait

    def kick(self) -> None:
        """Called with the store lock held after slots were taken."""
        if len(self._host.manager.free_slots) < self.low_water and self.error is None:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pagedkv-write-behind", daemon=True)
                self._thread.start()
            self._wake.set()

    def wait(self) -> None:
        """Land the batch in flight, if any (called with the store lock held).

        The store lock is never released here, so no operation is interrupted
        halfway: this waits only for the batch's transaction, which needs no store
        lock, and then applies the batch on the worker's behalf.
        """
        if self.in_flight:
            self._txn_done.wait()
            error = self._finish()
            if error is not None:
                raise error  # the foreground op fails as if it had done the I/O itself

    def _finish(self) -> BaseException | None:
        """Apply (or, after a failure, unpin) the batch once; under the store lock."""
        state, self._state = self._state, None
        if state is None:
            return None
        slots, landed, error = state
        host = self._host
        if error is not None or host.closed:
            np.subtract.at(host.manager.bg_pins, slots, ONE)
            if error is not None:  # poisoned like a failed foreground write
                self.error = error
                host.poison(f"write-behind: {error}")
                log.error("%s: a write-behind batch failed (%s); the handle is poisoned, the last "
                          "commit is intact", host.path, error)
        else:
            evict.land_background(host.manager, slots, landed)
        self.in_flight = False
        return error

    def stop(self) -> None:
        """End the thread after its current batch (call without the store lock)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait()
            self._wake.clear()
            try:
                while not self._stop and self._batch():
                    pass
            except BaseException as exc:  # an I/O failure poisons the handle, as in the foreground
                if exc is not self.error:  # a failed batch was logged as it landed
                    log.error("%s: the write-behind thread failed", self._host.path, exc_info=exc)
                self.error = exc
                self._host.poison(f"write-behind: {exc}")
                return

    def _batch(self) -> bool:
        """Spill one batch; return whether to continue (still below the low-water mark)."""
        host = self._host
        with host.lock:
            mgr = host.manager
            if host.closed or host.poisoned or len(mgr.free_slots) >= self.low_water:
                return False
            victims = self._choose()
            if not victims:
                return False
            self.in_flight = True
            self._txn_done.clear()
        slots = [v.slot for v in victims]
        landed: list[Spilled] = []
        error: BaseException | None = None
        try:
            landed = self._write(self._encode(victims))
        except BaseException as exc:
            error = exc
        finally:
            self._state = (slots, landed, error)
            self._txn_done.set()
        with host.lock:
            if self.in_flight and self._state is not None and self._state[0] is slots:
                self._finish()
        if error is not None:
            raise error
        return True

    def _choose(self) -> list[_Victim]:
        mgr = self._host.manager
        live = mgr.oldest.take(mgr.slot_pid, mgr.stamp, mgr.pins, mgr.bg_pins, mgr.evict_batch)
        if not len(live):
            return []
        victims = []
        for slot in live.tolist():
            pid = int(mgr.slot_pid[slot])
            mgr.bg_pins[slot] += 1  # not evicted under us; writes are still allowed
            victims.append(_Victim(
                slot=slot, pid=pid, uid=int(mgr.uid[pid]), gen=int(mgr.gen[pid]), fill=int(mgr.fill[pid]),
                csum=int(mgr.csum[pid]) if mgr.csum_ok[pid] else None,
                current=bool(mgr.rec[pid] == REC_CURRENT), codec=int(mgr.codec[pid]),
                c_fill=int(mgr.c_fill[pid]),
                entry=mgr.committed_entry(pid, int(mgr.c_where[pid])) if mgr.c_where[pid] != NOWHERE else None))
        return victims

    def _encode(self, victims: list[_Victim]) -> list[_Encoded]:
        """Checksums and records, off the lock (the committed prefix of each page is immutable)."""
        mgr = self._host.manager
        out = []
        for v in victims:
            page = mgr.pool[v.slot]
            csum = page_checksum(page, v.fill, v.uid, mgr.seed) if v.csum is None else v.csum
            record: bytearray | None = None
            nbytes, codec = -1, v.codec
            c_csum: int | None = None
            if not v.current:  # else its record is already the page
                record, used, decoded = encode_spill(mgr.geom, v.uid, v.fill, csum, page, mgr.spill_codec,
                                                     mgr.seed)
                nbytes, codec = len(record), CODECS.index(used)
                if decoded is not None:  # lossy: the page becomes its dequantised values
                    csum = page_checksum(decoded, v.fill, v.uid, mgr.seed)
                    if v.entry is not None:
                        c_csum = page_checksum(decoded, v.c_fill, v.uid, mgr.seed)
            spilled = Spilled(v.slot, v.pid, v.gen, nbytes, codec, v.entry is not None, v.uid, csum, c_csum)
            out.append(_Encoded(v, record, spilled))
        return out

    def _write(self, batch: list[_Encoded]) -> list[Spilled]:
        """One synced transaction; returns the pages it spilled."""
        mgr = self._host.manager
        landed: list[Spilled] = []

        def body(txn: Any) -> None:
            landed.clear()
            for item in batch:
                v = item.victim
                key = uid_key(v.uid)
                if v.entry is not None:
                    current = txn.get(key, db=mgr.spill.dir)
                    if current is None or bytes(current) != v.entry:
                        continue  # a commit moved on since: leave this page alone
                    mgr.spill.put(txn, mgr.spill.dir, key, _spilled_entry(key, v.entry, item.spilled, mgr.seed))
                if item.record is not None:
                    mgr.spill.put(txn, mgr.spill.pages, key, item.record)
                landed.append(item.spilled)

        self._host.write_transaction(body, "write-behind")
        return landed


def _spilled_entry(key: bytes, entry: bytes, spilled: Spilled, seed: int) -> bytes:
    """The committed entry with placement SPILLED (and a new record's codec and lossy checksum)."""
    where, fill, csum, flags, digest, parent, chain = read_dir_value(key, entry, seed)
    flags = flags & ((1 << CODEC_SHIFT) - 1) | spilled.codec << CODEC_SHIFT
    csum = csum if spilled.c_csum is None else spilled.c_csum
    return dir_value(key, SPILLED, fill, csum, flags, digest, parent, chain, seed)
