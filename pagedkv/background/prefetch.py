"""Prefetch: restore the spilled pages of sequences in a background thread.

Records are fetched, decoded and verified off the store lock (LMDB readers run
beside the writer); only placing a verified page into a free slot takes the
lock, and only if the page is still spilled and unchanged since the fetch began.
A step that needs a page still in flight simply restores it itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Iterable

import numpy as np

from ..errors import PageCorrupt, PoolExhausted
from ..pages.directory import REC_CURRENT
from ..pages.sequence import SeqId
from ..pages.restore import fetch_record
from .host import BackgroundHost

_CHUNK = 16  # pages fetched per read transaction between two takes of the lock
log = logging.getLogger(__name__)


class Prefetch:
    """Handle of one ``KVStore.prefetch`` request."""

    def __init__(self, seq_ids: list[SeqId], done: threading.Event) -> None:
        self.seq_ids = seq_ids
        self.pages = 0  # pages this request restored ahead of use
        self.error: BaseException | None = None  # why it stopped early, if it did
        self._done = done  # set by the prefetcher, which keeps its own reference to it

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the prefetch finished (True) or ``timeout`` seconds passed (False)."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """Whether the prefetch has finished."""
        return self._done.is_set()


class Prefetcher:
    """One daemon thread per store, started on the first request."""

    def __init__(self, host: BackgroundHost) -> None:
        # The handle's background surface is all this thread keeps of it; the host holds
        # the handle weakly, so the thread keeps no released handle alive.
        self._host = host
        self._jobs: queue.Queue[tuple[Prefetch, threading.Event] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, seq_ids: Iterable[SeqId]) -> Prefetch:
        """Queue a prefetch of ``seq_ids`` and return its handle at once."""
        done = threading.Event()
        job = Prefetch(list(seq_ids), done)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedkv-prefetch", daemon=True)
            self._thread.start()
        self._jobs.put((job, done))
        return job

    def stop(self) -> None:
        """Finish the queued work's current chunk and end the thread (call without the store lock)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            try:
                self._prefetch(job)
            except BaseException as exc:  # reported through the handle, never lost in a thread
                job.error = exc
                if isinstance(exc, PageCorrupt):  # a step reading the page raises it again
                    log.warning("prefetch of %s stopped: %s", job.seq_ids, exc)
                else:
                    log.error("prefetch of %s failed", job.seq_ids, exc_info=exc)
            finally:
                done.set()

    def _prefetch(self, job: Prefetch) -> None:
        host = self._host
        with host.lock:
            if host.closed or host.readonly:
                return
            mgr = host.manager
            tables = host.tables(job.seq_ids)
            pids = np.unique(np.concatenate(tables)) if tables else np.empty(0, np.int64)
            pids = pids[mgr.slot[pids] < 0]
            wanted = [(int(pid), int(mgr.uid[pid]), int(mgr.fill[pid]), int(mgr.csum[pid]))
                      for pid in pids.tolist()]
        for start in range(0, len(wanted), _CHUNK):
            staged = self._fetch(wanted[start:start + _CHUNK])
            with host.lock:
                if host.closed:
                    return
                if not self._place(job, staged):
                    return

    def _fetch(self, chunk: list[tuple[int, int, int, int]]) -> list[tuple[Any, ...]]:
        mgr, staged = self._host.manager, []
        with self._host.read_transaction() as txn:
            for pid, uid, fill, csum in chunk:
                started = time.perf_counter()
                page, nbytes = fetch_record(mgr, txn, uid, fill, csum)
                staged.append((pid, uid, fill, csum, page.copy(), nbytes, time.perf_counter() - started))
        return staged

    def _place(self, job: Prefetch, staged: list[tuple[Any, ...]]) -> bool:
        """Put fetched pages that are still spilled and unchanged into free slots."""
        host = self._host
        mgr = host.manager
        for pid, uid, fill, csum, page, nbytes, seconds in staged:
            if not (mgr.live[pid] and int(mgr.uid[pid]) == uid and mgr.slot[pid] < 0
                    and int(mgr.fill[pid]) == fill and int(mgr.csum[pid]) == csum
                    and mgr.rec[pid] == REC_CURRENT):
                continue  # restored, changed or freed meanwhile
            try:
                slot = mgr.take_slots(1)[0]
            except PoolExhausted:
                return False  # every slot pinned: the steps that run now need the pool
            mgr.pool[slot] = page
            host.place(pid, slot)
            job.pages += 1
            mgr.stats.add("prefetch_restores")
            mgr.stats.add("bytes_restored", nbytes)
            mgr.stats.restore_latency(seconds)
        return True

