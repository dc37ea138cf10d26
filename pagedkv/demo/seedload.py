"""The ``pagedkv demo --seed-workload`` run: 20,000 tokens of 60 bytes into a 0.5 MB pool.

One sequence, one token per page, so 11,667 of the 20,000 pages must spill;
then tokens 0-19 (the oldest, so all on disk) are read back twice: the first
read is all disk hits, the second all memory hits. Both are checked bit-exact.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import pagedkv

from .workload import Progress, prepare_path
from ..geometry import Geometry
from .kvgen import DemoFailed, Request, expected_kv, token_kv
from ..stats import StoreStats
from ..store import KVStore

SEED_GEOMETRY = Geometry(layers=1, kv_heads=1, head_dim=15, page_size=1, dtype="float16")  # 60 B/token
SEED_TOKENS, SEED_POOL_BYTES = 20_000, 500_000
WINDOW = 16384  # restore latencies a store keeps (stats.Stats window)


def run_seed(path: str, seed: int, durability: str = "durable", progress: Progress | None = None,
             action: str | None = None) -> dict[str, Any]:
    """20,000 tokens of 60 bytes into a 0.5 MB pool, then read tokens 0-19 back (twice)."""
    action = action or prepare_path(path)
    geom = SEED_GEOMETRY
    pool_pages = SEED_POOL_BYTES // geom.page_nbytes
    req = Request("seed", [(1, 0)])
    chunk = 500
    started = time.perf_counter()
    with pagedkv.open(path, geom, pool_pages=pool_pages, durability=durability) as store:
        store.create(req.seq_id)
        for start in range(0, SEED_TOKENS, chunk):
            stop = min(SEED_TOKENS, start + chunk)
            store.append(req.seq_id, *token_kv(geom, seed, 1, np.arange(start, stop)))
            req.length = stop
            if progress:
                progress(stop - start)
        store.commit()
        write_seconds = time.perf_counter() - started
        written = store.stats()
        reads = [_seed_read(store, geom, seed, req) for _ in range(2)]
        stats = store.stats()
    return {
        "workload": "seed", "path": path, "store": action, "geometry": geom.to_dict(),
        "tokens": SEED_TOKENS, "token_bytes": geom.token_nbytes, "pool_pages": pool_pages,
        "pool_bytes": pool_pages * geom.page_nbytes, "seed": seed, "durability": durability,
        "evictions": int(written["evictions"]), "spilled_pages": int(written["spilled_pages"]),
        "bytes_spilled": int(stats["bytes_spilled"]), "seconds": write_seconds,
        "tokens_per_s": SEED_TOKENS / write_seconds if write_seconds else 0.0,
        "read": reads[0], "reread": reads[1], "verified": True,
    }


def _seed_read(store: KVStore, geom: Geometry, seed: int, req: Request) -> dict[str, Any]:
    before = store.stats()
    started = time.perf_counter()
    k, v = store.read(req.seq_id, 0, 20)
    seconds = time.perf_counter() - started
    after = store.stats()
    want_k, want_v = expected_kv(geom, seed, req, 0, 20)
    if k.tobytes() != want_k.tobytes() or v.tobytes() != want_v.tobytes():
        raise DemoFailed("tokens 0-19 read back differ from what was written")
    return {
        "start": 0, "stop": 20,
        "memory_hits": int(after["resident_hits"] - before["resident_hits"]),
        "disk_hits": int(after["spill_hits"] - before["spill_hits"]),
        "misses": int(after["misses"] - before["misses"]),
        "restore_ms_mean": _mean_since(before, after),
        "read_ms": seconds * 1e3, "verified": True,
    }


def _mean_since(before: StoreStats, after: StoreStats) -> float:
    """Mean restore latency (ms) of the restores between two ``stats()`` snapshots."""
    n0, n1 = int(before["restores"]), int(after["restores"])
    if n1 <= n0:
        return 0.0
    if n1 > WINDOW:  # the store's mean covers only its last WINDOW restores
        return float(after["restore_ms_mean"])
    return (after["restore_ms_mean"] * n1 - before["restore_ms_mean"] * n0) / (n1 - n0)
