"""What the two sides of the connector send each other, and the counters they report.

Scheduler -> worker, once per step: ``StepPlan`` (which pages to load into which
blocks, which computed blocks to save). Worker -> scheduler: ``WorkerReport``
(page hashes the scheduler's view must forget: saves that did not land, pages
that were gone or corrupt at load time). All of it is plain data that vLLM
serialises between processes in its default multi-process mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["PageJob", "StepPlan", "WorkerReport", "PagedKVStats", "COUNTERS"]


@dataclass
class PageJob:
    """Pages ``[first, last)`` of one request, in vLLM blocks ``block_ids`` (one per page).

    ``token_ids`` are the request's ids of pages ``[0, last)``; ``namespace``
    its namespace page's ids (or None); ``digests`` the chained hashes of pages
    ``[first, last)``, so the worker can name pages that failed.
    """

    req_id: str
    first: int
    last: int
    block_ids: list[int]
    token_ids: list[int]
    namespace: list[int] | None
    digests: list[bytes]
    finished: bool = False  # the request has ended; its blocks wait for this save (delayed free)


@dataclass
class StepPlan(KVConnectorMetadata):
    """One step's work for the worker: loads run before the forward, saves after it."""

    loads: list[PageJob] = field(default_factory=list)
    saves: list[PageJob] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Hashes of pages the worker found missing (loads) or could not save, and failed loads.

    ``failed_loads`` maps a request to the first page it could not load: vLLM
    recomputes from there, and the scheduler saves those pages again.
    """

    forget: list[bytes] = field(default_factory=list)
    failed_loads: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both reports together (one report per worker)."""
        assert isinstance(other, WorkerReport)
        failed = dict(self.failed_loads)
        for req_id, page in other.failed_loads.items():
            failed[req_id] = min(page, failed.get(req_id, page))
        return WorkerReport(self.forget + other.forget, failed)


COUNTERS = (
    "lookups",            # prompts looked up by the scheduler
    "lookup_tokens",      # prompt tokens of those lookups
    "hit_tokens",         # tokens the scheduler reported as held (beyond vLLM's own hit)
    "lookup_us",          # time spent in lookups, microseconds
    "pages_loaded",       # pages copied from the store into vLLM's blocks
    "load_us",            # time spent loading, microseconds
    "load_errors",        # pages the scheduler expected that could not be loaded (recomputed)
    "pages_saved",        # pages appended to the store
    "pages_already_held",  # pages asked to be saved that the store held already
    "save_us",            # time spent staging and appending saves, microseconds
    "save_dropped",       # pages not saved (queue full, store full or failing, gap in the chain)
    "commits",            # store commits (one per batch of saved steps)
    "store_errors",       # store failures (open, read, commit); the connector falls back to recompute
)


@dataclass
class PagedKVStats(KVConnectorStats):
    """The connector's counters over an interval, summed across workers and the scheduler."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, amount: int | float = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        self.data[name] = self.data.get(name, 0) + amount

    def reset(self) -> None:
        """Zero every counter."""
        zeros: dict[str, int | float] = {name: 0 for name in COUNTERS}
        self.data = zeros

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters summed with ``other``'s."""
        merged = dict(self.data)
        for name, value in (other.data or {}).items():
            merged[name] = merged.get(name, 0) + value
        return PagedKVStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures for vLLM's log line: counters, times in ms, the hit rate."""
        data: dict[str, Any] = self.data
        out: dict[str, int | float] = {name: data.get(name, 0) for name in COUNTERS if not name.endswith("_us")}
        for name in ("lookup_us", "load_us", "save_us"):
            out[name[:-3] + "_ms"] = round(data.get(name, 0) / 1000, 3)
        lookups = data.get("lookup_tokens", 0)
        out["hit_rate"] = round(data.get("hit_tokens", 0) / lookups, 4) if lookups else 0.0
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.get(name, 0) for name in COUNTERS)
