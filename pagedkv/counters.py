"""The store's monotonic counters and its restore-latency window (the block manager counts into them)."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

__all__ = ["STORE_COUNTERS", "Stats"]

# Counted by the store and its block manager since the handle opened.
STORE_COUNTERS = (
    "resident_hits", "spill_hits", "misses", "evictions", "restores", "bytes_spilled",
    "bytes_restored", "evict_batches", "commits", "tokens_appended", "tokens_read", "steps",
    "pages_allocated", "cow_copies", "cache_drops", "prefix_queries", "prefix_query_tokens",
    "prefix_hit_tokens", "prefix_hit_pages", "prefetch_restores", "background_evictions",
)


class Stats:
    """Monotonic counters plus the last ``window`` restore latencies (for p50/p99)."""

    def __init__(self, window: int = 16384) -> None:
        self.counts: dict[str, int] = dict.fromkeys(STORE_COUNTERS, 0)
        # A machine-double array: a one-page restore records its latency with one plain
        # item write (a numpy element write cost twice as much), read as numpy when summarised.
        self._lat = array("d", bytes(8 * window))
        self._window = window
        self._lat_n = 0
        self._carried: dict[str, int] = {}  # counter values already carried into a state record

    def add(self, name: str, amount: int = 1) -> None:
        """Increase counter ``name`` by ``amount``."""
        self.counts[name] += amount

    def restore_latency(self, seconds: float) -> None:
        """Record one page restore's latency."""
        n = self._lat_n
        self._lat[n % self._window] = seconds
        self._lat_n = n + 1

    def carry(self, state: dict[str, Any], names: tuple[str, ...]) -> None:
        """Add to ``state`` what counters ``names`` gained since the last carry (totals across sessions)."""
        for name in names:
            state[name] = int(state.get(name, 0)) + self.counts[name] - self._carried.get(name, 0)
            self._carried[name] = self.counts[name]

    def snapshot(self) -> dict[str, int | float]:
        """Counters and restore latency summary in milliseconds (0 when nothing restored)."""
        out: dict[str, int | float] = dict(self.counts)
        lat = np.frombuffer(self._lat, np.float64)[: min(self._lat_n, self._window)] * 1e3
        out["restore_ms_mean"] = float(lat.mean()) if len(lat) else 0.0
        out["restore_ms_p50"] = float(np.percentile(lat, 50)) if len(lat) else 0.0
        out["restore_ms_p99"] = float(np.percentile(lat, 99)) if len(lat) else 0.0
        return out
