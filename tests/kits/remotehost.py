"""One "host" of the remote-tier tests, run as its own process: ``python remotehost.py ROLE JSON``.

``prefill``: open a store, append a prompt's K/V with its token ids, commit, close
(the close drains the publisher). ``reuse``: open another store, ``create`` a
sequence from the prompt, compare every reused byte with the K/V the prefilling
host computed (regenerated from the seed, never transferred), then ask again and
report whether the second request was served locally. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import pagedkv

from tests.kits.content import kv, same_bits  # the repository root is on PYTHONPATH (test_remote.py)
from tests.kits.store import GEOM


def prompt_ids(count: int, seed: int) -> np.ndarray:
    """A deterministic prompt of ``count`` token ids."""
    return np.random.default_rng(seed).integers(0, 50000, count, dtype=np.int64)


def prefill(args: dict) -> dict:
    """Host A: compute (here: generate) the prompt's K/V and commit it."""
    tokens = prompt_ids(args["tokens"], args["seed"])
    with pagedkv.open(args["path"], GEOM, pool_pages=args.get("pool_pages", 64), model=args["model"],
                      remote=pagedkv.RemoteConfig(args["url"], close_timeout=30.0)) as store:
        store.create("prompt")
        k, v = kv(args["seed"], "prompt", 0, len(tokens))
        store.append("prompt", k, v, tokens=tokens)
        store.commit()
        counters = store._remote.counters  # read after the close, which drains the publisher
    return dict(counters.snapshot())


def reuse(args: dict) -> dict:
    """Host B: reuse the prompt from the remote tier, check the bytes, ask again."""
    tokens = prompt_ids(args["tokens"], args["seed"])
    with pagedkv.open(args["path"], GEOM, pool_pages=args.get("pool_pages", 64), model=args["model"],
                      remote=args["url"]) as store:
        started = time.perf_counter()
        reused = store.create("first", tokens=tokens)
        seconds = time.perf_counter() - started
        k, v = store.read("first")
        want_k, want_v = kv(args["seed"], "prompt", 0, reused)
        exact = same_bits(k, want_k) and same_bits(v, want_v)
        fetched = store.stats()["remote_fetched"]
        again = store.create("second", tokens=tokens)
        after = store.stats()
        problems = store.check()
    return {"reused": reused, "exact": exact, "fetched": fetched, "again": again,
            "fetched_after": after["remote_fetched"], "round_trips_after": after["remote_fetch_misses"],
            "seconds": seconds, "problems": problems,
            "stats": {k: v for k, v in after.items() if k.startswith("remote_")}}


def main() -> None:
    """Run the role in argv[1] with the JSON arguments in argv[2]; print the result as JSON."""
    role, args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"prefill": prefill, "reuse": reuse}[role](args)))


if __name__ == "__main__":
    main()
