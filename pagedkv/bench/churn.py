"""B4: spill/restore churn against raw LMDB, per durability, working set and spill codec.

A pass steps every sequence once in random order (+1 token, written the way an
engine writes it: through the slot mapping into the pool), so a pool a quarter
of the working set or less keeps spilling and restoring. The reference is
``SpillSim``, the same LRU policy over raw LMDB (and once per durability over one
file per page), stepped through the same order right after each pagedkv pass.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np

from .. import open as open_store
from .evictgrowth import b4_evict_growth
from .ref import Backend, FileBackend, LmdbBackend, SpillSim
from .util import (GIB, INFO, Ctx, Pairs, Target, as_pages, geom_params, kv_block, make_row, open_lmdb,
                   remove, timed)
from ..geometry import PRESETS, Geometry
from ..storage.codecs import CODECS
from ..store import KVStore

AT_LEAST_07 = Target(">= 0.7", ">=", 0.7)
_ACCESS = ("each pass steps every sequence once in random order: +1 token, its spilled pages "
           "restored; GiB/s of bytes restored + spilled")
# Literal keys, so each stats() lookup below is typed by StoreStats.
_LatencyKey = Literal["restore_ms_p50", "restore_ms_p99", "restore_ms_mean"]
_PassKey = Literal["restores", "evictions", "evict_batches", "bytes_restored", "bytes_spilled"]
_LATENCY: tuple[_LatencyKey, ...] = ("restore_ms_p50", "restore_ms_p99", "restore_ms_mean")
_PER_PASS: tuple[_PassKey, ...] = ("restores", "evictions", "evict_batches", "bytes_restored", "bytes_spilled")
# stats()' per-codec keys (pages, ratio), spelled out as StoreStats declares them.
_CODEC_KEYS: dict[str, tuple[Literal["codec_raw_pages", "codec_int8_pages", "codec_zstd_pages"],
                             Literal["codec_raw_ratio", "codec_int8_ratio", "codec_zstd_ratio"]]] = {
    "raw": ("codec_raw_pages", "codec_raw_ratio"), "int8": ("codec_int8_pages", "codec_int8_ratio"),
    "zstd": ("codec_zstd_pages", "codec_zstd_ratio")}


@dataclass
class _Churn:
    """One configuration: its sizes, its files, and the K/V every sequence starts from."""

    ctx: Ctx
    mode: str  # durability of the stores; the reference syncs iff "durable"
    factor: int  # working set / pool size
    base: str  # directory of every file of this configuration
    geom: Geometry
    pool: int  # pool slots
    seq_pages: int  # pages per sequence
    warm: int  # untimed passes before measuring
    rounds: int  # measured passes
    k: np.ndarray  # (layers, start, heads, dim): every sequence's first tokens
    v: np.ndarray
    tok_k: np.ndarray  # (layers, 1, heads, dim): the token every pass appends
    tok_v: np.ndarray

    @property
    def start(self) -> int:
        """Tokens each sequence starts with: its last page keeps room for every pass's token."""
        return int(self.k.shape[1])

    @property
    def nseq(self) -> int:
        return self.factor * self.pool // self.seq_pages

    @property
    def batch(self) -> int:
        return max(1, min(64, self.pool // 4))  # pagedkv's own evict batch for this pool

    def params(self) -> dict[str, Any]:
        """The row params every B4 row of this configuration shares."""
        return {**geom_params(self.geom), "durability": self.mode, "pool_pages": self.pool,
                "working_set": f"{self.factor}x", "sequences": self.nseq, "pages_per_sequence": self.seq_pages,
                "evict_batch": self.batch, "warm_passes": self.warm, "pairs": self.rounds}

    def fill_store(self, name: str, codec: str = "raw") -> KVStore:
        """A store holding every sequence, committed (most of it spilled already)."""
        store = open_store(os.path.join(self.base, name), self.geom, pool_pages=self.pool,
                           durability=self.mode, evict_batch=64, spill_codec=codec)
        for seq in range(self.nseq):
            store.create(seq)
            store.append(seq, self.k, self.v)
        store.commit()
        return store

    def fill_sim(self, name: str, backend: Backend) -> SpillSim:
        """The reference cache over ``backend``, holding the same pages."""
        pages = as_pages(self.geom, self.k, self.v)
        pool = np.memmap(os.path.join(self.base, f"ref-{name}.pool"), self.geom.np_dtype, "w+",
                         shape=(self.pool, *self.geom.page_shape))
        sim = SpillSim(pool, backend, self.batch)
        for seq in range(self.nseq):
            for index in range(self.seq_pages):
                sim.add(seq * self.seq_pages + index, pages[index])
        return sim

    def store_pass(self, store: KVStore, order: list[int]) -> float:
        """Seconds of one pagedkv pass over ``order``."""
        pool_view, page_size = store.pool, self.geom.page_size

        def work() -> None:
            for seq in order:
                with store.step({seq: 1}) as step:  # restores and pins the sequence's pages
                    slot, offset = divmod(int(step.slot_mapping[0]), page_size)
                    pool_view[slot, :, 0, offset] = self.tok_k[:, 0]
                    pool_view[slot, :, 1, offset] = self.tok_v[:, 0]
        return timed(work)

    def sim_pass(self, sim: SpillSim, lengths: list[int], order: list[int]) -> tuple[float, int]:
        """(seconds, bytes restored + written) of one reference pass over ``order``."""
        before = sim.counts["get_bytes"] + sim.counts["put_bytes"]

        def work() -> None:
            for seq in order:
                keys = [seq * self.seq_pages + index for index in range(self.seq_pages)]
                slots = sim.access(keys)
                index, offset = divmod(lengths[seq], self.geom.page_size)
                sim.pool[slots[index], :, 0, offset] = self.tok_k[:, 0]
                sim.pool[slots[index], :, 1, offset] = self.tok_v[:, 0]
                sim.dirty(keys[index])
                lengths[seq] += 1
        seconds = timed(work)
        return seconds, sim.counts["get_bytes"] + sim.counts["put_bytes"] - before

    def orders(self, salt: str) -> Callable[[], list[int]]:
        """A reproducible stream of random pass orders."""
        rng = self.ctx.rng(salt)

        def order() -> list[int]:
            seqs = list(range(self.nseq))
            rng.shuffle(seqs)
            return seqs
        return order

    def readback(self, store: KVStore) -> tuple[bool, float]:
        """(bit-exact, largest absolute error) of sequence 0 read back against what was written."""
        got_k, got_v = store.read(0)
        extra = store.length(0) - self.start
        want_k = np.concatenate([self.k, np.repeat(self.tok_k, extra, axis=1)], axis=1)
        want_v = np.concatenate([self.v, np.repeat(self.tok_v, extra, axis=1)], axis=1)
        exact = bool(np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v))
        error = max(float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
                    for got, want in ((got_k, want_k), (got_v, want_v)))
        return exact, error


def _setup(ctx: Ctx, mode: str, factor: int, salt: str) -> _Churn:
    geom = PRESETS["tiny"] if ctx.quick else PRESETS["small"]
    # Quick mode shortens the warm-up too (its figures are not steady state).
    pool, seq_pages, warm, rounds = (64, 4, 1, 5) if ctx.quick else (256, 4, 3, 5)
    start = (seq_pages - 1) * geom.page_size + 1
    assert start + warm + rounds <= seq_pages * geom.page_size
    rng = ctx.np_rng(salt)
    k, v = kv_block(geom, start, rng)
    tok_k, tok_v = kv_block(geom, 1, rng)
    return _Churn(ctx, mode, factor, ctx.path(salt), geom, pool, seq_pages, warm, rounds, k, v, tok_k, tok_v)


def b4_churn(ctx: Ctx) -> list[dict[str, Any]]:
    """B4: churn at working sets 4x (the target), 2x and 16x the pool per durability, then per codec."""
    rows = []
    for mode in ("durable", "nosync"):
        # A durable pass costs ~4 syncs per pool-sized share of the working set; quick
        # mode keeps only durable 4x (with its naive row) to stay CI-sized on a busy disk.
        factors = (4,) if ctx.quick and mode == "durable" else (4, 2, 16)
        for factor in factors:
            rows += _churn(ctx, mode, factor, naive=factor == 4)
    for mode in ("durable",) if ctx.quick else ("durable", "nosync"):
        rows += _codec_churn(ctx, mode, 4)
    return rows + b4_evict_growth(ctx)


def _churn(ctx: Ctx, mode: str, factor: int, naive: bool) -> list[dict[str, Any]]:
    run = _setup(ctx, mode, factor, f"b4-{mode}-{factor}")
    durable = mode == "durable"
    ctx.say(f"B4: {mode}, working set {factor}x a {run.pool}-page pool ({run.nseq} sequences)")
    sims: dict[str, SpillSim] = {}
    store: KVStore | None = None
    try:
        store = run.fill_store("store")
        backends: dict[str, Backend] = {
            "lmdb": LmdbBackend(open_lmdb(os.path.join(run.base, "ref-lmdb"), durable))}
        if naive:
            backends["files"] = FileBackend(os.path.join(run.base, "ref-files"), durable)
        for name, backend in backends.items():
            sims[name] = run.fill_sim(name, backend)
        lengths = {name: [run.start] * run.nseq for name in sims}

        def pagedkv_pass(order: list[int]) -> float:
            before = store.stats()
            seconds = run.store_pass(store, order)
            after = store.stats()
            return sum(after[key] - before[key] for key in ("bytes_restored", "bytes_spilled")) / seconds / GIB

        order = run.orders(f"b4-order-{mode}-{factor}")
        for _ in range(run.warm):  # steady state: every page has been spilled and restored
            this = order()
            pagedkv_pass(this)
            for name, sim in sims.items():
                run.sim_pass(sim, lengths[name], this)
        stats0 = store.stats()
        sims0 = {name: sim.summary() for name, sim in sims.items()}
        results = {name: Pairs([], []) for name in sims}
        for _ in range(run.rounds):
            this = order()
            rate = pagedkv_pass(this)
            for name, sim in sims.items():  # A B (C): each reference right after the same pagedkv pass
                seconds, moved = run.sim_pass(sim, lengths[name], this)
                results[name].a.append(rate)
                results[name].b.append(moved / seconds / GIB)
        stats = store.stats()
        assert store.check() == [], "B4: store check failed"
    finally:
        if store is not None:
            store.close()
        for sim in sims.values():
            sim.backend.close()
        remove(run.base)
    latency: dict[str, float] = {key: stats[key] for key in _LATENCY}
    mine = {f"pagedkv_{key}_per_pass": (stats[key] - stats0[key]) / run.rounds for key in _PER_PASS}
    theirs = {name: {f"{name}_{key}_per_pass": (value - sims0[name][key]) / run.rounds
                     for key, value in sim.summary().items()} for name, sim in sims.items()}
    lm = results["lmdb"]
    rows = [make_row("B4", f"spill/restore churn {factor}x {mode}", lm.a_median, lm.b_median, "GiB/s",
                     lm.ratio, AT_LEAST_07, run.params(),
                     f"{_ACCESS}; reference: the same LRU policy on raw LMDB, {run.batch} puts per txn; "
                     "restore latency from store.stats()", {**latency, **mine, **theirs["lmdb"]})]
    if naive:
        files = results["files"]
        rows.append(make_row("B4", f"naive file-per-page baseline {factor}x {mode}", files.a_median,
                             files.b_median, "GiB/s", files.ratio, INFO, run.params(),
                             f"{_ACCESS}; reference: the same LRU policy, one file per evicted page "
                             f"(open/write/{'fsync/' if durable else ''}close)",
                             {**latency, **mine, **theirs["files"]}))
    return rows


def _codec_churn(ctx: Ctx, mode: str, factor: int) -> list[dict[str, Any]]:
    """One row per spill codec: the same passes through a raw, an int8 and a zstd store, interleaved."""
    run = _setup(ctx, mode, factor, f"b4-codec-{mode}-{factor}")
    ctx.say(f"B4: spill codecs {', '.join(CODECS)}, {mode}, working set {factor}x a {run.pool}-page pool")
    stores: dict[str, KVStore] = {}
    sim: SpillSim | None = None
    try:
        try:
            for codec in CODECS:
                stores[codec] = run.fill_store(f"store-{codec}", codec)
            sim = run.fill_sim("lmdb", LmdbBackend(open_lmdb(os.path.join(run.base, "ref-lmdb"),
                                                             mode == "durable")))
            lengths = [run.start] * run.nseq
            order = run.orders(f"b4-codec-order-{mode}-{factor}")
            for _ in range(run.warm):
                this = order()
                for store in stores.values():
                    run.store_pass(store, this)
                run.sim_pass(sim, lengths, this)
            stats0 = {codec: store.stats() for codec, store in stores.items()}
            rates: dict[str, list[float]] = {codec: [] for codec in stores}
            reference: list[float] = []
            for _ in range(run.rounds):
                this = order()
                seconds = {codec: run.store_pass(store, this) for codec, store in stores.items()}
                ref_seconds, moved = run.sim_pass(sim, lengths, this)
                # Compressed records are smaller, so every rate counts the page bytes the
                # policy moved (the reference's, uncompressed): the rates compare times.
                for codec in stores:
                    rates[codec].append(moved / seconds[codec] / GIB)
                reference.append(moved / ref_seconds / GIB)
            stats = {codec: store.stats() for codec, store in stores.items()}
            fidelity = {codec: run.readback(store) for codec, store in stores.items()}
            for codec, store in stores.items():
                assert store.check() == [], f"B4: {codec} store check failed"
        finally:
            for store in stores.values():
                store.close()
            if sim is not None:
                sim.backend.close()
        disk = {codec: os.path.getsize(os.path.join(run.base, f"store-{codec}", "spill", "data.mdb"))
                for codec in stores}
    finally:
        remove(run.base)
    rows = []
    for codec in CODECS:
        st, result = stats[codec], Pairs(rates[codec], reference)
        exact, error = fidelity[codec]
        pages_key, ratio_key = _CODEC_KEYS[codec]
        metrics = {**{key: st[key] for key in _LATENCY},
                   **{f"pagedkv_{key}_per_pass": (st[key] - stats0[codec][key]) / run.rounds for key in _PER_PASS},
                   "spill_bytes": int(st["spill_bytes"]), "data_mdb_bytes": disk[codec],
                   "codec_pages": int(st[pages_key]), "codec_ratio": st[ratio_key],
                   "ratio_to_raw_codec": statistics.median(a / b for a, b in zip(rates[codec], rates["raw"])),
                   "readback_exact": exact, "readback_max_abs_error": error}
        rows.append(make_row("B4", f"spill/restore churn {factor}x {mode}, {codec} codec", result.a_median,
                             result.b_median, "GiB/s", result.ratio, INFO,
                             {**run.params(), "spill_codec": codec},
                             f"{_ACCESS} (page bytes, uncompressed, as the reference moved them); the "
                             f"{', '.join(CODECS)} stores run the same passes in turn, each round then the "
                             "raw-LMDB reference; random fp16 K/V, so zstd's ratio is a floor; bytes on disk: "
                             "spill/data.mdb after close and stats()['spill_bytes']", metrics))
    return rows
