"""Metadata-path scenarios: B2 decode bookkeeping, B5 the seed workload, B6 reopen, B7 commit."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from typing import Any, Callable

import numpy as np

from .. import open as open_store
from .records import SameRecords, TwoSyncFloor, TxnLog, flushes, recording
from .ref import RefBlockManager
from .util import INFO, Ctx, Target, geom_params, interleave, kv_block, make_row, open_lmdb, timed
from ..storage.files import disk_usage
from ..geometry import PRESETS, Geometry
from ..pages.sequence import SeqId
from ..store import KVStore

# Bookkeeping does not depend on page bytes: 64-byte pages keep the pool file tiny.
META_GEOM = Geometry(layers=1, kv_heads=1, head_dim=1, page_size=16, dtype="float16")


def b2_step(ctx: Ctx) -> list[dict[str, Any]]:
    """B2: entering + leaving ``store.step`` per sequence-step vs the pure-Python block manager."""
    counts = (256, 64) if ctx.quick else (256, 64, 1024)
    steps, pairs = (40, 5) if ctx.quick else (256, 8)
    block = steps // pairs
    page_size = META_GEOM.page_size
    rows = []
    for nseq in counts:
        rng = ctx.rng(f"b2-{nseq}")
        prompts = [rng.randint(1, 512) for _ in range(nseq)]
        pages = sum(-(-(p + steps + block + 1) // page_size) for p in prompts)
        path = ctx.path(f"b2-{nseq}")
        store = open_store(path, META_GEOM, pool_pages=pages)
        ref = RefBlockManager(pages, page_size)
        try:
            for seq, prompt in enumerate(prompts):  # the prefill, untimed
                store.create(seq)
                ref.add(seq)
            with store.step(dict(enumerate(prompts))):
                pass
            ref.step(dict(enumerate(prompts)))
            mapping: dict[SeqId, int] = {seq: 1 for seq in range(nseq)}

            def pagedkv_block() -> float:
                def work() -> None:
                    for _ in range(block):
                        with store.step(mapping):
                            pass
                return timed(work) / (block * nseq) * 1e6

            def reference_block() -> float:
                def work() -> None:
                    for _ in range(block):
                        ref.step(mapping)
                return timed(work) / (block * nseq) * 1e6

            pagedkv_block()  # warm-up
            reference_block()
            result = interleave(pagedkv_block, reference_block, pairs)
            with store.step(mapping) as step:  # both must describe the same sequences
                tables, slot_mapping, lens = ref.step(mapping)
                assert np.array_equal(step.seq_lens, lens), "B2: sequence lengths differ"
                assert step.block_tables.shape == tables.shape, "B2: block table shapes differ"
                assert np.array_equal(step.slot_mapping % page_size, slot_mapping % page_size)
        finally:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
        params = {**geom_params(META_GEOM), "sequences": nseq, "new_tokens_per_step": 1,
                  "steps": steps, "pairs": pairs, "prompt_tokens": "uniform 1..512"}
        rows.append(make_row("B2", f"decode bookkeeping {nseq} seqs", result.a_median, result.b_median,
                             "us/seq-step", result.ratio, Target("<= 1.0x", "<=", 1.0), params,
                             "time of with store.step(...) enter+exit per sequence-step vs a "
                             "pure-Python block manager building the padded int32 table + slot mapping"))
    return rows


def b5_seed(ctx: Ctx) -> list[dict[str, Any]]:
    """B5: the seed workload: 60-byte tokens one page each into a 0.5 MB pool, then read 0-19."""
    geom = Geometry(layers=1, kv_heads=1, head_dim=15, page_size=1, dtype="float16")  # 60 B/page
    tokens, pool_bytes, reps = (5_000, 125_000, 1) if ctx.quick else (20_000, 500_000, 3)
    pool = pool_bytes // geom.page_nbytes
    k, v = kv_block(geom, tokens, ctx.np_rng("b5"))
    runs = []
    for rep in range(reps):
        path = ctx.path(f"b5-{rep}")
        started = time.perf_counter()
        store = open_store(path, geom, pool_pages=pool)  # default durability
        try:
            store.create("seed")
            for index in range(tokens):
                store.append("seed", k[:, index:index + 1], v[:, index:index + 1])
            appended = time.perf_counter()
            before = store.stats()
            got = [store.read("seed", index, index + 1) for index in range(20)]
            read = time.perf_counter()
            after = store.stats()
        finally:
            store.close()
        done = time.perf_counter()
        shutil.rmtree(path, ignore_errors=True)
        for index, (got_k, got_v) in enumerate(got):
            assert np.array_equal(got_k[:, 0], k[:, index]) and np.array_equal(got_v[:, 0], v[:, index])
        runs.append({
            "total_s": done - started, "append_s": appended - started, "read_s": read - appended,
            "close_s": done - read,
            "memory_hits": after["resident_hits"] - before["resident_hits"],
            "disk_hits": after["spill_hits"] - before["spill_hits"],
            "misses": after["misses"] - before["misses"],
            "restore_ms_mean": after["restore_ms_mean"], "restore_ms_p99": after["restore_ms_p99"],
            "evictions": after["evictions"], "evict_batches": after["evict_batches"],
        })
    median = sorted(runs, key=lambda run: run["total_s"])[len(runs) // 2]
    params = {**geom_params(geom), "tokens": tokens, "pool_bytes": pool_bytes, "pool_pages": pool,
              "durability": "durable", "repeats": reps}
    return [make_row("B5", "seed workload", median["total_s"], None, "s", None,
                     Target("faster than the prototype"), params,
                     "open + append one token at a time + read tokens 0-19 one by one (all spilled) + "
                     "close, one process; hits/misses are of the reads; median of the repeats",
                     median)]


def b6_reopen(ctx: Ctx) -> list[dict[str, Any]]:
    """B6: time of ``pagedkv.open`` on stores of 10k, 100k and 1M pages (most spilled)."""
    sizes = (2_000, 10_000) if ctx.quick else (10_000, 100_000, 1_000_000)
    per_seq, reps = 10, 5
    geom = Geometry(layers=1, kv_heads=1, head_dim=1, page_size=1, dtype="float16")  # 4-byte pages
    rows = []
    for pages in sizes:
        path = ctx.path(f"b6-{pages}")
        pool = max(256, pages // 8)  # seven pages in eight are spilled
        nseq = pages // per_seq
        ctx.say(f"B6: building {pages} pages in {nseq} sequences")
        k = np.zeros((1, per_seq, 1, 1), np.float16)
        started = time.perf_counter()
        # The fastest honest build: nosync, one eviction transaction per quarter pool.
        store = open_store(path, geom, pool_pages=pool, durability="nosync", evict_batch=pool,
                           map_size=1 << 32)
        for seq in range(nseq):
            store.create(seq)
            store.append(seq, k, k)
        spilled = store.stats()["spilled_pages"]
        store.close()
        build = time.perf_counter() - started
        disk = disk_usage(path)
        times = []
        for _ in range(reps):
            seconds = time.perf_counter()
            store = open_store(path)
            times.append(time.perf_counter() - seconds)
            store.close()
        shutil.rmtree(path, ignore_errors=True)
        figure = statistics.median(times)
        target = Target("<= 1 s", "<=", 1.0, on="pagedkv") if pages <= 100_000 else INFO
        params = {**geom_params(geom), "pages": pages, "sequences": nseq, "pool_pages": pool,
                  "repeats": reps}
        metrics = {"spilled_pages": spilled, "us_per_page": figure / pages * 1e6,
                   "build_s": build, "store_bytes_on_disk": disk, "open_s_min": min(times),
                   "open_s_max": max(times)}
        rows.append(make_row("B6", f"reopen {pages} pages", figure, None, "s", None, target, params,
                             "median time of pagedkv.open(path) (writer, durable) with the OS cache "
                             "warm; pages are 4 bytes, so the time is metadata", metrics))
    return rows


def _sync_floor(path: str, nbytes: int, page_nbytes: int, pages: int, env: Any,
                rng: Any) -> Callable[[], float]:
    """A round of the bare syncs of a durable commit: ``pages`` rewritten pages of a file, then LMDB (ms).

    The file is reserved like ``pool.bin`` and its pages written once up front: a
    decode step rewrites each sequence's last page, already written before.
    """
    offsets = [page * page_nbytes for page in rng.sample(range(nbytes // page_nbytes), pages)]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        for offset in offsets:
            os.pwrite(fd, bytes(page_nbytes), offset)
        os.fsync(fd)
    finally:
        os.close(fd)

    def one() -> float:
        fd = os.open(path, os.O_RDWR)
        try:
            for offset in offsets:
                os.pwrite(fd, bytes(64), offset)

            def syncs() -> None:
                os.fdatasync(fd)
                with env.begin(write=True) as txn:
                    txn.put(b"key", bytes(64))
            return timed(syncs) * 1e3
        finally:
            os.close(fd)
    return one


def decode_commit(store: KVStore, mapping: dict[SeqId, int], token: np.ndarray,
                  written: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None) -> float:
    """A one-token step whose new K/V the engine writes into the pool, then the timed ``commit()`` (ms).

    ``written``, when given, gets the step's (slots, offsets, token) appended:
    what a bare floor writes to dirty the same bytes.
    """
    page_size = store.geometry.page_size
    pool = store.pool
    with store.step(mapping) as step:
        slots, offsets = np.divmod(step.slot_mapping, page_size)
        pool[slots, :, :, offsets] = token
    if written is not None:
        written.append((slots, offsets, token))
    return timed(store.commit) * 1e3


def b7_commit(ctx: Ctx) -> list[dict[str, Any]]:
    """B7: ``commit()`` after a 256-sequence decode step, per durability mode, vs a bare synced LMDB commit.

    The reference is docs/performance.md's (a synced commit of one small put) for every
    mode; an unsynced bare commit is measured in the same rounds and reported in
    the metrics. A durable commit syncs twice, the pool file then LMDB: the same
    rounds also time that floor bare (a pool-sized file with one written page per
    sequence fdatasynced, then the bare synced commit), and its like-for-like
    form, a row of its own: the step's writes into a bare mapping of a file of
    the pool's size, msync of the ranges that very commit msynced, then a
    synced commit of the records the commit writes (``records.TwoSyncFloor``).
    For nosync the same rounds time the like-for-like floor: a bare unsynced
    commit of the very records pagedkv's commit of such a step writes
    (``records.SameRecords``, counted on the warm-up commit), a row of its own.
    """
    geom = PRESETS["tiny"]
    nseq, pairs = 256, (5 if ctx.quick else 15)
    page_size = geom.page_size
    rows = []
    token = np.ones((geom.layers, 2, geom.kv_heads, geom.head_dim), geom.np_dtype)
    for mode in ("durable", "nosync", "volatile"):
        rng = ctx.rng(f"b7-{mode}")
        prompts = [rng.randint(16, 512) for _ in range(nseq)]
        pages = sum(-(-(p + pairs + 2) // page_size) for p in prompts) + 64
        base = ctx.path(f"b7-{mode}")
        store = open_store(os.path.join(base, "store"), geom, pool_pages=pages, durability=mode)
        envs = {sync: open_lmdb(os.path.join(base, f"ref-{sync}"), sync=sync, map_size=1 << 26)
                for sync in (True, False)}
        small = bytes(64)
        unsynced: list[float] = []
        same: SameRecords | None = None
        two_sync: TwoSyncFloor | None = None
        wrote: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        exits = contextlib.ExitStack()
        try:
            # What each durable commit msyncs of the pool, for its like-for-like floor.
            ranges = exits.enter_context(flushes(store)) if mode == "durable" else []
            for seq in range(nseq):
                store.create(seq)
            with store.step(dict(enumerate(prompts))):
                pass
            store.commit()
            mapping: dict[SeqId, int] = {seq: 1 for seq in range(nseq)}

            def pagedkv_commit() -> float:
                ranges.clear()  # the floor of a round replays that round's commit
                wrote.clear()
                return decode_commit(store, mapping, token, wrote)

            def bare_commit(sync: bool) -> float:
                def one() -> None:
                    with envs[sync].begin(write=True) as txn:
                        txn.put(b"key", small)
                return timed(one) * 1e3

            def reference() -> float:
                unsynced.append(bare_commit(False))
                return bare_commit(True)

            floors: dict[str, Callable[[], float]] | None = None
            with recording(store) as txns:
                pagedkv_commit()  # warm-up
            written = txns[0] if txns else TxnLog()  # one transaction per commit; none when volatile
            if mode == "nosync":
                same = SameRecords(os.path.join(base, "same"), store, written)
                floors = {"same_records": same.commit_ms}
            if mode == "durable":
                two_sync = TwoSyncFloor(os.path.join(base, "two-sync"), store, written)
                replay = two_sync.round_ms
                floors = {"sync_floor": _sync_floor(os.path.join(base, "floor.bin"), pages * geom.page_nbytes,
                                                    geom.page_nbytes, nseq, envs[True], rng),
                          "two_sync_floor": lambda: replay(wrote[-1], list(ranges))}
                replay(wrote[-1], list(ranges))  # warm-up
                two_sync.flush_ms.clear()
                two_sync.commit_ms.clear()
            reference()
            unsynced.clear()
            result = interleave(pagedkv_commit, reference, pairs, floors)
        finally:
            exits.close()
            store.close()
            for env in envs.values():
                env.close()
            if same is not None:
                same.close()
            if two_sync is not None:
                two_sync.close()
            shutil.rmtree(base, ignore_errors=True)
        params = {**geom_params(geom), "durability": mode, "sequences": nseq, "pairs": pairs}
        floor = statistics.median(unsynced)
        metrics: dict[str, Any] = {"bare_nosync_commit_ms": floor}
        if mode != "durable":  # the like-for-like ratio of an unsynced commit
            metrics["ratio_to_bare_nosync"] = result.a_median / floor
        else:  # what two syncs cost bare: the durable ratio cannot go below this one
            metrics["sync_floor_ms"] = statistics.median(result.extra["sync_floor"])
            metrics["sync_floor_ratio"] = result.ratio_to_b(result.extra["sync_floor"])
        if same is not None:
            series = result.extra["same_records"]
            metrics["same_records_nosync_ms"] = statistics.median(series)
            metrics["ratio_to_same_records_nosync"] = result.ratio_to(series)
        rows.append(make_row("B7", f"commit after decode step {mode}", result.a_median, result.b_median,
                             "ms", result.ratio, Target("<= 2.0x", "<=", 2.0), params,
                             f"commit() after one 1-token step of {nseq} sequences whose new K/V were "
                             "written into the pool, vs a synced bare LMDB commit of one 64-byte put"
                             + ("; volatile commit() is a no-op" if mode == "volatile" else ""), metrics))
        if same is not None:
            record_metrics = {"records": written.records, "put_bytes": written.put_bytes,
                              "deletes": len(written.deletes),
                              **{f"puts_{db}": count for db, count in written.by_db().items()}}
            rows.append(make_row("B7", "commit after decode step nosync vs the same records", result.a_median,
                                 metrics["same_records_nosync_ms"], "ms", metrics["ratio_to_same_records_nosync"],
                                 Target("<= 2.0x", "<=", 2.0), params,
                                 "nosync commit() after the 1-token step vs a bare unsynced LMDB commit of the "
                                 "records pagedkv's commit of such a step writes (same databases, keys and value "
                                 "sizes, one putmulti per database, into a copy of the store's records)",
                                 record_metrics))
        if two_sync is not None:
            series = result.extra["two_sync_floor"]
            floor_metrics = {"two_sync_floor_ms": statistics.median(series),
                             "flush_ms": statistics.median(two_sync.flush_ms),
                             "synced_commit_ms": statistics.median(two_sync.commit_ms),
                             "records": written.records, "put_bytes": written.put_bytes,
                             "flushed_ranges": len(ranges),
                             "flushed_bytes": sum(end - start for start, end in ranges)}
            rows.append(make_row("B7", "commit after decode step durable vs its two-sync floor", result.a_median,
                                 floor_metrics["two_sync_floor_ms"], "ms", result.ratio_to(series),
                                 Target("<= 1.2x", "<=", 1.2), params,
                                 "durable commit() after the 1-token step vs its two syncs done bare: the same "
                                 "writes into a bare mapping of a file of the pool's size, msync of the ranges "
                                 "that commit flushed, then a synced commit of the records it writes (as in the "
                                 "nosync row), in the same rounds", floor_metrics))
    return rows
