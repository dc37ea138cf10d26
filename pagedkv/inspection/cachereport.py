"""What ``pagedkv inspect`` reports about the prefix cache, lifetime counters and spill codecs.

The counters come from the state record of the last commit, where writers keep
them cumulative over every session. A store last committed by a writer that did
not keep them has none: those figures are None (unknown), never a made-up 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..pages.directory import HASHED, REC_NONE
from ..snapshot import Snapshot
from ..storage.codecs import CODECS

# summary key -> name in the state record
PREFIX_COUNTERS = {"queries": "prefix_queries", "query_tokens": "prefix_query_tokens",
                   "hit_tokens": "prefix_hit_tokens", "hit_pages": "prefix_hit_pages"}
LIFETIME_COUNTERS = ("evictions", "restores", "cache_drops")


def cached_mask(snap: Snapshot, pids: np.ndarray) -> np.ndarray:
    """Which of ``pids`` no sequence references but the prefix index keeps (what a writer keeps)."""
    mgr = snap.mgr
    return np.array([mgr.ref[pid] == 0 and bool(mgr.flags[pid] & HASHED)
                     and mgr.prefix.holds(bytes(mgr.hash[pid]), pid) for pid in pids.tolist()], bool)


def _counter(state: dict[str, Any], name: str) -> int | None:
    # The state record is untrusted input: anything but a non-negative int is unknown.
    value = state.get(name)
    return value if type(value) is int and value >= 0 else None


def prefix_cache(snap: Snapshot, shared_pages: int, cached_pages: int) -> dict[str, Any]:
    """Shared and cached-only pages now, and the hits of every ``create(tokens=...)`` so far.

    Returns {"shared_pages", "cached_pages", "queries", "query_tokens", "hit_tokens",
    "hit_pages", "hit_rate"}; hit_rate is hit_tokens / query_tokens (0.0 without
    queries, None when the counters were never recorded).
    """
    counts = {key: _counter(snap.store._state, name) for key, name in PREFIX_COUNTERS.items()}
    asked, hit = counts["query_tokens"], counts["hit_tokens"]
    rate = None if asked is None or hit is None else (hit / asked if asked else 0.0)
    return {"shared_pages": shared_pages, "cached_pages": cached_pages, **counts, "hit_rate": rate}


def lifetime(snap: Snapshot) -> dict[str, int | None]:
    """Evictions, restores and cached pages dropped, over every session up to the last commit."""
    return {name: _counter(snap.store._state, name) for name in LIFETIME_COUNTERS}


def spill_codecs(snap: Snapshot) -> dict[str, dict[str, Any]]:
    """Per codec of ``spillcodecs.CODECS``: stored page records, their bytes, and the compression ratio.

    Counts live pages whose directory entry names a record; the ratio is
    pages * page bytes / record bytes (0.0 when the codec holds no bytes).
    """
    mgr, page_nbytes = snap.mgr, snap.store.geometry.page_nbytes
    stored = np.flatnonzero(mgr.live & (mgr.rec != REC_NONE))
    codes = mgr.codec[stored]
    sizes = mgr.rec_bytes[stored].astype(np.int64)
    out = {}
    for index, name in enumerate(CODECS):
        chosen = codes == index
        pages, nbytes = int(np.count_nonzero(chosen)), int(sizes[chosen].sum())
        out[name] = {"pages": pages, "bytes": nbytes, "ratio": pages * page_nbytes / nbytes if nbytes else 0.0}
    return out
