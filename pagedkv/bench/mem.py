"""B8: anonymous memory per page of metadata, measured in a fresh subprocess.

The parent runs ``python -c 'from pagedkv.bench.mem import child; child()' ARGS``
twice per variant: once under tracemalloc (Python objects and numpy buffers,
precise), once without it (RssAnon from /proc, which also sees C allocations
such as LMDB's, but tracemalloc's own bookkeeping would inflate it). The pool and
the LMDB map are file mappings, so neither counts as anonymous memory.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import numpy as np

from .util import Ctx, Target, geom_params, make_row
from ..geometry import Geometry

GEOM = Geometry(layers=1, kv_heads=1, head_dim=1, page_size=16, dtype="float16")


def _rss_anon() -> int | None:
    """This process's anonymous resident bytes (Linux), else None."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _trimmed(rss0: int | None) -> int | None:
    """Anonymous growth after glibc hands free heap memory back (None off glibc).

    The difference to the plain figure is memory the allocator keeps after
    frees (LMDB's dirty pages of large commits, replaced directory columns),
    not metadata that is still referenced.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    rss = _rss_anon()
    return None if rss is None or rss0 is None else rss - rss0


def child() -> None:
    """Build a store with the requested metadata and print its memory cost as JSON (subprocess side).

    Sequences are appended in ten chunks with a commit after each (a server's
    rhythm); memory is sampled after every commit, so the worst point (just after
    a directory column doubled) is seen as well as the end.

    Code is not metadata: pagedkv is imported before measuring, and so is what
    its first use imports lazily (numpy loads ``numpy.ma``, about 1.4 MB, on the
    first call of its set routines). A scratch store run through the same
    operations first loads it; what that warm-up leaves is reported on its own.
    """
    args = json.loads(sys.argv[1])
    trace = args["trace"]
    import tracemalloc

    import pagedkv

    seqs, per_seq = args["sequences"], args["tokens"] // args["sequences"]
    pages_per_seq = -(-per_seq // GEOM.page_size)
    k = np.zeros((GEOM.layers, per_seq, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
    gc.collect()
    if trace:
        tracemalloc.start()
    rss0 = _rss_anon()
    scratch = args["path"] + "-warm-up"
    _warm_up(pagedkv, scratch, k, args["token_ids"])
    shutil.rmtree(scratch)
    gc.collect()
    if trace:
        warm = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()  # the measurement's traces start afresh
        tracemalloc.start()
    else:
        rss = _rss_anon()
        warm = -1 if rss is None or rss0 is None else rss - rss0
        _trimmed(None)  # glibc hands back what the warm-up freed, so the store's growth is not read low
    rss0 = _rss_anon()
    store = pagedkv.open(args["path"], GEOM, pool_pages=args["pool_pages"], durability="nosync")
    samples: list[tuple[int, int]] = []  # (pages, bytes) after each commit
    chunk = max(1, seqs // 10)
    for seq in range(seqs):
        store.create(seq)
        ids = np.arange(seq * per_seq, (seq + 1) * per_seq) if args["token_ids"] else None
        store.append(seq, k, k, tokens=ids)
        if (seq + 1) % chunk == 0 or seq + 1 == seqs:
            store.commit()
            gc.collect()
            if trace:
                used = tracemalloc.get_traced_memory()[0]
            else:
                rss = _rss_anon()
                used = -1 if rss is None or rss0 is None else rss - rss0
            samples.append(((seq + 1) * pages_per_seq, used))
    pages, used = samples[-1]
    second_half = [size / count for count, size in samples if count * 2 >= pages]
    out: dict[str, Any] = {"pages": pages, "sequences": seqs, "tokens": seqs * per_seq,
                           "bytes": None if used < 0 else used,
                           "worst_bytes_per_page": None if used < 0 else max(second_half),
                           "spilled_pages": store.stats()["spilled_pages"],
                           "warm_up_bytes": None if warm < 0 else warm}
    if trace:
        out["peak_bytes"] = tracemalloc.get_traced_memory()[1]
    else:
        out["trimmed_bytes"] = _trimmed(rss0)
    store.close()
    print(json.dumps(out))


def _warm_up(pagedkv: Any, path: str, k: np.ndarray, token_ids: bool) -> None:
    """Run a scratch store through the measured operations (open, append, commit, close, reopen).

    What they import on first use is then loaded before the measurement starts.
    """
    store = pagedkv.open(path, GEOM, pool_pages=64, durability="nosync")
    for seq in range(2):
        store.create(seq)
        store.append(seq, k, k, tokens=np.arange(len(k[0])) + seq if token_ids else None)
        store.commit()
    store.close()
    pagedkv.open(path, GEOM, pool_pages=64, durability="nosync").close()


def _spawn(args: dict[str, Any]) -> dict[str, Any]:
    import pagedkv

    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedkv.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", "from pagedkv.bench.mem import child; child()",
                           json.dumps(args)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"B8 child failed: {proc.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def b8_memory(ctx: Ctx) -> list[dict[str, Any]]:
    """B8: anonymous bytes per page with 1M tokens of metadata (with and without token ids)."""
    tokens, seqs = (100_000, 100) if ctx.quick else (1_000_000, 1_000)
    # A round pool (not a power-of-two fraction of the pages), so the directory's
    # capacity doubling lands where it would for a user; most pages are spilled.
    pool = tokens // 100
    rows = []
    for token_ids in (False, True):
        runs = {}
        for trace in (True, False):
            path = ctx.path(f"b8-{token_ids}-{trace}")
            runs[trace] = _spawn({"path": path, "tokens": tokens, "sequences": seqs, "pool_pages": pool,
                                  "token_ids": token_ids, "trace": trace})
        traced, untraced = runs[True], runs[False]
        pages = traced["pages"]
        rss = untraced["bytes"]
        metrics = {"traced_bytes": traced["bytes"],
                   "worst_traced_bytes_per_page": traced["worst_bytes_per_page"],
                   "traced_peak_bytes_per_page": traced["peak_bytes"] / pages,
                   "rss_anon_bytes_per_page": None if rss is None else rss / pages,
                   "worst_rss_anon_bytes_per_page": untraced["worst_bytes_per_page"],
                   "rss_anon_after_trim_bytes_per_page":
                       None if untraced["trimmed_bytes"] is None else untraced["trimmed_bytes"] / pages,
                   "spilled_pages": traced["spilled_pages"],
                   "warm_up_traced_bytes": traced["warm_up_bytes"],
                   "warm_up_rss_anon_bytes": untraced["warm_up_bytes"]}
        params = {**geom_params(GEOM), "tokens": traced["tokens"], "pages": pages, "sequences": seqs,
                  "pool_pages": pool, "token_ids": token_ids}
        rows.append(make_row("B8", f"metadata memory{' with token ids' if token_ids else ''}",
                             traced["bytes"] / pages, None, "B/page", None,
                             Target("<= 150 B/page", "<=", 150.0, on="pagedkv"), params,
                             "tracemalloc growth (numpy buffers included) from before open to after the "
                             "last commit, fresh subprocess, after a scratch store's warm-up loaded "
                             "what first use imports (warm_up_*: what it left); worst = max over the commits past half "
                             "way; RssAnon of an untraced run in metrics", metrics))
    return rows
