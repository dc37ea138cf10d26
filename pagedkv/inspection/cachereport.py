"""What ``pagedkv inspect`` reports about the prefix cache, lifetime counters and spill codecs.

The counters come from the state record of the last commit
(``KVStore.last_commit()``), where writers keep them cumulative over every session. A store last committed by a writer that did
not keep them has none: those figures are None (unknown), never a made-up 0.
"""

from __future__ import annotations

from typing import Any

from ..describe import CommitInfo, StoreSummary
from ..snapshot import Snapshot
from ..storage.codecs import CODECS

__all__ = ["LIFETIME_COUNTERS", "PREFIX_COUNTERS", "lifetime", "prefix_cache", "spill_codecs"]

# summary key -> name in the state record
PREFIX_COUNTERS = {"queries": "prefix_queries", "query_tokens": "prefix_query_tokens",
                   "hit_tokens": "prefix_hit_tokens", "hit_pages": "prefix_hit_pages"}
LIFETIME_COUNTERS = ("evictions", "restores", "cache_drops")


def prefix_cache(commit: CommitInfo, shared_pages: int, cached_pages: int) -> dict[str, Any]:
    """Shared and cached-only pages now, and the hits of every ``create(tokens=...)`` so far.

    Returns {"shared_pages", "cached_pages", "queries", "query_tokens", "hit_tokens",
    "hit_pages", "hit_rate"}; hit_rate is hit_tokens / query_tokens (0.0 without
    queries, None when the counters were never recorded).
    """
    counts = {key: commit.counters.get(name) for key, name in PREFIX_COUNTERS.items()}
    asked, hit = counts["query_tokens"], counts["hit_tokens"]
    rate = None if asked is None or hit is None else (hit / asked if asked else 0.0)
    return {"shared_pages": shared_pages, "cached_pages": cached_pages, **counts, "hit_rate": rate}


def lifetime(source: Snapshot | CommitInfo) -> dict[str, int | None]:
    """Evictions, restores and cached pages dropped, over every session up to the last commit.

    ``source`` is a snapshot, or the ``CommitInfo`` of a summary already taken.
    """
    commit = source.store.last_commit() if isinstance(source, Snapshot) else source
    return {name: commit.counters.get(name) for name in LIFETIME_COUNTERS}


def spill_codecs(info: StoreSummary) -> dict[str, dict[str, Any]]:
    """Per codec of ``storage.codecs.CODECS``: stored page records, their bytes, and the compression ratio.

    Counts live pages whose directory entry names a record; the ratio is
    pages * page bytes / record bytes (0.0 when the codec holds no bytes).
    """
    page_nbytes = info.geometry.page_nbytes
    out = {}
    for name in CODECS:
        use = info.codecs[name]
        out[name] = {"pages": use.pages, "bytes": use.bytes,
                     "ratio": use.pages * page_nbytes / use.bytes if use.bytes else 0.0}
    return out
