"""Helpers of the prefix-reuse tests (tests/test_prefix.py).

* ``GEOM``: 2 layers, 2 KV heads, head_dim 4, 8 tokens a page, float32 (1 KiB pages).
* ``token_kv(ids, start)``: deterministic K/V of tokens ``ids`` at positions ``start...``;
  every value is a multiple of 1/512 in [-1, 1), exact in float16 and float32, so the
  expected bytes are regenerated, never stored. ``model`` keys the content (KV of another
  model differs); ``positional=False`` makes it a function of the token id alone.
* ``Stores``: ``support.Stores`` with this geometry and a 16-slot pool.
* ``run_child_and_kill(body)``: run ``body`` in a forked child that acks over a pipe, then
  SIGKILL it; the parent never holds a store across the fork.
"""

from __future__ import annotations

import functools
import os
import signal
import traceback
import zlib
from typing import Any, Callable

import numpy as np

import pagedkv
import support
from pagedkv import Geometry

GEOM = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=8, dtype="float32")
PS = GEOM.page_size

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_M3 = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def _elements(per_token: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _mix(np.arange(1, per_token + 1, dtype=np.uint64) * _M3)


def token_kv(token_ids: Any, start: int = 0, geom: Geometry = GEOM, model: str = "",
             positional: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """K and V, each ``(layers, n, kv_heads, head_dim)``, of ``token_ids`` at positions ``start...``."""
    ids = np.asarray(token_ids, np.int64).astype(np.uint64)
    n = len(ids)
    key = np.uint64(zlib.crc32(model.encode()) + 1)
    with np.errstate(over="ignore"):
        token = _mix(ids * _M3 + key)
        if positional:
            token = _mix(token ^ (np.arange(start, start + n, dtype=np.uint64) * _M2 + _M1))
        bits = _mix(token[:, None] ^ _elements(2 * geom.layers * geom.kv_heads * geom.head_dim)[None, :])
    values = ((bits >> np.uint64(54)).astype(np.float32) / 512.0 - 1.0).astype(geom.np_dtype)
    arr = values.reshape(n, geom.layers, 2, geom.kv_heads, geom.head_dim)
    return (np.ascontiguousarray(arr[:, :, 0].transpose(1, 0, 2, 3)),
            np.ascontiguousarray(arr[:, :, 1].transpose(1, 0, 2, 3)))


def prompt(rng: np.random.Generator, n: int, vocab: int = 50_000) -> np.ndarray:
    """``n`` random token ids."""
    return rng.integers(0, vocab, n, dtype=np.int64)


def extend(store: pagedkv.KVStore, seq: Any, ids: Any, start: int | None = None, **kv_args: Any) -> None:
    """Append the K/V of ``ids`` (at the sequence's next positions) with their token ids."""
    ids = np.asarray(ids, np.int64)
    if len(ids):
        start = store.length(seq) if start is None else start
        store.append(seq, *token_kv(ids, start, store.geometry, **kv_args), tokens=ids)


def prefill(store: pagedkv.KVStore, seq: Any, ids: Any, **kv_args: Any) -> int:
    """``create(seq, tokens=ids)``, then append what was not reused; return the reused count."""
    reused = store.create(seq, tokens=ids)
    extend(store, seq, np.asarray(ids)[reused:], reused, **kv_args)
    return reused


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_holds(store: pagedkv.KVStore, seq: Any, ids: Any, start: int = 0, stop: int | None = None,
                 **kv_args: Any) -> None:
    """``seq`` holds exactly the K/V of token ids ``ids`` (all of it, or ``[start, stop)``), bit for bit."""
    ids = np.asarray(ids, np.int64)
    stop = len(ids) if stop is None else stop
    if start == 0 and stop == len(ids):
        assert store.length(seq) == len(ids), f"{seq!r}: length {store.length(seq)}, expected {len(ids)}"
    k, v = store.read(seq, start, stop)
    ek, ev = token_kv(ids[start:stop], start, store.geometry, **kv_args)
    for name, got, want in (("K", k, ek), ("V", v, ev)):
        if not same_bytes(got, want):
            bad = np.flatnonzero((got != want).any(axis=(0, 2, 3)))
            raise AssertionError(f"{name} of {seq!r}[{start}:{stop}] differs at tokens "
                                 f"{(bad + start).tolist()[:10]}")


class Stores(support.Stores):
    """``support.Stores`` with this module's geometry and a 16-slot pool by default."""

    def open(self, name: str = "store", geom: Geometry | None = GEOM, pool_pages: int | None = 16,
             **kwargs: Any) -> pagedkv.KVStore:
        return super().open(name, geom, pool_pages, **kwargs)


def run_child_and_kill(body: Callable[[Callable[[str], None]], None]) -> list[str]:
    """Fork; the child runs ``body(ack)`` then blocks until the parent SIGKILLs it.

    ``ack(text)`` sends one line to the parent; the acks are returned. The child
    never returns into pytest: any exception is sent over the pipe and fails the test.
    """
    ack_r, ack_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no atexit, no output
        code = 3
        try:
            os.close(ack_r)
            os.close(hold_w)

            def ack(text: str) -> None:
                os.write(ack_w, text.replace("\n", " ").encode() + b"\n")

            body(ack)
            ack("ready")
            os.read(hold_r, 1)  # blocks: the parent keeps hold_w open until the kill
        except BaseException:
            try:
                os.write(ack_w, b"error " + traceback.format_exc()[-3000:].replace("\n", " | ").encode() + b"\n")
            except BaseException:
                pass
        finally:
            os._exit(code)
    os.close(ack_w)
    os.close(hold_r)
    buf = b""
    try:
        while not buf.endswith(b"ready\n") and b"error " not in buf:
            chunk = os.read(ack_r, 65536)
            if not chunk:
                break
            buf += chunk
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(ack_r)
        os.close(hold_w)
    lines = buf.decode(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error ")]
    assert not errors, errors[0]
    assert lines and lines[-1] == "ready", f"the child died before it was ready: {lines}"
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return lines[:-1]


def index_problems(store: pagedkv.KVStore) -> list[str]:
    """White-box: every hash -> page entry of the prefix index names a live, hashed page with that hash."""
    from pagedkv.pages.manager import HAS_TOKENS, HASHED

    mgr = store._mgr
    problems = []
    for pid in mgr.prefix.pages().tolist():
        digest = bytes(mgr.hash[pid])
        if not mgr.prefix.holds(digest, pid):
            problems.append(f"page row {pid} is indexed off its hash's probe path")
        if not mgr.live[pid]:
            problems.append(f"index entry {digest.hex()} names freed row {pid}")
        elif bytes(mgr.hash[pid]) != digest or not mgr.flags[pid] & HASHED:
            problems.append(f"index entry {digest.hex()} names page {int(mgr.uid[pid])} with another hash")
        elif not mgr.flags[pid] & HAS_TOKENS or mgr.fill[pid] != store.geometry.page_size:
            problems.append(f"indexed page {int(mgr.uid[pid])} lacks token ids or is not full")
    return problems
