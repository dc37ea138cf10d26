"""B10, the remote tier: fetching a prompt's pages from Redis, and time to a reused prompt on host B.

It needs a ``redis-server`` and redis-py (the ``redis`` extra): ``PAGEDKV_BENCH_REDIS``
names a server to use (its database is flushed), else one is started on a free
loopback port in the run's temporary directory. Without either the rows say so.

* fetch: host A publishes a prompt's pages; host B's ``lookup(prompt)`` fetches
  them (pipelined GETs, envelope and checksum verified, pages placed in its pool)
  against raw redis-py pipelined GETs of the same keys in the same process, the
  same client settings, nothing verified or placed. Ratio: pagedkv's throughput
  over raw GETs'. Target >= 0.8.
* reuse: B's ``create(tokens=prompt)`` from the remote tier against computing the
  prompt's K/V: a numpy float32 forward (projections, causal attention, MLP) at
  the geometry's width on this CPU, one layer timed and multiplied by the layers
  (all alike). A proxy for a prefill (a GPU computes faster); both are reported.
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import time
from typing import Any

import numpy as np

from ..geometry import PRESETS, Geometry
from ..opening import open_store
from .util import INFO, Ctx, Target, geom_params, interleave, make_row

REDIS_ENV = "PAGEDKV_BENCH_REDIS"
FETCH_GEOMS = {"llama-3-8b": PRESETS["llama-3-8b"],  # 2 MiB pages
               "1b": Geometry(layers=16, kv_heads=8, head_dim=64, page_size=16, dtype="float16")}  # 512 KiB
QUICK_GEOMS = {"quick-128k": Geometry(layers=8, kv_heads=4, head_dim=64, page_size=16, dtype="float16"),
               "quick-32k": Geometry(layers=4, kv_heads=2, head_dim=64, page_size=16, dtype="float16")}
MODEL = "bench-model"


class _Server:
    """A redis-server of the run's own, or the one ``PAGEDKV_BENCH_REDIS`` names."""

    def __init__(self, workdir: str) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = os.environ.get(REDIS_ENV, "")
        if self.url:
            return
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(f"no redis-server on PATH and {REDIS_ENV} unset")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        data = os.path.join(workdir, "redis")
        os.makedirs(data, exist_ok=True)
        self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", data,
                                      "--save", "", "--appendonly", "no", "--logfile", ""],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_ready()
        self.url = f"redis://127.0.0.1:{port}/0"

    def _wait_ready(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        seen, deadline = b"", time.monotonic() + 20
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"Ready to accept connections" not in seen:
                if time.monotonic() > deadline or not sel.select(deadline - time.monotonic()):
                    self.stop()
                    raise RuntimeError("redis-server did not get ready")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError("redis-server exited at start")
                seen = seen[-64:] + chunk
        self.proc.stdout.close()  # it logs nothing more we need; --logfile "" keeps it quiet after start

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def b10_remote(ctx: Ctx) -> list[dict[str, Any]]:
    """B10: remote fetch vs raw pipelined GETs (per page size), and reuse on host B vs computing."""
    try:
        __import__("redis")
        server = _Server(ctx.workdir)
    except (ImportError, RuntimeError) as exc:
        why = f"skipped: {exc if not isinstance(exc, ImportError) else 'redis-py missing (the redis extra)'}"
        return [make_row("B10", "remote fetch vs raw redis-py GETs", 0.0, None, "MiB/s", None, INFO, {}, why),
                make_row("B10", "reused prompt on host B vs computing it", 0.0, None, "ms", None, INFO, {}, why)]
    try:
        rows = [_fetch_row(ctx, server.url, name, geom)
                for name, geom in (QUICK_GEOMS if ctx.quick else FETCH_GEOMS).items()]
        rows.append(_reuse_row(ctx, server.url))
        return rows
    finally:
        server.stop()


def _prompt(ctx: Ctx, tokens: int) -> np.ndarray:
    return ctx.np_rng("b10-prompt").integers(0, 50000, tokens, dtype=np.int64)


def _publish(ctx: Ctx, url: str, geom: Geometry, tokens: np.ndarray) -> None:
    """Host A: compute-free prefill of ``tokens``, committed and published (the close drains)."""
    from ..remote import RemoteConfig

    rng = ctx.np_rng("b10-kv")
    pool_pages = len(tokens) // geom.page_size + 8
    with open_store(ctx.path("b10-a"), geom, pool_pages, durability="nosync", model=MODEL,
                    remote=RemoteConfig(url, close_timeout=120.0, publish_timeout=5.0)) as store:
        store.create("a")
        chunk = 256
        for low in range(0, len(tokens), chunk):
            count = min(chunk, len(tokens) - low)
            shape = (geom.layers, count, geom.kv_heads, geom.head_dim)
            k = rng.standard_normal(shape, np.float32).astype(geom.np_dtype)
            store.append("a", k, k, tokens=tokens[low:low + count])
            store.commit()


def _fetch_row(ctx: Ctx, url: str, name: str, geom: Geometry) -> dict[str, Any]:
    import redis

    from ..remote import RemoteConfig
    from ..remote.record import chain

    client = redis.Redis.from_url(url)
    client.flushdb()
    pages = 16 if ctx.quick else max(16, min(256, (128 << 20) // geom.page_nbytes))
    tokens = _prompt(ctx, pages * geom.page_size)
    _publish(ctx, url, geom, tokens)
    # Generous timeouts: a bench measures throughput, not the fault path.
    remote = RemoteConfig(url, op_timeout=5.0, connect_timeout=5.0)
    path = ctx.path("b10-b")
    store = open_store(path, geom, pages + 8, durability="nosync", model=MODEL, remote=remote)
    tier = store._remote
    keys = [tier.key(digest) for digest in chain(tier.salt, tokens.astype("<u4"), geom.page_size, pages)]
    value_bytes = sum(client.strlen(key) for key in keys)
    raw = redis.Redis.from_url(url, socket_timeout=5.0)

    def fetch() -> float:
        started = time.perf_counter()
        got = store.lookup(tokens)
        seconds = time.perf_counter() - started
        assert got == len(tokens), f"fetched {got} of {len(tokens)} tokens"
        store.clear_cache()  # the next round fetches again
        return seconds

    def raw_gets() -> float:
        started = time.perf_counter()
        pipe = raw.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = pipe.execute()
        seconds = time.perf_counter() - started
        assert all(value is not None for value in values)
        return seconds

    try:
        fetch(), raw_gets()  # warm both connections
        pairs = interleave(fetch, raw_gets, 3 if ctx.quick else 7)
        stats = store.stats()
    finally:
        store.close()
        client.close()
        raw.close()
    mib = value_bytes / float(1 << 20)
    ratio = 1.0 / pairs.ratio  # throughput: the median of raw GET time over ours
    params = {**geom_params(geom), "geometry": name, "pages": pages, "value_bytes": value_bytes}
    return make_row("B10", f"remote fetch vs raw redis-py GETs ({name}, {geom.page_nbytes >> 10} KiB pages)",
                    mib / pairs.a_median, mib / pairs.b_median, "MiB/s", ratio, Target(">= 0.8", ">=", 0.8),
                    params, "lookup() of a prompt held only remotely (fetch, verify, place in the pool) vs "
                    "one pipeline of GETs of the same keys, same process, interleaved",
                    {"fetch_ms_median": pairs.a_median * 1e3, "raw_ms_median": pairs.b_median * 1e3,
                     "remote_fetched": stats["remote_fetched"], "remote_rejected": stats["remote_rejected"],
                     "remote_fetch_ms_p50": stats["remote_fetch_ms_p50"]})


def _reuse_row(ctx: Ctx, url: str) -> dict[str, Any]:
    import redis

    from ..remote import RemoteConfig

    geom = QUICK_GEOMS["quick-32k"] if ctx.quick else FETCH_GEOMS["1b"]
    count = 128 if ctx.quick else 2000
    tokens = _prompt(ctx, count)
    redis.Redis.from_url(url).flushdb()
    _publish(ctx, url, geom, tokens)
    store = open_store(ctx.path("b10-host-b"), geom, count // geom.page_size + 8, durability="nosync",
                       model=MODEL, remote=RemoteConfig(url, op_timeout=5.0, connect_timeout=5.0))
    reused: list[int] = []

    def reuse() -> float:
        started = time.perf_counter()
        reused.append(store.create("b", tokens=tokens))
        seconds = time.perf_counter() - started
        store.drop("b")
        store.clear_cache()
        return seconds

    weights = _Layer(geom, ctx.np_rng("b10-weights"))

    def compute() -> float:
        return weights.prefill_seconds(len(tokens))

    try:
        reuse()
        pairs = interleave(reuse, compute, 2 if ctx.quick else 3)
    finally:
        store.close()
    params = {**geom_params(geom), "prompt_tokens": count, "hidden": weights.hidden, "mlp": weights.mlp}
    return make_row("B10", "reused prompt on host B vs computing it", pairs.a_median * 1e3,
                    pairs.b_median * 1e3, "ms", pairs.ratio, INFO, params,
                    "create(tokens=prompt) on a store holding none of it (every full page from Redis) vs "
                    "a numpy float32 forward of the prompt at the geometry's width on this CPU (one layer "
                    "timed, times the layers)", {"reused_tokens": reused[-1]})


class _Layer:
    """One decoder layer's weights at a geometry's width (4 query heads per KV head, MLP 3.5x)."""

    def __init__(self, geom: Geometry, rng: np.random.Generator) -> None:
        self.geom = geom
        self.heads = 4 * geom.kv_heads
        self.hidden = self.heads * geom.head_dim
        self.mlp = int(3.5 * self.hidden)
        kv_width = geom.kv_heads * geom.head_dim
        scale = 1.0 / np.sqrt(self.hidden)

        def weight(rows: int, cols: int) -> np.ndarray:
            out: np.ndarray = rng.standard_normal((rows, cols), np.float32) * np.float32(scale)
            return out

        self.wq, self.wk, self.wv = weight(self.hidden, self.hidden), weight(self.hidden, kv_width), \
            weight(self.hidden, kv_width)
        self.wo = weight(self.hidden, self.hidden)
        self.up, self.gate, self.down = weight(self.hidden, self.mlp), weight(self.hidden, self.mlp), \
            weight(self.mlp, self.hidden)

    def prefill_seconds(self, tokens: int) -> float:
        """Seconds a forward over ``tokens`` takes: one layer timed, times the layers."""
        geom = self.geom
        x = np.random.default_rng(0).standard_normal((tokens, self.hidden), np.float32)
        started = time.perf_counter()
        q = (x @ self.wq).reshape(tokens, self.heads, geom.head_dim)
        k = (x @ self.wk).reshape(tokens, geom.kv_heads, geom.head_dim)
        v = (x @ self.wv).reshape(tokens, geom.kv_heads, geom.head_dim)
        group = self.heads // geom.kv_heads
        mask = np.triu(np.full((tokens, tokens), -np.inf, np.float32), 1)
        out = np.empty_like(q)
        for head in range(self.heads):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(geom.head_dim) + mask
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, head] = (scores / scores.sum(axis=1, keepdims=True)) @ v[:, head // group]
        h = x + out.reshape(tokens, self.hidden) @ self.wo
        gate = h @ self.gate
        h = h + ((gate / (1 + np.exp(-gate))) * (h @ self.up)) @ self.down
        seconds = time.perf_counter() - started
        assert np.isfinite(h).all()
        return seconds * geom.layers
