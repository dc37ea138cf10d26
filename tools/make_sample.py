"""Build ``data/sample-v3.kv``: the golden store of format version 3 (LRU stamps as a base and a log).

``data/sample.kv`` and ``data/sample-v2.kv``, built by this script under format
versions 1 and 2, are frozen: every later pagedkv must read all three.

A small store (well under 1 MB on disk) with deterministic K/V content that
touches every on-disk structure: a prompt whose full pages carry token ids and
prefix hashes, a chat that reused them through ``create(tokens=...)``, a chat
forked from the prompt (copying the shared partial page on write), a longer
document under an int id (no token ids), an empty sequence, a dropped chat
whose hashed pages stay as cache-only pages, and a model fingerprint. The pool
holds 8 pages, so most pages are spilled to LMDB. Every later pagedkv must
still read it bit-exact (tests regenerate the expected bytes from ``SEQUENCES``
with ``pagedkv.demo.kvgen``).

Run from the repository root: ``python tools/make_sample.py [--force]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import pagedkv
from pagedkv.storage.files import disk_usage
from pagedkv.demo.kvgen import Request, check_read, expected_kv

SEED = 2024
MODEL = "pagedkv-sample-model"
GEOMETRY = pagedkv.PRESETS["tiny"]  # 2 layers x 2 kv heads x 16 head_dim, 16 tokens/page, float16
POOL_PAGES = 8
MAP_SIZE = 1 << 20  # LMDB reserves the map as address space; the file holds only used pages
# id -> (origin, first position) segments: the origin seeds the K/V and token ids of a span.
SEQUENCES: dict[str | int, list[tuple[int, int]]] = {
    "prompt": [(1, 0)],
    "chat-1": [(1, 0), (2, 40)],
    "chat-2": [(1, 0), (3, 40)],
    7: [(4, 0)],
    "empty": [(5, 0)],
}
LENGTHS: dict[str | int, int] = {"prompt": 40, "chat-1": 70, "chat-2": 45, 7: 100, "empty": 0}
DROPPED = Request("gone", [(6, 0)], length=48)  # dropped: its three full pages stay cached
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "sample-v3.kv")


def requests() -> list[Request]:
    """The sample's sequences as ``kvgen.Request``s (for regenerating the expected K/V)."""
    return [Request(seq_id, list(segments), length=LENGTHS[seq_id]) for seq_id, segments in SEQUENCES.items()]


def _append(store: pagedkv.KVStore, req: Request, start: int, with_ids: bool = True) -> None:
    ids = req.token_ids(SEED, start, req.length) if with_ids else None
    store.append(req.seq_id, *expected_kv(GEOMETRY, SEED, req, start, req.length), tokens=ids)


def build(path: str) -> dict[str, float]:
    """Create the sample store at ``path`` (which must not exist); return its final stats."""
    reqs = {req.seq_id: req for req in requests()}
    with pagedkv.open(path, GEOMETRY, pool_pages=POOL_PAGES, map_size=MAP_SIZE, model=MODEL) as store:
        store.create("prompt")
        _append(store, reqs["prompt"], 0)
        chat = reqs["chat-1"]
        reused = store.create("chat-1", tokens=chat.token_ids(SEED, 0, chat.length))
        assert reused == 32, reused  # the prompt's two full pages
        _append(store, chat, reused)
        store.fork("prompt", "chat-2")
        _append(store, reqs["chat-2"], 40)  # copy-on-write of the shared third page
        store.commit()
        store.create(7)
        _append(store, reqs[7], 0, with_ids=False)  # more pages than the pool: earlier ones spill
        store.create(DROPPED.seq_id)
        _append(store, DROPPED, 0)
        store.drop(DROPPED.seq_id)
        store.create("empty")
        store.commit()
        for req in reqs.values():
            if req.length:
                check_read(store, GEOMETRY, SEED, req)
        if store.lookup(DROPPED.token_ids(SEED, 0, DROPPED.length)) != DROPPED.length:
            raise SystemExit("the dropped chat's pages are not cached")
        problems = store.check()
        if problems:
            raise SystemExit(f"sample store is inconsistent: {problems}")
        store.commit()
        store.read(7, 0, 1)  # one slot used: the closing commit writes it as a delta of the LRU log
        stats = store.stats()
    with pagedkv.open(path, readonly=True) as store:
        if store._mgr.stamp_log.next <= store._mgr.stamp_log.first:
            raise SystemExit("the sample store's LRU log holds no delta")
    return stats


def main(argv: list[str] | None = None) -> int:
    """Rebuild the sample store; refuses to replace anything but an earlier sample."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.normpath(DEFAULT_OUT), help="where to build it")
    parser.add_argument("--force", action="store_true", help="replace an existing sample store")
    args = parser.parse_args(argv)
    if os.path.lexists(args.out):
        if not args.force:
            print(f"{args.out} exists; pass --force to rebuild it", file=sys.stderr)
            return 1
        if not pagedkv.opening.is_store(args.out):
            print(f"{args.out} is not a pagedkv store; not replacing it", file=sys.stderr)
            return 1
        shutil.rmtree(args.out)
    stats = build(args.out)
    size = disk_usage(args.out)
    print(f"built {args.out}: {int(stats['sequences'])} sequences, {int(stats['tokens'])} tokens, "
          f"{int(stats['pages'])} pages ({int(stats['spilled_pages'])} spilled, "
          f"{int(stats['cached_pages'])} cached only), {size:,} bytes on disk")
    if size >= 1 << 20:
        print("warning: the sample is over 1 MiB on disk", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
