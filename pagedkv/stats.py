"""What ``KVStore.stats()`` returns, and how it is put together from the store's parts."""

from __future__ import annotations

from typing import Any, TypedDict, cast

import numpy as np

from .counters import STORE_COUNTERS
from .remote.counters import COUNTERS as REMOTE_COUNTERS, zero_stats
from .storage.codecs import CODECS

# Every counter of stats(): the store's own, then the remote tier's (0 without one).
COUNTERS = STORE_COUNTERS + REMOTE_COUNTERS


class CacheDrop(TypedDict):
    """What ``KVStore.clear_cache`` dropped."""

    pages: int  # cache-only pages dropped
    bytes: int  # bytes of their spill records, deleted from LMDB
    slots: int  # pool slots their resident pages held, now free


class StoreStats(TypedDict):
    """What ``KVStore.stats()`` returns: counts are ``int``, latencies and ratios ``float``.

    Counters count since this handle opened (``inspect`` shows totals across
    sessions); the rest is the state now. Per-codec figures cover the pages whose
    spill record is in that codec.
    """

    # counters
    resident_hits: int  # pages found resident when an operation needed them
    spill_hits: int  # pages served from a spill record
    misses: int  # pages that failed their checksum
    evictions: int  # pages spilled (or dropped) to free slots
    restores: int  # pages brought back from spill on demand
    bytes_spilled: int  # record bytes written by evictions
    bytes_restored: int  # record bytes read by restores
    evict_batches: int  # eviction transactions
    commits: int
    tokens_appended: int
    tokens_read: int
    steps: int
    pages_allocated: int
    cow_copies: int  # copy-on-write copies of shared pages
    cache_drops: int  # cache-only pages dropped (spill cap, clear_cache)
    prefix_queries: int  # create(tokens=...) calls
    prefix_query_tokens: int  # tokens they asked about
    prefix_hit_tokens: int  # tokens they reused
    prefix_hit_pages: int  # pages they shared
    prefetch_restores: int  # pages restored by prefetch()
    background_evictions: int  # pages spilled by write-behind
    # restore latency over the last 16,384 restores, milliseconds (0.0 before any)
    restore_ms_mean: float
    restore_ms_p50: float
    restore_ms_p99: float
    # the pool and the pages, now
    pool_pages: int  # slots
    pool_used: int  # slots holding a page
    pool_free: int  # slots free now
    pool_pending: int  # slots freed since the last commit, held for its committed bytes
    pool_pinned: int  # slots pinned by active steps
    spilled_pages: int
    pages: int  # live pages (resident + spilled)
    sequences: int
    tokens: int  # tokens of every sequence
    shared_pages: int  # pages with refcount > 1
    cached_pages: int  # cache-only pages (refcount 0, kept for prefix reuse)
    cached_bytes: int  # bytes of the cache-only pages' spill records
    spill_bytes: int  # bytes of every page record in LMDB
    prefix_hit_rate: float  # prefix_hit_tokens / prefix_query_tokens (0.0 before any query)
    # per spill codec (spillcodecs.CODECS)
    codec_raw_pages: int
    codec_raw_bytes: int
    codec_raw_ratio: float  # page bytes / record bytes (0.0 without records)
    codec_int8_pages: int
    codec_int8_bytes: int
    codec_int8_ratio: float
    codec_zstd_pages: int
    codec_zstd_bytes: int
    codec_zstd_ratio: float
    # the remote tier (pagedkv.remote; all 0 without one): counters since this handle opened
    remote_published: int  # pages sent to the tier
    remote_present: int  # pages not sent: the tier held them already
    remote_skipped: int  # pages not published: queue full, tier down or refusing, closing
    remote_fetched: int  # pages fetched, verified and made local cache pages
    remote_fetch_misses: int  # pages asked for that the tier did not hold
    remote_rejected: int  # values refused: garbage, truncated, foreign, failing their checksum
    remote_errors: int  # failed operations
    remote_timeouts: int  # of which timeouts
    remote_refused: int  # of which refusals (OOM, READONLY, NOAUTH, WRONGPASS, NOPERM)
    remote_bytes_sent: int
    remote_bytes_fetched: int
    remote_queue_pages: int  # pages waiting to be published, now
    remote_fetch_ms_p50: float  # per fetch round trip over the last 4,096
    remote_fetch_ms_p99: float


def store_stats(store: Any) -> StoreStats:
    """``KVStore.stats()``: counters, restore latency (ms), pool occupancy, per-codec spill figures."""
    mgr = store._mgr
    out = store._stats.snapshot()
    out.update(
        pool_pages=store.pool_pages, pool_used=int(np.count_nonzero(mgr.slot_pid >= 0)),
        pool_free=len(mgr.free_slots),
        pool_pending=int(np.count_nonzero(mgr.pending_at(slice(None)))),
        pool_pinned=int(np.count_nonzero(mgr.pins)),
        spilled_pages=int(np.count_nonzero(mgr.live & (mgr.slot < 0))),
        pages=int(np.count_nonzero(mgr.live)), sequences=len(store._seqs),
        tokens=sum(seq.length for seq in store._seqs.values()),
        shared_pages=int(np.count_nonzero(mgr.live & (mgr.ref > 1))),
        cached_pages=int(np.count_nonzero(mgr.live & (mgr.ref == 0))),
        cached_bytes=mgr.cache_bytes(),
        spill_bytes=int(mgr.spill_bytes),
        prefix_hit_rate=(out["prefix_hit_tokens"] / out["prefix_query_tokens"]
                         if out["prefix_query_tokens"] else 0.0),
    )
    stored = np.flatnonzero(mgr.live & (mgr.rec != 0))
    pages = np.bincount(mgr.codec[stored], minlength=len(CODECS))
    nbytes = np.bincount(mgr.codec[stored], weights=mgr.rec_bytes[stored], minlength=len(CODECS))
    for index, name in enumerate(CODECS):
        out[f"codec_{name}_pages"] = int(pages[index])
        out[f"codec_{name}_bytes"] = int(nbytes[index])
        out[f"codec_{name}_ratio"] = (float(pages[index] * store.geometry.page_nbytes / nbytes[index])
                                      if nbytes[index] else 0.0)
    remote = getattr(store, "_remote", None)
    out.update(remote.stats() if remote is not None else zero_stats())
    return cast(StoreStats, out)  # the codec keys are built in a loop; the test suite checks every key
