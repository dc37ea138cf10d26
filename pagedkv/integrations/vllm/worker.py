"""The worker side: the store's one writer, filling vLLM's blocks and saving what vLLM computed.

Loads run before the forward pass: for each planned job a short-lived sequence
is created with the job's token ids (sharing the store's cached pages, no copy),
its pages are copied from the store's pool straight into the blocks vLLM
allocated (``KVStore.each_page``), and the sequence is dropped. Pages that are gone, or fail their checksum, become
load errors: vLLM recomputes from the first of them.
With a remote tier, that ``create`` first fetches the pages after the local match
into the store (verified: checksum, token ids, chain, model), so pages the
scheduler found in Redis load like local ones; one evicted or refused by then is
short of the match, a load error like any other.

Saves are split so that a step never waits on disk: after the forward pass the
planned blocks are copied out of vLLM's caches into staging arrays (memory
only), and the writer thread (``writer.py``) appends them to the store and
commits once per batch of steps. Loads wait only until the saves queued before
them are appended (not committed), so a page planned one step is loadable the
next; a load may still wait for a commit in flight, which holds the store lock.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
from typing import Any

import numpy as np

from ...errors import PageCorrupt, PagedKVError
from ...geometry import Geometry
from ... import open as pagedkv_open
from ...opening import is_store
from ...store import KVStore
from .config import ConnectorConfig
from .layouts import LayerCaches
from .meta import PageJob, PagedKVStats, StepPlan, WorkerReport
from .shared import log, register_worker_store
from .writer import SaveWriter, Staged, job_tokens

__all__ = ["WorkerSide", "SEQ_PREFIX"]

SEQ_PREFIX = "vllm:"  # ids of the connector's short-lived sequences (leftovers of a crash are dropped)


class WorkerSide:
    """The writer handle, the layout of vLLM's caches, and the writer thread.

    Params:
        config: the connector's settings.
        geometry: the store geometry derived from vLLM's KV cache spec.
        layer_names: vLLM's attention layers in layer order.
        fingerprint: the model fingerprint the store is opened with.
        num_blocks: vLLM blocks per layer cache.
    """

    def __init__(self, config: ConnectorConfig, geometry: Geometry, layer_names: list[str],
                 fingerprint: str, num_blocks: int) -> None:
        self.config, self.geometry, self.layer_names = config, geometry, layer_names
        self.num_blocks = num_blocks
        self.stats = PagedKVStats()
        self._stats_lock = threading.Lock()
        self.caches: LayerCaches | None = None
        self.store: KVStore | None = None
        self.disabled: str | None = None
        self._ids = itertools.count()
        self._load_errors: set[int] = set()
        self._forget: list[bytes] = []
        self._failed_loads: dict[str, int] = {}
        self._sending: set[str] = set()  # finished requests whose last save is staged
        self._writer: SaveWriter | None = None
        try:
            creating = not is_store(config.path)
            self.store = pagedkv_open(config.path, geometry, model=fingerprint,
                                      **config.open_kwargs(geometry, creating))
            self._drop_leftovers()
        except PagedKVError as exc:
            if self.store is not None:
                self.store.close()
                self.store = None
            self._disable(f"cannot open the store at {config.path}: {exc}")
            return
        register_worker_store(config.path, self.store)
        self._writer = SaveWriter(self.store, geometry, self._count, self._drop, self._seq_id)
        atexit.register(self.shutdown)
        log.info("pagedkv: store %s open for writing (%s)", config.path, geometry)

    def _count(self, name: str, amount: int | float = 1) -> None:
        with self._stats_lock:  # the writer thread counts too
            self.stats.add(name, amount)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self._count("store_errors")
        log.error("pagedkv: connector disabled, every token is computed: %s", reason)

    def _drop_leftovers(self) -> None:
        """Drop the short-lived sequences a crashed engine left committed (their pages stay cached)."""
        assert self.store is not None
        leftovers = [seq for seq in self.store.sequences() if isinstance(seq, str) and seq.startswith(SEQ_PREFIX)]
        for seq in leftovers:
            self.store.drop(seq)
        if leftovers:
            self.store.commit()

    def _seq_id(self, kind: str) -> str:
        return f"{SEQ_PREFIX}{os.getpid()}:{kind}:{next(self._ids)}"

    def register(self, kv_caches: dict[str, Any], layout: str) -> None:
        """Bind vLLM's per-layer caches (``register_kv_caches``)."""
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise PagedKVError(f"vLLM registered no KV cache for layers {missing}")
        self.caches = LayerCaches([kv_caches[name] for name in self.layer_names], self.geometry,
                                  self.num_blocks, layout)

    # -- loads -----------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """Fill the blocks of this step's load jobs; what cannot be loaded becomes a load error."""
        if not plan.loads:
            return
        started = time.perf_counter()
        if self._writer is not None:
            self._writer.wait_appended()
        for job in plan.loads:
            loaded = self.load_job(job) if self.store is not None and self.caches is not None else 0
            if loaded < job.last - job.first:
                self._load_errors.update(job.block_ids[loaded:])
                with self._stats_lock:
                    self._forget.extend(job.digests[loaded:loaded + 1])
                    self._failed_loads[job.req_id] = job.first + loaded
                self._count("load_errors", job.last - job.first - loaded)
            self._count("pages_loaded", loaded)
        self._count("load_us", (time.perf_counter() - started) * 1e6)

    def load_job(self, job: PageJob) -> int:
        """Copy pages ``[first, last)`` of the job into its blocks; return how many were."""
        assert self.store is not None and self.caches is not None
        store, size = self.store, self.geometry.page_size
        shift = 0 if job.namespace is None else 1
        seq = self._seq_id("load")
        try:
            reused = store.create(seq, tokens=job_tokens(job))
        except PagedKVError as exc:
            self._count("store_errors")
            log.warning("pagedkv: load of %s failed, recomputing: %s", job.req_id, exc)
            return 0
        try:
            held = min(reused // size - shift, job.last)
            if held <= job.first:
                return 0
            return self._copy_in(seq, shift + job.first, shift + held, job.block_ids)
        except Exception as exc:  # whatever fails, the blocks are recomputed; the engine goes on
            self._count("store_errors")
            log.warning("pagedkv: load of %s failed, recomputing: %s", job.req_id, exc)
            return 0
        finally:
            try:
                store.drop(seq)
            except PagedKVError:
                pass

    def _copy_in(self, seq: str, first: int, last: int, block_ids: list[int]) -> int:
        """Copy pages ``[first, last)`` of ``seq`` into ``block_ids``; return how many, stopping at a corrupt one.

        On the CPU each page goes straight from the store's pool into its block
        (``each_page``, no intermediate copy); other devices take one batch in pool
        layout (``read_pages``) and one copy per layer to the device.
        """
        assert self.store is not None and self.caches is not None
        store, caches = self.store, self.caches
        if caches.device.type == "cpu":
            def one(index: int, page: np.ndarray) -> None:
                caches.scatter_page(block_ids[index - first], page)

            try:
                return store.each_page(seq, one, first, last)
            except PageCorrupt:
                pass
            for index in range(first, last):  # the pages before the first corrupt one
                try:
                    store.each_page(seq, one, index, index + 1)
                except PageCorrupt as exc:
                    log.warning("pagedkv: %s; recomputing from there", exc)
                    return index - first
            return last - first
        try:
            caches.scatter(block_ids[:last - first], store.read_pages(seq, first, last))
            return last - first
        except PageCorrupt:
            pass
        for index in range(first, last):
            try:
                caches.scatter(block_ids[index - first:index - first + 1], store.read_pages(seq, index, index + 1))
            except PageCorrupt as exc:
                log.warning("pagedkv: %s; recomputing from there", exc)
                return index - first
        return last - first

    def flush(self) -> None:
        """Until every save queued so far is appended and committed (or the writer has stopped)."""
        if self._writer is not None:
            self._writer.wait_committed()

    # -- saves -----------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Copy this step's save jobs out of vLLM's blocks and queue them for the writer thread."""
        if not plan.saves:
            return
        started = time.perf_counter()
        batch: list[Staged] = []
        geom = self.geometry
        pending = 0  # bytes of this batch, not yet submitted
        for job in plan.saves:
            count = job.last - job.first
            nbytes = count * geom.page_nbytes
            if job.finished:
                self._sending.add(job.req_id)
            writer = self._writer
            if writer is None or self.caches is None or \
                    not writer.room(pending + nbytes, self.config.save_queue_bytes):
                self._drop(job)  # decode does not wait for the disk: a full queue drops the save
                continue
            pending += nbytes
            shape = (geom.layers, count, geom.page_size, geom.kv_heads, geom.head_dim)
            k, v = np.empty(shape, geom.np_dtype), np.empty(shape, geom.np_dtype)
            self.caches.gather(job.block_ids, k, v)
            batch.append(Staged(job, k, v))
        if batch and self._writer is not None:
            self._writer.submit(batch)
        self._count("save_us", (time.perf_counter() - started) * 1e6)

    def _drop(self, job: PageJob) -> None:
        self._count("save_dropped", job.last - job.first)
        with self._stats_lock:
            self._forget.extend(job.digests)

    # -- reporting ---------------------------------------------------------------
    def finished_sending(self, finished_req_ids: set[str]) -> set[str] | None:
        """Finished requests whose last save is staged (their blocks may be freed now)."""
        done, self._sending = self._sending, set()
        return done or None

    def load_errors(self) -> set[int]:
        """Block ids that failed to load since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def report(self) -> WorkerReport | None:
        """Hashes the scheduler's view must forget, since the last call."""
        with self._stats_lock:
            if not self._forget and not self._failed_loads:
                return None
            report = WorkerReport(self._forget, self._failed_loads)
            self._forget, self._failed_loads = [], {}
        return report

    def take_stats(self) -> PagedKVStats | None:
        """The worker side's counters since the last call, or None if nothing was counted."""
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, PagedKVStats()
        return stats

    def shutdown(self) -> None:
        """Land every queued save, commit, and close the store (idempotent)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.stop()
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except PagedKVError as exc:
                log.warning("pagedkv: closing the store failed: %s", exc)
