"""The remote tier's counters and its fetch-latency window (``stats()`` and ``inspect`` show them)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# Counted since the handle opened; ``inspect`` shows the totals a commit carried (see carry()).
HELP = {
    "remote_published": "Pages sent to the remote tier.",
    "remote_present": "Pages not sent: the remote tier held them already.",
    "remote_skipped": "Pages not published: queue full, remote tier down or refusing, or closing.",
    "remote_fetched": "Pages fetched from the remote tier, verified and made local.",
    "remote_fetch_misses": "Pages asked of the remote tier that it did not hold.",
    "remote_rejected": "Remote values refused: garbage, truncated, another page's or model's, bad checksum.",
    "remote_errors": "Failed remote operations (timeouts, refusals, an unreachable tier).",
    "remote_timeouts": "Remote operations that timed out.",
    "remote_refused": "Remote operations the server refused (OOM, READONLY, NOAUTH, WRONGPASS, NOPERM).",
    "remote_bytes_sent": "Value bytes published to the remote tier.",
    "remote_bytes_fetched": "Value bytes of verified pages fetched from the remote tier.",
    "remote_queue_pages": "Pages waiting to be published to the remote tier.",
    "remote_fetch_ms_p50": "Median remote fetch round trip over the last 4,096, in milliseconds.",
    "remote_fetch_ms_p99": "99th percentile remote fetch round trip over the last 4,096, in milliseconds.",
}
COUNTERS = tuple(name for name in HELP if name not in ("remote_queue_pages", "remote_fetch_ms_p50",
                                                        "remote_fetch_ms_p99"))
GAUGES = ("remote_queue_pages",)  # pages waiting to be published, now
LATENCIES = ("remote_fetch_ms_p50", "remote_fetch_ms_p99")  # per fetch round trip, ms
STATE_KEY = "remote"  # key of the remote section in the committed state record


class Counters:
    """Counters shared by the caller's thread (fetch) and the publisher thread."""

    def __init__(self, window: int = 4096) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._lat = np.zeros(window, np.float64)
        self._lat_n = 0
        self._carried: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        """Increase counter ``name`` by ``amount``."""
        with self._lock:
            self.counts[name] += amount

    def fetch_latency(self, seconds: float) -> None:
        """Record one fetch round trip."""
        with self._lock:
            self._lat[self._lat_n % len(self._lat)] = seconds
            self._lat_n += 1

    def snapshot(self) -> dict[str, int | float]:
        """Counters, plus fetch latency p50/p99 in ms (0.0 before any fetch)."""
        with self._lock:
            out: dict[str, int | float] = dict(self.counts)
            lat = self._lat[: min(self._lat_n, len(self._lat))] * 1e3
        out["remote_fetch_ms_p50"] = float(np.percentile(lat, 50)) if len(lat) else 0.0
        out["remote_fetch_ms_p99"] = float(np.percentile(lat, 99)) if len(lat) else 0.0
        return out

    def moved(self) -> bool:
        """Whether any counter gained since the last ``carry``."""
        with self._lock:
            return any(self.counts[name] != self._carried.get(name, 0) for name in COUNTERS)

    def carry(self, totals: dict[str, Any]) -> dict[str, int]:
        """``totals`` (a committed record's counters) plus what each counter gained since the last carry."""
        with self._lock:
            out = {}
            for name in COUNTERS:
                before = totals.get(name, 0)
                before = before if type(before) is int and before >= 0 else 0
                out[name] = before + self.counts[name] - self._carried.get(name, 0)
                self._carried[name] = self.counts[name]
            return out


def zero_stats() -> dict[str, int | float]:
    """The remote keys of ``stats()`` for a store without a remote tier."""
    out: dict[str, int | float] = dict.fromkeys(COUNTERS + GAUGES, 0)
    out.update(dict.fromkeys(LATENCIES, 0.0))
    return out


def committed_section(state: Any) -> dict[str, Any] | None:
    """The remote section of a committed state record, validated as untrusted input (None if absent or bad).

    Returns ``{"url": str, "namespace": str, "cluster": bool, "counters": {name: int}}``.
    """
    if not isinstance(state, dict):
        return None
    section = state.get(STATE_KEY)
    if not isinstance(section, dict):
        return None
    url, namespace = section.get("url"), section.get("namespace")
    counters = section.get("counters")
    if not isinstance(url, str) or not isinstance(namespace, str) or not isinstance(counters, dict):
        return None
    clean = {name: counters[name] for name in COUNTERS
             if type(counters.get(name)) is int and 0 <= counters[name] < 1 << 63}
    return {"url": url[:512], "namespace": namespace[:64], "cluster": section.get("cluster") is True,
            "counters": {name: clean.get(name, 0) for name in COUNTERS}}
