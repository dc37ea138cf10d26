"""The connector's writer thread: staged saves appended to the store, one commit per batch of steps.

The worker copies a step's saved blocks out of vLLM's caches (memory only) and
submits them here; this thread appends to the store the pages it lacks, through
a short-lived sequence created with the request's token ids (so pages the store
holds are shared, not written again), then commits once for every batch it took.
Appends and commits take the store's lock; the forward pass never waits on them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import PagedKVError, StoreFull
from ...geometry import Geometry
from ...store import KVStore
from .meta import PageJob
from .shared import log

__all__ = ["Staged", "SaveWriter", "job_tokens"]


@dataclass
class Staged:
    """A save job with its pages copied out of vLLM's blocks."""

    job: PageJob
    k: np.ndarray  # (layers, pages, page_size, kv_heads, head_dim)
    v: np.ndarray


def job_tokens(job: PageJob) -> np.ndarray:
    """The store's token ids of a job: its namespace page's ids (if any), then the request's."""
    ids = np.asarray(job.token_ids, np.uint32)
    if job.namespace is None:
        return ids
    return np.concatenate([np.asarray(job.namespace, np.uint32), ids])


class SaveWriter:
    """The thread that lands staged saves in the store.

    Params:
        store: the writer handle.
        geometry: its geometry.
        count: ``count(name, amount)`` adds to the connector's counters.
        drop: called with each job that could not be saved.
        seq_id: a fresh id for a short-lived sequence, given its kind.
    """

    def __init__(self, store: KVStore, geometry: Geometry, count: Callable[..., None],
                 drop: Callable[[PageJob], None], seq_id: Callable[[str], str]) -> None:
        self.store, self.geometry = store, geometry
        self._count, self._drop, self._seq_id = count, drop, seq_id
        self._cond = threading.Condition()
        self._queue: list[list[Staged]] = []
        self._queued_bytes = 0
        self._enqueued = self._applied = self._committed = 0  # batches queued / appended / committed
        self._stopping = False
        self._thread = threading.Thread(target=self._write_loop, name="pagedkv-vllm-writer", daemon=True)
        self._thread.start()

    def room(self, nbytes: int, limit: int) -> bool:
        """Whether ``nbytes`` more staged bytes stay within ``limit`` (and the writer still runs)."""
        with self._cond:
            return not self._stopping and self._queued_bytes + nbytes <= limit

    def submit(self, batch: list[Staged]) -> None:
        """Queue one step's staged saves."""
        with self._cond:
            self._queue.append(batch)
            self._queued_bytes += sum(staged.k.nbytes + staged.v.nbytes for staged in batch)
            self._enqueued += 1
            self._cond.notify_all()

    def wait_appended(self) -> None:
        """Until every batch queued so far is appended (a load may need its pages)."""
        self._wait(lambda: self._applied)

    def wait_committed(self) -> None:
        """Until every batch queued so far is appended and committed."""
        self._wait(lambda: self._committed)

    def _wait(self, done: Callable[[], int]) -> None:
        with self._cond:
            target = self._enqueued
            while done() < target and self._thread.is_alive():
                self._cond.wait()

    def stop(self) -> None:
        """Land what is queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _write_loop(self) -> None:
        """The writer thread: append staged saves, then commit once for everything taken."""
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue and self._stopping:
                    return
                batches, self._queue = self._queue, []
            started = time.perf_counter()
            for batch in batches:
                for staged in batch:
                    self._append(staged)
                    with self._cond:
                        self._queued_bytes -= staged.k.nbytes + staged.v.nbytes
            with self._cond:
                self._applied += len(batches)
                self._cond.notify_all()
            self._commit()
            with self._cond:
                self._committed += len(batches)
                self._cond.notify_all()
            self._count("save_us", (time.perf_counter() - started) * 1e6)

    def _append(self, staged: Staged) -> None:
        """Append the pages of one save job the store lacks (the rest it holds already)."""
        job, store = staged.job, self.store
        size, shift = self.geometry.page_size, 0 if job.namespace is None else 1
        tokens = job_tokens(job)
        count = job.last - job.first
        seq = None
        try:
            if store.lookup(tokens) >= len(tokens):
                self._count("pages_already_held", count)
                return None
            seq = self._seq_id("save")
            have = store.create(seq, tokens=tokens) // size
            if shift and have == 0:
                zeros = np.zeros((self.geometry.layers, size, *self.geometry.token_shape), self.geometry.np_dtype)
                store.append(seq, zeros, zeros, tokens=tokens[:size])
                have = 1
            start = have - shift - job.first  # staged pages the store holds already
            if start < 0:  # the pages before this job are gone: the chain cannot be continued
                return self._drop(job)
            if start < count:
                geom = self.geometry
                k = staged.k[:, start:].reshape(geom.layers, -1, *geom.token_shape)
                v = staged.v[:, start:].reshape(geom.layers, -1, *geom.token_shape)
                store.append(seq, k, v, tokens=tokens[(have) * size:])
            self._count("pages_saved", count - start)
            self._count("pages_already_held", start)
        except StoreFull:
            self._drop(job)
        except Exception as exc:  # PagedKVError, or anything else: the thread must go on either way
            self._count("store_errors")
            log.warning("pagedkv: save of %s failed: %s", job.req_id, exc)
            self._drop(job)
        finally:
            if seq is not None:
                try:
                    store.drop(seq)
                except PagedKVError:
                    pass
        return None

    def _commit(self) -> None:
        try:
            self.store.commit()
            self._count("commits")
        except PagedKVError as exc:
            self._count("store_errors")
            log.warning("pagedkv: commit failed: %s", exc)
