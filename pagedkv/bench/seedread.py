"""B5's one-page read of a spilled page against a bare LMDB get and copy of the same record."""

from __future__ import annotations

import shutil
import struct
from typing import Any

import numpy as np

from .. import open as open_store
from ..geometry import Geometry
from ..storage.spill import uid_key
from ..store import KVStore
from .meta import b5_seed
from .util import Ctx, Target, geom_params, interleave, kv_block, make_row, timed

SEED_GEOM = Geometry(layers=1, kv_heads=1, head_dim=15, page_size=1, dtype="float16")  # 60 B/page, B5's
_HEADER_LEN = struct.Struct("<I")  # a spill record starts with its header's length (storage/codec.py)


def b5_all(ctx: Ctx) -> list[dict[str, Any]]:
    """B5, every row: the seed workload's total time (``meta.b5_seed``), then the spilled one-page read."""
    return b5_seed(ctx) + b5_spilled_read(ctx)


def _uids(store: KVStore, seq_id: str) -> np.ndarray:
    """The uids of a sequence's pages, in order.

    The public API names pages by position only; the bare reference needs the
    LMDB key of each page's record, so the block table and the directory's uid
    column are read directly.
    """
    seq = store._seqs.find(seq_id)
    uids: np.ndarray = store._mgr.uid[seq.pids[:seq.npages]].copy()
    return uids


def _spilled(store: KVStore, seq_id: str, pages: range) -> bool:
    """Whether every page of ``pages`` is spilled right now (its directory row has no pool slot)."""
    seq = store._seqs.find(seq_id)
    return bool((store._mgr.slot[seq.pids[pages.start:pages.stop]] < 0).all())


def b5_spilled_read(ctx: Ctx) -> list[dict[str, Any]]:
    """B5: ``read(seq, i, i + 1)`` of a spilled page vs a bare LMDB get + numpy copy of its record, us per page.

    The store is B5's (60-byte pages, one token each, appended into a 0.5 MB
    pool, durable), so the first ~60% of the pages are spilled. Each pagedkv
    block reads the next ``block`` pages, all spilled at that moment (checked
    before the block); the reference block then gets the same records from the
    store's own LMDB environment (one per file per process), each in its own
    read transaction as each ``read()`` is its own operation, with zero-copy
    buffers, and copies each payload into a numpy array.
    """
    geom = SEED_GEOM
    tokens, pool_bytes, pairs = (5_000, 125_000, 5) if ctx.quick else (20_000, 500_000, 15)
    block = 20
    pool = pool_bytes // geom.page_nbytes
    k, v = kv_block(geom, tokens, ctx.np_rng("b5-read"))
    path = ctx.path("b5-read")
    store = open_store(path, geom, pool_pages=pool)  # default durability, as B5
    got: list[tuple[np.ndarray, np.ndarray]] = []
    payloads: list[np.ndarray] = []
    try:
        store.create("seed")
        chunk = 1000  # the pages end where one-at-a-time appends leave them, in far fewer calls
        for start in range(0, tokens, chunk):
            store.append("seed", k[:, start:start + chunk], v[:, start:start + chunk])
        uids = _uids(store, "seed")
        spilled_at_start = int(store.stats()["spilled_pages"])
        env, pages_db = store._spill.env, store._spill.pages
        unpack = _HEADER_LEN.unpack_from
        dtype = geom.np_dtype
        cursor = {"pagedkv": 0, "reference": 0}

        def pagedkv_block() -> float:
            first = cursor["pagedkv"]
            cursor["pagedkv"] += block
            wanted = range(first, first + block)
            assert _spilled(store, "seed", wanted), f"B5 read: pages {first}.. are not all spilled"
            read = store.read

            def work() -> None:
                for index in wanted:
                    got.append(read("seed", index, index + 1))
            return timed(work) / block * 1e6

        def reference_block() -> float:
            first = cursor["reference"]
            cursor["reference"] += block
            keys = [uid_key(int(uid)) for uid in uids[first:first + block]]

            def work() -> None:
                for key in keys:
                    with env.begin(buffers=True) as txn:
                        value = txn.get(key, db=pages_db)
                        assert value is not None, "B5 read: a spilled page has no record"
                        payloads.append(np.frombuffer(value, dtype, offset=4 + unpack(value)[0]).copy())
            return timed(work) / block * 1e6

        pagedkv_block()  # warm-up
        reference_block()
        before = store.stats()
        result = interleave(pagedkv_block, reference_block, pairs)
        after = store.stats()
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    assert len(got) == len(payloads) == (pairs + 1) * block
    for index, ((got_k, got_v), payload) in enumerate(zip(got, payloads)):
        page = payload.reshape(geom.page_shape)  # (layers, 2, page_size, heads, dim)
        assert np.array_equal(got_k[:, 0], k[:, index]) and np.array_equal(got_v[:, 0], v[:, index]), \
            f"B5 read: page {index} read back wrong"
        assert np.array_equal(page[:, 0, 0], k[:, index]) and np.array_equal(page[:, 1, 0], v[:, index]), \
            f"B5 read: the record of page {index} holds other bytes"
    measured = pairs * block
    params = {**geom_params(geom), "tokens": tokens, "pool_bytes": pool_bytes, "pool_pages": pool,
              "durability": "durable", "pages_per_block": block, "pairs": pairs}
    metrics = {"spilled_pages": spilled_at_start, "disk_hits": after["spill_hits"] - before["spill_hits"],
               "evict_batches": after["evict_batches"] - before["evict_batches"],
               "pagedkv_us_mean": float(np.mean(result.a)), "reference_us_mean": float(np.mean(result.b)),
               "restore_ms_p50": after["restore_ms_p50"]}
    assert metrics["disk_hits"] == measured, "B5 read: a measured page was not read from spill"
    return [make_row("B5", "one-page read() of a spilled page", result.a_median, result.b_median, "us",
                     result.ratio, Target("<= 3.0x", "<=", 3.0), params,
                     f"store.read(seq, i, i + 1) of pages spilled at that moment, {block} per block, vs a bare "
                     "LMDB get (own read transaction, buffers=True) of the same spill record in the store's "
                     "environment + np.frombuffer(payload).copy(); a restore into the full pool evicts a batch "
                     "(one synced transaction) every 64 reads: those blocks are in the median, and the mean "
                     "per read over every block is in the metrics", metrics)]
