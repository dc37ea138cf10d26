"""A mutation campaign over pagedkv stores of known content: damage is a typed error, never wrong bytes.

For each spill codec a base store is built whose content is a function of (seed, sequence,
position) (``tests.kits.content.kv``): sequences with token ids sharing prefix pages, a fork, the cached
pages of a dropped sequence, most pages spilled, several commits. Each copy of it is damaged
one way (a *kind*: bit flips, byte runs, truncation, extension, swapped data.mdb pages, flips
aimed at LMDB's structure, LMDB values exchanged, moved, deleted or rolled back to an earlier
commit's, pool.bin header damage, flips inside metadata records),
then checked in forked children, read-only and as a writer: open, read every sequence (and
its pages), look every prompt up, ``check()``, then (writer) append, create from the cached
prompts, commit, close, reopen and read again. Each copy gets the worst outcome of its runs:

    OK       every answer right, nothing reported
    STALE    the store reads back exactly as an earlier commit (LMDB took its older meta page)
    TYPED    a ``pagedkv.PagedKVError`` or damage listed by ``check()``; every byte returned right
    LOST     a committed sequence, tokens or cached prefix vanished with no error or damage reported
    WRONG    bytes (or a length, or a prefix hit) that differ from the committed ones, no error
    UNTYPED  an exception that is not a ``PagedKVError``
    CRASH    a child died by a signal (SIGABRT, SIGSEGV, SIGBUS...)
    HANG     a child ran past ``--timeout``

The bar is 0 WRONG, UNTYPED, CRASH and HANG; the exit status is 1 when it is not met (with
``--strict``, LOST fails it too). Expected bytes are regenerated from the seed, never stored;
for the lossy int8 codec a page may also read as the undamaged store returned it.

    python -m tools.mutate                          # 2000 copies per codec, 2 jobs
    python -m tools.mutate --codec raw --copies 300 --seed 7
    python -m tools.mutate --kind mdb-flip,lmdb-swap --keep /tmp/failing
    python -m tools.mutate --replay /tmp/failing/raw-000123    # one kept copy again, every note

Copies that miss the bar (and LOST ones) are kept under ``--keep`` as ``<codec>-<index>/``:
``store/`` is the damaged copy as it was before any check touched it, ``case.json`` the seed,
kind, damage and outcome. The seed is printed; ``PAGEDKV_SEED`` sets it.

It runs as a module from the repository root (``python -m tools.mutate``), so that it imports
the test suite's kits (``tests.kits``: content, model, files, child processes) by their package
name, as the tests do, and no path is patched; ``tests/test_damage_campaign.py`` imports it
as ``tools.mutate``. Run as a file (``python tools/mutate.py``) it says so and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

if not __package__:  # run as a file: the kits are importable only from the repository root
    print("run it from the repository root as a module: python -m tools.mutate [options]", file=sys.stderr)
    sys.exit(2)

import msgpack
import numpy as np

import pagedkv
from pagedkv import Geometry, PagedKVError
from pagedkv.pages import lrulog
from pagedkv.storage.codecs import CODECS, LOSSY

from tests.kits import files
from tests.kits.child import Channel, Child, describe
from tests.kits.content import get_seed, kv
from tests.kits.faults import Tally
from tests.kits.files import DATA_MDB, DBS, HEADER_FIELDS, HEADER_NBYTES, POOL
from tests.kits.lmdbfile import META_END, PSIZE, mdb_pages
from tests.kits.model import Model

# 2 KiB pages of 8 tokens: a raw spill record outgrows an LMDB leaf node and takes an overflow
# page, an int8 one stays inline, so both layouts are in every data.mdb.
GEOM = Geometry(layers=2, kv_heads=2, head_dim=8, page_size=8, dtype="float32")
POOL_PAGES = 8
MODEL_NAME = "pagedkv-mutation"
MDB_PAGE = PSIZE

OUTCOMES = ("OK", "STALE", "TYPED", "LOST", "WRONG", "UNTYPED", "CRASH", "HANG")
BAR = ("WRONG", "UNTYPED", "CRASH", "HANG")
_RANK = {name: rank for rank, name in enumerate(OUTCOMES)}

# Tokens appended to each base sequence by the writer's second phase (with ids where it had them).
PHASE2_APPENDS = {"a": 5, "b": 4, "b2": 9, "c": 2, "c2": 6, "d": 7, "e": 11}


# -- the base store ------------------------------------------------------------------------

class Content(Model):
    """``kits.model.Model`` whose content may be kept finite, for a lossy codec to quantise.

    ``kits.content.kv`` gives raw bits, so a page of 2 KiB almost always holds a NaN or an
    Inf, and int8 falls back to zstd for such pages. With ``finite``, every content key but
    those of sequence ``raw_seq`` has the top exponent bit of each value cleared (|x| < 2,
    never NaN or Inf): still a function of (seed, key, position), so int8 quantises most
    pages while ``raw_seq``'s pages keep the zstd fallback in play.
    """

    def __init__(self, seed: int, geom: Geometry, finite: bool = False, raw_seq: str = "e") -> None:
        super().__init__(seed, geom)
        self.finite, self.raw_seq = finite, raw_seq

    def content(self, key: Any, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of tokens [start, start + n) of content key ``key``, finite unless ``raw_seq``'s."""
        raw = not self.finite or (isinstance(key, tuple) and key and key[0] == self.raw_seq)
        return kv(self.seed, key, start, n, self.geom, finite=not raw)


@dataclass
class Observation:
    """What an undamaged copy answered: prefix lookups, probe reuse and (lossy codecs) read bytes."""

    lookups: dict[tuple[int, str], int] = field(default_factory=dict)
    probes: dict[str, int] = field(default_factory=dict)
    reads: dict[tuple[int, str, str], tuple[bytes, bytes]] = field(default_factory=dict)


@dataclass
class Base:
    """A closed store of known content and everything a check of a damaged copy compares with."""

    codec: str
    path: str
    seed: int
    model: Content  # the committed content, as segments of (content key, start, n)
    states: list[dict[str, int]]  # {sequence: length} after each commit, oldest first
    ids: dict[str, list[int]]  # token ids of the sequences that have them
    prompts: dict[str, list[int]]  # what is looked up, and created from in the writer phase
    prompt_segs: dict[str, list[tuple[Any, int, int]]]  # the content the prompt's cached pages hold
    values: dict[str, dict[bytes, bytes]]  # every LMDB record, per database (to swap and flip)
    sizes: dict[str, int]  # bytes of pool.bin and data.mdb
    mdb: bytes = b""  # data.mdb as built (to aim flips at the pages LMDB's structure lives in)
    history: list[dict[str, dict[bytes, bytes]]] = field(default_factory=list)  # records after each commit
    reference: dict[str, Observation] = field(default_factory=dict)  # per mode, from an undamaged copy

    @property
    def lossy(self) -> bool:
        """Whether a page may read back other than bit-exact (within the codec's bound)."""
        return self.codec in LOSSY


class _Builder:
    """Drives a store and its model together, tracking token ids so prefix reuse has known content."""

    def __init__(self, store: pagedkv.KVStore, model: Content, rng: np.random.Generator) -> None:
        self.store, self.model, self.rng = store, model, rng
        self.ids: dict[str, list[int]] = {}
        self.gone: dict[str, tuple[list[int], list[tuple[Any, int, int]]]] = {}  # dropped sequences
        self.order: list[str] = []

    def fresh(self, n: int) -> list[int]:
        """``n`` token ids no prompt has used (with overwhelming likelihood)."""
        return self.rng.integers(1000, 60000, n).tolist()

    def source(self, ids: list[int]) -> list[tuple[Any, int, int]]:
        """Segments of the earliest sequence (live or dropped) sharing the longest prefix with ``ids``."""
        best, best_len = [], 0
        for seq in self.order:
            known, segs = (self.ids[seq], self.model.segs[seq]) if seq in self.ids else \
                self.gone.get(seq, (None, None))
            if known is None:
                continue
            common = 0
            for x, y in zip(known, ids):
                if x != y:
                    break
                common += 1
            if common > best_len:
                best, best_len = list(segs), common
        return best

    def create(self, seq: str, ids: list[int] | None = None) -> None:
        """Create ``seq``; with ``ids``, from the cached prefix, then append the rest of the prompt."""
        reused = self.store.create(seq, tokens=ids)
        self.model.create(seq)
        self.order.append(seq)
        if ids is None:
            return
        self.ids[seq] = []
        if reused:
            self.model.segs[seq] = cut_segments(self.source(ids), reused)
            self.model.lens[seq] = reused
            self.ids[seq] = ids[:reused]
        self.append(seq, len(ids) - reused, ids[reused:])

    def append(self, seq: str, n: int, ids: list[int] | None = None) -> None:
        """Append ``n`` tokens of the model's next content (with their ids, if known)."""
        k, v = self.model.next_kv(seq, n)
        self.store.append(seq, k, v, tokens=ids)
        if ids is not None and seq in self.ids:
            self.ids[seq] = self.ids[seq] + list(ids)
        else:
            self.ids.pop(seq, None)

    def fork(self, src: str, dst: str) -> None:
        """Fork ``src`` into ``dst`` in the store and the model."""
        self.store.fork(src, dst)
        self.model.fork(src, dst)
        self.order.append(dst)
        if src in self.ids:
            self.ids[dst] = list(self.ids[src])

    def drop(self, seq: str) -> None:
        """Drop ``seq``, remembering its ids and content: its full pages stay as cache."""
        self.store.drop(seq)
        self.gone[seq] = (self.ids.pop(seq, []), list(self.model.segs[seq]))
        self.model.drop(seq)


def cut_segments(segs: list[tuple[Any, int, int]], n: int) -> list[tuple[Any, int, int]]:
    """The segments covering tokens [0, n) of ``segs``."""
    return [(key, start, min(count, n - start)) for key, start, count in segs if start < n]


def build_base(path: str, codec: str, seed: int) -> Base:
    """Build the closed base store of ``codec`` at ``path``; its content depends on ``seed`` alone."""
    rng = np.random.default_rng(seed & (2**64 - 1))
    model = Content(seed, GEOM, finite=codec in LOSSY)
    store = pagedkv.open(path, GEOM, POOL_PAGES, spill_codec=codec, model=MODEL_NAME, evict_batch=4)
    b = _Builder(store, model, rng)
    states: list[dict[str, int]] = []
    history: list[dict[str, dict[bytes, bytes]]] = []

    def commit() -> None:  # and remember what it committed, for telling an older commit apart
        store.commit()
        states.append(dict(model.lens))
        # LMDB opens an environment once per process: read this commit's records from a copy.
        snapshot = files.copy_store(path, f"{path}.commit{len(states)}")
        history.append(read_values(str(snapshot)))
        shutil.rmtree(snapshot)

    system = b.fresh(3 * GEOM.page_size)  # a system prompt of three full pages, shared below
    b.create("a", system + b.fresh(13))
    b.create("c")
    b.append("c", 30)
    commit()
    b.create("b", system + b.fresh(20))  # reuses the system prompt's pages of "a"
    b.create("e")
    b.append("e", 70)  # longer than the pool: its pages stream through and spill
    commit()
    b.fork("b", "b2")
    b.append("b2", 10, b.fresh(10))  # copy-on-write of b's partial last page
    b.create("tmp", b.fresh(37))
    commit()
    b.drop("tmp")  # its full pages stay as cache, reachable through lookup only
    b.create("d", system[:16] + b.fresh(9))
    b.append("a", 6, b.fresh(6))
    b.append("c", 12)
    commit()
    b.append("e", 3)
    b.fork("c", "c2")
    commit()
    store.close()  # commits once more, with nothing new: the same state as the last commit
    prompts = {"A": b.ids["a"], "B": b.ids["b"], "B2": b.ids["b2"], "D": b.ids["d"], "T": b.gone["tmp"][0],
               "sys": system + b.fresh(5), "half": system[:20], "miss": b.fresh(30)}
    prompt_segs = {name: b.source(ids) for name, ids in prompts.items()}
    mdb = Path(path, DATA_MDB).read_bytes()
    return Base(codec, path, seed, model, states, dict(b.ids), prompts, prompt_segs, read_values(path),
                {POOL: os.path.getsize(os.path.join(path, POOL)), DATA_MDB: len(mdb)}, mdb, history[:-1])


def read_values(path: str) -> dict[str, dict[bytes, bytes]]:
    """Every record of every database of a closed store."""
    env = files.spill_env(path, readonly=True, lock=False)
    try:
        dbs = files.spill_dbs(env)
        with env.begin() as txn:
            return {name: {bytes(k): bytes(v) for k, v in txn.cursor(db=db)} for name, db in dbs.items()}
    finally:
        env.close()


# -- damage ------------------------------------------------------------------------------------

Op = tuple  # ("flip", file, offset, bit) | ("write", file, offset, data) | ("resize", file, size)
#            | ("append", file, data) | ("swap", file, a, b, length) | ("header", field, value)
#            | ("lmdb", [(action, db, key, value)])


@dataclass
class Mutation:
    """One way of damaging a copy: its kind, a description and the edits that make it."""

    kind: str
    what: str
    ops: list[Op]
    sealed: bool = False  # damage confined to checksummed metadata: expected to be reported


def _flips(rng: random.Random, name: str, size: int) -> Mutation:
    count = rng.choice((1, 1, 1, 2, 3, 8))
    ops = [("flip", name, rng.randrange(size), rng.randrange(8)) for _ in range(count)]
    return Mutation("", f"{count} bit flip(s) in {name} at " + ",".join(str(op[2]) for op in ops), ops)


def _bytes(rng: random.Random, name: str, size: int) -> Mutation:
    roll = rng.random()
    if roll < 0.3:
        offset = rng.randrange(size)
        value = bytes([rng.choice((0x00, 0xFF, rng.randrange(256)))])
        return Mutation("", f"byte {offset} of {name} := {value.hex()}", [("write", name, offset, value)])
    length = rng.choice((rng.randrange(2, 17), rng.randrange(17, 513), rng.randrange(513, 4097)))
    offset = rng.randrange(max(1, size - length))
    fill = rng.random()
    data = bytes(length) if fill < 0.2 else b"\xff" * length if fill < 0.3 else rng.randbytes(length)
    desc = "zeros" if fill < 0.2 else "0xff" if fill < 0.3 else "random bytes"
    return Mutation("", f"{length} {desc} over {name} at {offset}", [("write", name, offset, data)])


def _cut(rng: random.Random, name: str, size: int) -> Mutation:
    pages = size // MDB_PAGE
    choice = rng.random()
    if choice < 0.3:
        new = rng.randrange(size)
    elif choice < 0.6:
        new = rng.randrange(pages) * MDB_PAGE
    elif choice < 0.8:
        new = size - rng.randrange(1, min(size, 2 * MDB_PAGE))
    else:
        new = rng.choice((0, 1, 8, 4095, MDB_PAGE, 2 * MDB_PAGE, size - MDB_PAGE))
    new = max(0, min(new, size - 1))
    return Mutation("", f"{name} truncated from {size} to {new} bytes", [("resize", name, new)])


def _grow(rng: random.Random, name: str, size: int) -> Mutation:
    choice = rng.random()
    if choice < 0.4:
        n = rng.randrange(1, MDB_PAGE)
    else:
        n = rng.randrange(1, 5) * MDB_PAGE
    data = bytes(n) if rng.random() < 0.5 else rng.randbytes(n)
    desc = "zeros" if not data.strip(b"\x00") else "random bytes"
    return Mutation("", f"{name} extended by {n} {desc}", [("append", name, data)])


def _page_swap(rng: random.Random, base: Base) -> Mutation:
    pages = base.sizes[DATA_MDB] // MDB_PAGE
    a, b = rng.sample(range(pages), 2)
    return Mutation("", f"data.mdb pages {a} and {b} swapped", [("swap", DATA_MDB, a * MDB_PAGE, b * MDB_PAGE,
                                                                  MDB_PAGE)])


def _tree_flip(rng: random.Random, base: Base) -> Mutation:
    """Flips aimed at LMDB's structure: a meta page, the free list's root, a tree or overflow page."""
    data = base.mdb
    kinds = mdb_pages(data)
    newest = max((0, 1), key=lambda meta: int.from_bytes(data[meta * MDB_PAGE + 144:meta * MDB_PAGE + 152], "little"))
    free_root = int.from_bytes(data[newest * MDB_PAGE + 80:newest * MDB_PAGE + 88], "little")
    roll = rng.random()
    if roll < 0.3:
        pgno = rng.choice((newest, newest, 1 - newest))
        where, spans = f"meta page {pgno}{' (newest)' if pgno == newest else ''}", [(0, META_END)]
    elif roll < 0.55 and free_root in kinds["leaf"] + kinds["branch"]:
        pgno, where = free_root, f"free-list root page {free_root}"
        spans = None
    elif roll < 0.85 or not kinds["overflow"]:
        pgno = rng.choice(kinds["leaf"] + kinds["branch"])
        where, spans = f"tree page {pgno}", None
    else:
        pgno = rng.choice(kinds["overflow"])
        where, spans = f"overflow page {pgno} header", [(0, 16)]
    if spans is None:  # the header and node offsets, and the nodes: not the gap between them
        lower, upper = (int.from_bytes(data[pgno * MDB_PAGE + at:pgno * MDB_PAGE + at + 2], "little")
                        for at in (12, 14))
        spans = [(0, min(lower, MDB_PAGE))] + ([(upper, MDB_PAGE)] if upper < MDB_PAGE else [])
    ops = []
    for _ in range(rng.choice((1, 1, 1, 2))):
        low, high = rng.choice(spans)
        ops.append(("flip", DATA_MDB, pgno * MDB_PAGE + rng.randrange(low, max(high, low + 1)), rng.randrange(8)))
    return Mutation("", f"{where}: bit flip(s) at byte(s) " + ",".join(str(op[2] % MDB_PAGE) for op in ops), ops)


def _header(rng: random.Random, base: Base) -> Mutation:
    roll = rng.random()
    if roll < 0.35:  # the fields and the checksum: where the bytes mean something
        offsets = [rng.choice((rng.randrange(0, 96), rng.randrange(HEADER_NBYTES - 8, HEADER_NBYTES)))
                   for _ in range(rng.choice((1, 1, 2, 4)))]
        ops = [("flip", POOL, offset, rng.randrange(8)) for offset in offsets]
        return Mutation("", "pool.bin header bit flips at " + ",".join(map(str, offsets)), ops)
    if roll < 0.55:
        offset = rng.randrange(HEADER_NBYTES)
        return Mutation("", f"pool.bin header bit flip at {offset}", [("flip", POOL, offset, rng.randrange(8))])
    if roll < 0.7:
        length = rng.randrange(1, 64)
        offset = rng.randrange(HEADER_NBYTES - length)
        return Mutation("", f"{length} random bytes over the pool.bin header at {offset}",
                        [("write", POOL, offset, rng.randbytes(length))])
    # A field rewritten with a correct checksum: what a program that knows the format can do.
    name = rng.choice([f for f in HEADER_FIELDS if f != "magic"] + ["magic"])
    value: Any
    if name == "uuid":
        value = rng.randbytes(16)
    elif name == "dtype":
        value = rng.choice((b"float16", b"bfloat16", b"int8", b"float32\x00junk"))
    elif name == "magic":
        value = rng.randbytes(8)
    else:
        value = rng.choice((0, 1, 2, 3, 7, 8, 9, 16, 4096, 2**31, 2**32 - 1))
        if name in ("pool_pages", "page_nbytes"):
            value = rng.choice((value, 2**63, 2**64 - 1))
    return Mutation("", f"pool.bin header {name} := {value!r} (checksum recomputed)", [("header", name, value)])


def _key_name(db: str, key: bytes) -> str:
    """A record's key as a reader would name it: a meta record, a sequence id or a page uid."""
    if db == "meta":
        return key.decode("ascii", "replace")
    if db == "seqs":
        try:
            return repr(msgpack.unpackb(key))
        except Exception:  # noqa: BLE001 - a key made up by the damage itself
            return key.hex()
    return f"uid {int.from_bytes(key, 'big')}" if len(key) == 8 else key.hex()


def _pick_db(rng: random.Random, base: Base, least: int = 1, dbs: Iterable[str] = DBS) -> str:
    usable = [db for db in dbs if len(base.values[db]) >= least]
    return rng.choice(usable)


def _other_key(rng: random.Random, base: Base, db: str, key: bytes) -> bytes:
    """A key of ``db`` that is not ``key`` and holds nothing yet (a page uid, a sequence id...)."""
    taken = base.values[db]
    for _ in range(100):
        if db == "meta":
            # A delta of the LRU log past its end, or one a base rewrite deleted, is damage too.
            new = rng.choice((b"state", b"lru", b"superblock", b"junk", b"states",
                              lrulog.delta_key(rng.randrange(64)), lrulog.DELTA_PREFIX))
        elif db == "seqs":
            new = msgpack.packb(rng.choice(("zz", "a2", "A", 7, 0, "b" * 30)))
        else:
            uid = int.from_bytes(key, "big") if len(key) == 8 else 1
            new = rng.choice((uid + 1, uid - 1, uid + 1000, rng.randrange(1, 2**63))).to_bytes(8, "big")
        if new != key and new not in taken:
            return new
    return key + b"\x00"


def _lmdb_swap(rng: random.Random, base: Base) -> Mutation:
    db = _pick_db(rng, base, least=2)
    a, b = rng.sample(sorted(base.values[db]), 2)
    va, vb = base.values[db][a], base.values[db][b]
    return Mutation("", f"{db}: values of {_key_name(db, a)} and {_key_name(db, b)} exchanged",
                    [("lmdb", [("put", db, a, vb), ("put", db, b, va)])], sealed=db != "pages")


def _lmdb_move(rng: random.Random, base: Base) -> Mutation:
    db = _pick_db(rng, base)
    key = rng.choice(sorted(base.values[db]))
    value = base.values[db][key]
    roll = rng.random()
    if roll < 0.35:  # renamed: the value now lives under a key nothing else uses
        new = _other_key(rng, base, db, key)
        return Mutation("", f"{db}: value of {_key_name(db, key)} moved to new key {_key_name(db, new)}",
                        [("lmdb", [("delete", db, key, None), ("put", db, new, value)])], sealed=db != "pages")
    if roll < 0.7 and len(base.values[db]) > 1:  # over another record, the original kept or not
        other = rng.choice([k for k in sorted(base.values[db]) if k != key])
        keep = rng.random() < 0.5
        ops = [("put", db, other, value)] + ([] if keep else [("delete", db, key, None)])
        verb = "copied" if keep else "moved"
        return Mutation("", f"{db}: value of {_key_name(db, key)} {verb} over {_key_name(db, other)}",
                        [("lmdb", ops)], sealed=db != "pages")
    # into another database, under one of its keys (or a fresh one)
    target = _pick_db(rng, base, dbs=[d for d in DBS if d != db])
    keys = sorted(base.values[target])
    other = rng.choice(keys) if keys and rng.random() < 0.7 else _other_key(rng, base, target, key)
    return Mutation("", f"value of {db}/{_key_name(db, key)} put under {target}/{_key_name(target, other)}",
                    [("lmdb", [("put", target, other, value)])], sealed=target != "pages")


def _lmdb_delete(rng: random.Random, base: Base) -> Mutation:
    db = _pick_db(rng, base)
    key = rng.choice(sorted(base.values[db]))
    return Mutation("", f"{db}: record {_key_name(db, key)} deleted", [("lmdb", [("delete", db, key, None)])])


def _lmdb_stale(rng: random.Random, base: Base) -> Mutation:
    """A record as an earlier commit had it, under its own key: its seal is valid, only its age is wrong
    (what a tree pointer to an old version of a page would show). A record deleted since comes back."""
    older: dict[str, list[tuple[int, bytes, bytes]]] = {}
    for number, snapshot in enumerate(base.history, 1):
        for db in DBS:
            for key, value in snapshot[db].items():
                if base.values[db].get(key) != value:
                    older.setdefault(db, []).append((number, key, value))
    db = rng.choice(sorted(older))
    number, key, value = rng.choice(older[db])
    how = "deleted since, back" if key not in base.values[db] else "restored"
    return Mutation("", f"{db}/{_key_name(db, key)}: the value of commit {number} {how}",
                    [("lmdb", [("put", db, key, value)])])


def _record_flip(rng: random.Random, base: Base) -> Mutation:
    db = rng.choice(("seqs", "seqs", "dir", "dir", "meta", "tokens", "pages"))
    if not base.values[db]:
        db = "dir"
    key = rng.choice(sorted(base.values[db]))
    value = bytearray(base.values[db][key])
    bits = sorted(rng.sample(range(len(value) * 8), rng.choice((1, 1, 2, 3))))
    for bit in bits:
        value[bit // 8] ^= 1 << (bit % 8)
    return Mutation("", f"{db}/{_key_name(db, key)} ({len(value)} bytes): bits {bits} flipped",
                    [("lmdb", [("put", db, key, bytes(value))])], sealed=db != "pages")


PLANNERS: dict[str, Callable[[random.Random, Base], Mutation]] = {
    "mdb-flip": lambda rng, base: _flips(rng, DATA_MDB, base.sizes[DATA_MDB]),
    "mdb-bytes": lambda rng, base: _bytes(rng, DATA_MDB, base.sizes[DATA_MDB]),
    "mdb-cut": lambda rng, base: _cut(rng, DATA_MDB, base.sizes[DATA_MDB]),
    "mdb-grow": lambda rng, base: _grow(rng, DATA_MDB, base.sizes[DATA_MDB]),
    "mdb-pageswap": _page_swap,
    "mdb-tree": _tree_flip,
    "pool-flip": lambda rng, base: _flips(rng, POOL, base.sizes[POOL]),
    "pool-bytes": lambda rng, base: _bytes(rng, POOL, base.sizes[POOL]),
    "pool-cut": lambda rng, base: _cut(rng, POOL, base.sizes[POOL]),
    "pool-grow": lambda rng, base: _grow(rng, POOL, base.sizes[POOL]),
    "pool-header": _header,
    "lmdb-swap": _lmdb_swap,
    "lmdb-move": _lmdb_move,
    "lmdb-delete": _lmdb_delete,
    "record-flip": _record_flip,
    "lmdb-stale": _lmdb_stale,
}
KINDS = tuple(PLANNERS)


def case_rng(seed: int, codec: str, index: int) -> random.Random:
    """The generator of one case: the same (seed, codec, index) plans the same damage, whatever --jobs."""
    return random.Random(f"{seed}:{codec}:{index}")


def plan(base: Base, index: int, kinds: tuple[str, ...] = KINDS) -> Mutation:
    """The damage of case ``index`` of ``base``'s codec (kinds taken in turn, details at random)."""
    rng = case_rng(base.seed, base.codec, index)
    kind = kinds[index % len(kinds)]
    mutation = PLANNERS[kind](rng, base)
    mutation.kind = kind
    return mutation


def apply(path: str, mutation: Mutation) -> None:
    """Make ``mutation``'s edits to the closed store at ``path``."""
    for op in mutation.ops:
        name = op[0]
        if name == "flip":
            files.flip_bit(os.path.join(path, op[1]), op[2], op[3])
        elif name == "write":
            files.poke(os.path.join(path, op[1]), op[2], op[3])
        elif name == "resize":
            files.resize(os.path.join(path, op[1]), op[2])
        elif name == "append":
            with open(os.path.join(path, op[1]), "ab") as fh:
                fh.write(op[2])
        elif name == "swap":
            file, a, b, length = os.path.join(path, op[1]), op[2], op[3], op[4]
            with open(file, "rb") as fh:
                fh.seek(a)
                first = fh.read(length)
                fh.seek(b)
                second = fh.read(length)
            files.poke(file, a, second)
            files.poke(file, b, first)
        elif name == "header":
            fields = files.read_header(path)
            fields[op[1]] = op[2]
            files.write_header(path, fields)
        elif name == "lmdb":
            env = files.spill_env(path)
            try:
                dbs = files.spill_dbs(env)
                with env.begin(write=True) as txn:
                    for action, db, key, value in op[1]:
                        if action == "put":
                            txn.put(key, value, db=dbs[db])
                        else:
                            txn.delete(key, db=dbs[db])
            finally:
                env.close()
        else:
            raise ValueError(f"unknown edit {name!r}")


def ops_json(ops: list[Op]) -> list[Any]:
    """The edits in a JSON-friendly form (bytes as hex)."""

    def plain(value: Any) -> Any:  # bytes as {"hex": ...}, tuples as lists
        if isinstance(value, (bytes, bytearray)):
            return {"hex": bytes(value).hex()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return [plain(op) for op in ops]


# -- checking one copy (runs in a forked child) -------------------------------------------------


class Examiner:
    """Opens a copy one way (``ro`` or ``rw``), checks every answer and sorts what it saw.

    With ``record`` (an undamaged copy) it also keeps what the store answered, so damaged
    copies can be compared with it: prefix lookups, probe reuse and, for lossy codecs, reads.
    """

    def __init__(self, base: Base, path: str, mode: str, record: bool = False) -> None:
        self.base, self.path, self.mode = base, path, mode
        self.model = copy.deepcopy(base.model)
        self.reference = None if record else base.reference.get(mode)
        self.observed = Observation() if record else None
        self.notes: dict[str, list[str]] = {name: [] for name in OUTCOMES}
        self.stale = False
        self.tolerated = 0  # lossy pages accepted within the codec's error bound only

    # -- bookkeeping --
    def note(self, outcome: str, text: str) -> None:
        """Record what was seen under ``outcome`` (the first 20 of each)."""
        if len(self.notes[outcome]) < 20:
            self.notes[outcome].append(text)

    def attempt(self, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """Run one store operation; a typed error is noted TYPED, any other exception UNTYPED."""
        try:
            return True, fn(*args, **kwargs)
        except PagedKVError as exc:
            self.note("TYPED", f"{where}: {type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:  # noqa: BLE001 - exactly what the campaign is looking for
            frames = traceback.extract_tb(exc.__traceback__)[-3:]
            where_from = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
            self.note("UNTYPED", f"{where}: {describe(exc)[:300]} [{where_from}]")
        return False, None

    def outcome(self) -> str:
        """The worst of what was noted (a loss next to reported damage is that damage's)."""
        for name in ("UNTYPED", "WRONG"):
            if self.notes[name]:
                return name
        if self.notes["TYPED"]:
            return "TYPED"  # damage was reported: what went missing is accounted for
        if self.notes["LOST"]:
            return "LOST"
        return "STALE" if self.stale else "OK"

    # -- comparisons --
    def shaped(self, where: str, arrays: Any) -> bool:
        """Whether a read returned what it says it returns (K and V, or pages): ndarrays of the dtype."""
        ok = isinstance(arrays, tuple) and all(isinstance(a, np.ndarray) and a.dtype == GEOM.np_dtype
                                               and a.ndim in (4, 6) for a in arrays)
        if not ok:
            self.note("WRONG", f"{where} returned {type(arrays).__name__} {str(arrays)[:100]}")
        return ok

    def compare(self, where: str, ref_key: tuple[int, str, str], segs: list[tuple[Any, int, int]],
                k: np.ndarray, v: np.ndarray) -> None:
        """K and V read for tokens [0, n) of content ``segs``: bit-exact, or (lossy) as the reference."""
        n = k.shape[1]
        expected = _expected(self.base, segs, max(n, 0))
        shape = (GEOM.layers, n, GEOM.kv_heads, GEOM.head_dim)
        if k.shape != shape or v.shape != shape or k.dtype != GEOM.np_dtype or v.dtype != GEOM.np_dtype:
            self.note("WRONG", f"{where}: K/V of shape {k.shape}/{v.shape} {k.dtype}, expected {shape}")
            return
        if self.observed is not None and self.base.lossy:
            self.observed.reads[ref_key] = (k.tobytes(), v.tobytes())
        if k.tobytes() == expected[0].tobytes() and v.tobytes() == expected[1].tobytes():
            return
        if not self.base.lossy:
            self.note("WRONG", f"{where}: {_first_difference((k, v), expected)}")
            return
        ref = self.reference.reads.get(ref_key) if self.reference is not None else None
        ref_arrays = None
        if ref is not None:
            ref_arrays = tuple(np.frombuffer(r, GEOM.np_dtype).reshape(GEOM.layers, -1, GEOM.kv_heads,
                                                                        GEOM.head_dim) for r in ref)
        size = GEOM.page_size
        for page in range(-(-n // size)):
            span = slice(page * size, min(n, (page + 1) * size))
            for half, (got, exact) in enumerate(zip((k, v), expected)):
                g, e = got[:, span], exact[:, span]
                if g.tobytes() == e.tobytes():
                    continue
                if ref_arrays is not None and ref_arrays[half].shape[1] >= span.stop and \
                        g.tobytes() == ref_arrays[half][:, span].tobytes():
                    continue
                if _within_int8_bound(g, e):
                    self.tolerated += 1
                    continue
                self.note("WRONG", f"{where}: page {page} {'KV'[half]} is neither the committed bytes nor "
                                   f"within the int8 bound of them")
                return

    def compare_pages(self, where: str, ref_key: tuple[int, str, str], segs: list[tuple[Any, int, int]],
                      n: int, pages: np.ndarray) -> None:
        """``read_pages`` of a sequence of ``n`` tokens: its K/V as ``compare``, zeros past the end."""
        size = GEOM.page_size
        npages = -(-n // size)
        shape = (npages, GEOM.layers, 2, size, GEOM.kv_heads, GEOM.head_dim)
        if pages.shape != shape or pages.dtype != GEOM.np_dtype:
            self.note("WRONG", f"{where}: pages of shape {pages.shape} {pages.dtype}, expected {shape}")
            return
        flat = pages.transpose(2, 1, 0, 3, 4, 5).reshape(2, GEOM.layers, npages * size, GEOM.kv_heads,
                                                         GEOM.head_dim)
        if flat[:, :, n:].view(np.uint8).any():
            self.note("WRONG", f"{where}: bytes past the last token are not zero")
        self.compare(where, ref_key, segs, np.ascontiguousarray(flat[0, :, :n]),
                     np.ascontiguousarray(flat[1, :, :n]))

    # -- the phases --
    def read_all(self, store: pagedkv.KVStore, phase: int, expect: dict[str, tuple[int, int, bool]]
                 ) -> dict[str, int | None] | None:
        """Read every sequence; compare lengths and bytes. Returns {sequence: length or None (absent)}."""
        ok, listed = self.attempt(f"p{phase} sequences()", store.sequences)
        if not ok:
            return None
        observed: dict[str, int | None] = {}
        for seq in listed:
            if seq not in expect:
                self.note("WRONG", f"p{phase}: sequence {seq!r} is not in the last commit")
        for seq in expect:
            if seq not in listed:
                observed[seq] = None
                continue
            ok, n = self.attempt(f"p{phase} length({seq!r})", store.length, seq)
            if not ok:
                continue
            observed[seq] = n
            most = self.model.lens[seq]
            if type(n) is not int or not 0 <= n <= most:
                self.note("WRONG", f"p{phase}: length({seq!r}) = {n!r}, but at most {most} tokens were written")
                continue
            segs = self.model.segs[seq]
            ok, kv = self.attempt(f"p{phase} read({seq!r})", store.read, seq)
            if ok and self.shaped(f"p{phase} read({seq!r})", kv):
                self.compare(f"p{phase} read({seq!r})", (phase, seq, "read"), segs, *kv)
            ok, pages = self.attempt(f"p{phase} read_pages({seq!r})", store.read_pages, seq)
            if ok and self.shaped(f"p{phase} read_pages({seq!r})", (pages,)):
                self.compare_pages(f"p{phase} read_pages({seq!r})", (phase, seq, "pages"), segs, n, pages)
        return observed

    def judge_state(self, phase: int, observed: dict[str, int | None] | None,
                    expect: dict[str, tuple[int, int, bool]]) -> None:
        """Sequences and lengths as committed; else an earlier commit (STALE) or a loss."""
        if observed is None:
            return
        off = {seq: n for seq, n in observed.items()
               if n is None and expect[seq][2] or n is not None and not expect[seq][0] <= n <= expect[seq][1]}
        if not off:
            return
        present = {seq: n for seq, n in observed.items() if n is not None}
        if phase == 1 and any(present == state for state in self.base.states[:-1]):
            self.stale = True
            return
        for seq, n in sorted(off.items()):
            lo, hi, _ = expect[seq]
            if n is None:
                self.note("LOST", f"p{phase}: committed sequence {seq!r} is gone")
            elif n < lo:
                self.note("LOST", f"p{phase}: {seq!r} has {n} tokens, {lo} were committed")
            else:
                self.note("WRONG", f"p{phase}: {seq!r} has {n} tokens, {hi} were committed")

    def lookups(self, store: pagedkv.KVStore, phase: int) -> None:
        """Look every prompt up: never more cached tokens than the undamaged store had."""
        for name, ids in self.base.prompts.items():
            ok, got = self.attempt(f"p{phase} lookup({name})", store.lookup, ids)
            if not ok:
                continue
            if self.observed is not None:
                self.observed.lookups[(phase, name)] = got
                continue
            want = self.reference.lookups.get((phase, name)) if self.reference else None
            if want is None:
                continue
            if type(got) is not int or got > want or got < 0:
                self.note("WRONG", f"p{phase}: lookup({name}) = {got!r}, {want} tokens are cached")
            elif got < want and not self.stale:
                self.note("LOST", f"p{phase}: lookup({name}) = {got}, {want} tokens were cached")

    def check(self, store: pagedkv.KVStore, phase: int) -> None:
        """``store.check()``: what it lists is reported damage."""
        ok, problems = self.attempt(f"p{phase} check()", store.check)
        if ok and problems:
            self.note("TYPED", f"p{phase} check(): {len(problems)} problem(s), first: {str(problems[0])[:300]}")
        elif ok and not isinstance(problems, list):
            self.note("WRONG", f"p{phase} check() returned {problems!r}")

    def run(self) -> None:
        """Every check of this mode, in order; results land in ``notes``."""
        expect = {seq: (n, n, True) for seq, n in self.base.states[-1].items()}
        readonly = self.mode == "ro"
        before = _file_digests(self.path)
        ok, store = self.attempt(f"open {self.mode}", pagedkv.open, self.path, readonly=readonly)
        if not ok:
            # A refused open leaves the store as it found it, so nothing is lost by trying.
            if _file_digests(self.path) != before:
                self.note("WRONG", f"a refused {self.mode} open changed pool.bin or data.mdb")
            return
        try:
            observed = self.read_all(store, 1, expect)
            self.judge_state(1, observed, expect)
            self.lookups(store, 1)
            self.check(store, 1)
            if not readonly:
                expect = self.write_phase(store, observed or {})
        finally:
            self.attempt(f"close {self.mode}", store.close)
        if readonly:
            if _file_digests(self.path) != before:
                self.note("WRONG", "a read-only open changed pool.bin or data.mdb")
            return
        ok, store = self.attempt("reopen", pagedkv.open, self.path)
        if not ok:
            return
        try:
            observed = self.read_all(store, 2, expect)
            self.judge_state(2, observed, expect)
            self.lookups(store, 2)
            self.check(store, 2)
        finally:
            self.attempt("close after reopen", store.close)

    def write_phase(self, store: pagedkv.KVStore, observed: dict[str, int | None]
                    ) -> dict[str, tuple[int, int, bool]]:
        """Append to every sequence, create from every prompt, commit: what the reopen must show."""
        expect: dict[str, tuple[int, int, bool]] = {}
        rng = np.random.default_rng([self.base.seed & (2**63 - 1), 2])
        for seq, n in observed.items():
            if n is None:
                continue
            count = PHASE2_APPENDS.get(seq, 3)
            ids = rng.integers(1000, 60000, count).tolist()
            if n != self.model.lens[seq] or self.stale:
                expect[seq] = (n, n, True)  # not where the model is: leave it alone
                continue
            k, v = self.model.next_kv(seq, count)
            ok, _ = self.attempt(f"append({seq!r})", store.append, seq, k, v,
                                 tokens=ids if seq in self.base.ids else None)
            # A failed append may have taken some tokens: the reopen may show any length between.
            expect[seq] = (n + count, n + count, True) if ok else (n, n + count, True)
        for name, ids in self.base.prompts.items():
            seq = f"probe-{name}"
            ok, reused = self.attempt(f"create({seq!r}, tokens)", store.create, seq, tokens=ids + [7])
            if not ok:
                continue
            if self.observed is not None:
                self.observed.probes[name] = reused
            want = self.reference.probes.get(name) if self.reference else None
            if type(reused) is not int or want is not None and reused > want or reused < 0:
                self.note("WRONG", f"create({seq!r}) reused {reused!r} tokens, {want} are cached")
                continue
            if want is not None and reused < want and not self.stale:
                self.note("LOST", f"create({seq!r}) reused {reused} tokens, {want} were cached")
            self.model.create(seq)
            self.model.segs[seq] = cut_segments(self.base.prompt_segs[name], reused)
            self.model.lens[seq] = reused
            expect[seq] = (reused, reused, True)
            ok, kv = self.attempt(f"read({seq!r})", store.read, seq)
            if ok and self.shaped(f"read({seq!r})", kv):
                self.compare(f"read({seq!r})", (2, seq, "created"), self.model.segs[seq], *kv)
        ok, _ = self.attempt("commit", store.commit)
        if not ok:  # the reopen may show the commit or the state before it
            expect = {seq: (min(lo, observed.get(seq) or 0), hi, False) for seq, (lo, hi, _) in expect.items()}
        return expect


def _expected(base: Base, segs: list[tuple[Any, int, int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    model = Content(base.seed, GEOM, finite=base.model.finite, raw_seq=base.model.raw_seq)
    model.segs["x"], model.lens["x"] = cut_segments(segs, n), n
    return model.expected("x", 0, n)


def _first_difference(got: tuple[np.ndarray, np.ndarray], expected: tuple[np.ndarray, np.ndarray]) -> str:
    for half, (g, e) in enumerate(zip(got, expected)):
        a, b = g.view(np.uint8).reshape(g.shape[0], g.shape[1], -1), e.view(np.uint8).reshape(e.shape[0],
                                                                                                 e.shape[1], -1)
        bad = np.argwhere(a != b)
        if len(bad):
            return f"{len(bad)} bytes of {'KV'[half]} differ, the first in token {int(bad[0][1])}"
    return "the bytes differ"


def _within_int8_bound(got: np.ndarray, exact: np.ndarray) -> bool:
    """Whether ``got`` is ``exact`` quantised (maybe twice) by int8: non-finite values exact, the rest
    within one step (two half steps) of ``max|x| / 127`` of their (layer, head) group."""
    finite = np.isfinite(exact)
    if got[~finite].tobytes() != exact[~finite].tobytes():
        return False
    e = np.where(finite, exact, 0).astype(np.float64)
    g = got.astype(np.float64)
    if not np.isfinite(g[finite]).all():
        return False
    bound = np.broadcast_to(np.abs(e).max(axis=(1, 3), keepdims=True) / 127.0 * 1.0001 + 1e-30, e.shape)
    return bool((np.abs(g - e)[finite] <= bound[finite]).all())


def _file_digests(path: str) -> dict[str, int]:
    out = {}
    for name in (POOL, DATA_MDB):
        try:
            out[name] = zlib.crc32(Path(path, name).read_bytes())
        except OSError:
            out[name] = -1
    return out


def examine(base: Base, path: str, mode: str, record: bool = False) -> dict[str, Any]:
    """Check the copy at ``path`` one way; the outcome and its notes (an ``Observation`` with ``record``)."""
    examiner = Examiner(base, path, mode, record)
    examiner.run()
    return {"outcome": examiner.outcome(), "notes": {k: v for k, v in examiner.notes.items() if v},
            "tolerated": examiner.tolerated, "observed": examiner.observed}


# -- forked children ----------------------------------------------------------------------------


@dataclass
class Unit:
    """One forked check: a case in one mode."""

    case: Any
    mode: str
    path: str
    err_path: str = ""
    child: Child | None = None
    deadline: float = 0.0


def _answer(chan: Channel, fn: Callable[[], Any]) -> None:
    try:
        payload = ("ok", fn())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        payload = ("raised", describe(exc) + "\n" + traceback.format_exc())
    chan.send(payload)


class Runner:
    """Runs up to ``jobs`` forked children at once, each with a deadline; reports how each ended."""

    def __init__(self, jobs: int, timeout: float) -> None:
        self.jobs, self.timeout = max(1, jobs), timeout
        self.running: dict[int, Unit] = {}

    def start(self, unit: Unit, fn: Callable[[], Any]) -> None:
        """Fork a child running ``fn()`` for ``unit`` in its own process group (a timeout ends
        what it forked too), its output to ``unit.err_path``; its result comes back pickled."""
        unit.child = Child(_answer, fn, own_group=True, output=unit.err_path)
        unit.deadline = unit.child.started + self.timeout
        self.running[unit.child.chan.read_fd] = unit

    def wait_any(self) -> list[tuple[Unit, dict[str, Any]]]:
        """Block until at least one child ends (or hangs); return each with how it ended."""
        done: list[tuple[Unit, dict[str, Any]]] = []
        while not done and self.running:
            left = max(0.0, min(u.deadline for u in self.running.values()) - time.monotonic())
            ready, _, _ = select.select(list(self.running), [], [], left)
            for fd in ready:
                unit = self.running[fd]
                if unit.child.chan.fill():
                    continue
                del self.running[fd]
                done.append((unit, self._reap(unit, hung=False)))
            now = time.monotonic()
            for fd, unit in list(self.running.items()):
                if now >= unit.deadline:
                    del self.running[fd]
                    done.append((unit, self._reap(unit, hung=True)))
        return done

    def _reap(self, unit: Unit, hung: bool) -> dict[str, Any]:
        child = unit.child
        elapsed = time.monotonic() - child.started
        if hung:
            child.kill()
        else:  # EOF: the child wrote its result and is exiting; a bounded wait for it
            child.wait(timeout=max(1.0, unit.deadline - time.monotonic()))
        stderr = _tail(unit.err_path)
        if child.killed:
            return {"status": "timeout", "elapsed": elapsed, "stderr": stderr}
        if child.signalled is not None:
            return {"status": "signal", "signal": child.signalled, "elapsed": elapsed, "stderr": stderr}
        ready, message = child.chan.take()
        if not ready:
            return {"status": "exit", "code": child.exit_code, "elapsed": elapsed, "stderr": stderr}
        if message[0] == "crashed":
            return {"status": "raised", "value": f"{message[1]}\n{message[2]}", "elapsed": elapsed,
                    "stderr": stderr}
        kind, value = message
        return {"status": kind, "value": value, "elapsed": elapsed, "stderr": stderr}

    def kill_all(self) -> None:
        """End and reap every child still running (and what it forked)."""
        for unit in self.running.values():
            unit.child.kill()
        self.running.clear()


def _tail(path: str, limit: int = 600) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace").strip()


def verdict(end: dict[str, Any], timeout: float) -> tuple[str, str, dict[str, Any]]:
    """(outcome, first note, the examine result or {}) of a child's end."""
    if end["status"] == "timeout":
        return "HANG", f"no answer within {timeout:.0f} s", {}
    if end["status"] == "signal":
        name = signal.Signals(end["signal"]).name
        tail = end["stderr"].splitlines()[-1] if end["stderr"] else ""
        return "CRASH", f"killed by {name}" + (f": {tail}" if tail else ""), {}
    if end["status"] == "exit":
        return "CRASH", f"exited {end['code']} without an answer: {end['stderr'][-200:]}", {}
    if end["status"] == "raised":
        return "UNTYPED", f"the check itself raised: {end['value'][:400]}", {}
    result = end["value"]
    outcome = result["outcome"]
    first = result["notes"].get(outcome, [""])[0] if outcome != "OK" else ""
    return outcome, first, result


# -- the campaign ----------------------------------------------------------------------------------


@dataclass
class Case:
    """One damaged copy: where it is, its damage, and what its runs gave."""

    codec: str
    index: int
    mutation: Mutation
    path: str
    results: dict[str, tuple[str, str, dict[str, Any]]] = field(default_factory=dict)
    elapsed: float = 0.0

    @property
    def outcome(self) -> str:
        """The worse of its read-only and writer outcomes."""
        return max((r[0] for r in self.results.values()), key=_RANK.__getitem__, default="OK")


@dataclass
class Summary:
    """A campaign's figures: outcome counts per (codec, kind), examples, timings and kept copies."""

    seed: int
    tallies: dict[tuple[str, str], Tally] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    slowest: list[tuple[float, str]] = field(default_factory=list)
    tolerated: int = 0
    unreported_sealed: int = 0
    kept: list[str] = field(default_factory=list)
    copies: int = 0
    modes: dict[tuple[str, str], int] = field(default_factory=dict)  # (ro | rw, outcome) -> runs

    def count(self, outcome: str, codec: str | None = None) -> int:
        """Copies with ``outcome``, of one codec or of all."""
        return sum(t.counts.get(outcome, 0) for (c, _), t in self.tallies.items() if codec in (None, c))

    def failures(self, strict: bool = False) -> int:
        """Copies that miss the bar (with ``strict``, LOST ones too)."""
        return sum(self.count(name) for name in BAR + (("LOST",) if strict else ()))

    def table(self) -> str:
        """Outcome counts per codec and kind, totals per codec and overall."""
        head = f"{'codec':<6}{'kind':<14}" + "".join(f"{name:>8}" for name in OUTCOMES) + f"{'copies':>8}"
        lines = [head, "-" * len(head)]
        codecs = sorted({c for c, _ in self.tallies}, key=CODECS.index)
        for codec in codecs:
            for kind in KINDS:
                tally = self.tallies.get((codec, kind))
                if tally is None:
                    continue
                lines.append(f"{codec:<6}{kind:<14}" + "".join(f"{tally.counts.get(n, 0):>8}" for n in OUTCOMES)
                             + f"{sum(tally.counts.values()):>8}")
            total = {n: self.count(n, codec) for n in OUTCOMES}
            lines.append(f"{codec:<6}{'all':<14}" + "".join(f"{total[n]:>8}" for n in OUTCOMES)
                         + f"{sum(total.values()):>8}   {self.seconds.get(codec, 0):.1f} s")
            lines.append("")
        total = {n: self.count(n) for n in OUTCOMES}
        lines.append(f"{'all':<20}" + "".join(f"{total[n]:>8}" for n in OUTCOMES) + f"{sum(total.values()):>8}"
                     f"   {sum(self.seconds.values()):.1f} s")
        for mode, name in (("ro", "read-only runs"), ("rw", "writer runs")):
            lines.append(f"{name:<20}" + "".join(f"{self.modes.get((mode, n), 0):>8}" for n in OUTCOMES))
        return "\n".join(lines)

    def examples(self, outcomes: Iterable[str] = ("LOST",) + BAR) -> str:
        """The first few copies of each of ``outcomes``, one line each."""
        lines = []
        for (codec, kind), tally in sorted(self.tallies.items()):
            for outcome in outcomes:
                for text in tally.examples.get(outcome, []):
                    lines.append(f"  [{outcome}] {codec} {kind}: {text}")
        return "\n".join(lines)


def scratch_dir(where: str | None) -> str:
    """A private scratch directory, on tmpfs when there is one (the syncs cost nothing there)."""
    return tempfile.mkdtemp(prefix="pagedkv-mutate-", dir=where or files.tmpfs_base())


def prepare(base: Base, runner: Runner, work: str) -> None:
    """Record the undamaged copy's answers in both modes, and check that they are all right."""
    for mode in ("ro", "rw"):
        copy_path = os.path.join(work, f"{base.codec}-reference-{mode}")
        files.copy_store(base.path, copy_path)
        unit = Unit(None, mode, copy_path, err_path=copy_path + ".err")
        runner.start(unit, lambda p=copy_path, m=mode: examine(base, p, m, record=True))
        ((_, end),) = runner.wait_any()
        outcome, first, result = verdict(end, runner.timeout)
        if outcome != "OK":
            raise RuntimeError(f"the undamaged {base.codec} store gives {outcome} ({mode}): {first}\n"
                               f"{json.dumps(result.get('notes', {}), indent=1)[:3000]}")
        base.reference[mode] = result["observed"]
        shutil.rmtree(copy_path)
        os.unlink(unit.err_path)


def campaign(copies: int, codecs: Iterable[str] = CODECS, seed: int | None = None, jobs: int = 2,
             timeout: float = 30.0, keep: str | None = None, kinds: tuple[str, ...] = KINDS,
             work_dir: str | None = None, progress: int = 0) -> Summary:
    """Damage ``copies`` copies of each codec's base store and check every one; the figures.

    ``seed`` None takes ``PAGEDKV_SEED`` or a fresh seed (printed either way). Copies whose
    outcome misses the bar (or is LOST) are kept under ``keep`` when it is given.
    """
    if seed is None:
        seed = get_seed("mutation campaign")
    summary = Summary(seed)
    work = scratch_dir(work_dir)
    runner = Runner(jobs, timeout)
    try:
        for codec in codecs:
            began = time.monotonic()
            base = build_base(os.path.join(work, f"base-{codec}"), codec, seed)
            prepare(base, runner, work)
            gc.freeze()  # the children share the parent's heap pages instead of copying them on write
            pending: deque[Case] = deque()
            for index in range(copies):
                pending.append(Case(codec, index, plan(base, index, kinds), os.path.join(work, f"{codec}-{index:06d}")))
            waiting: deque[tuple[Case, str]] = deque()
            done = 0
            while pending or waiting or runner.running:
                while len(runner.running) < runner.jobs and (waiting or pending):
                    if waiting:
                        case, mode = waiting.popleft()
                    else:
                        case, mode = pending.popleft(), "ro"
                        files.copy_store(base.path, case.path)
                        apply(case.path, case.mutation)
                    unit = Unit(case, mode, case.path, err_path=f"{case.path}.{mode}.err")
                    runner.start(unit, lambda c=case, m=mode: examine(base, c.path, m))
                for unit, end in runner.wait_any():
                    case = unit.case
                    case.results[unit.mode] = verdict(end, timeout)
                    case.elapsed += end["elapsed"]
                    os.unlink(unit.err_path) if os.path.exists(unit.err_path) else None
                    if unit.mode == "ro":
                        waiting.appendleft((case, "rw"))  # the writer takes the same copy next
                        continue
                    finish(summary, base, case, keep)
                    done += 1
                    if progress and done % progress == 0:
                        print(f"  {codec}: {done}/{copies} copies, {time.monotonic() - began:.0f} s, "
                              f"{summary.failures()} below the bar so far", flush=True)
            summary.seconds[codec] = time.monotonic() - began
            shutil.rmtree(base.path, ignore_errors=True)
    finally:
        runner.kill_all()
        gc.unfreeze()
        shutil.rmtree(work, ignore_errors=True)
    summary.slowest.sort(reverse=True)
    return summary


def finish(summary: Summary, base: Base, case: Case, keep: str | None) -> None:
    """Tally a case whose runs are both done; keep its copy if it missed the bar."""
    outcome = case.outcome
    parts = []
    for mode in ("ro", "rw"):
        got, first, result = case.results[mode]
        summary.modes[(mode, got)] = summary.modes.get((mode, got), 0) + 1
        summary.tolerated += result.get("tolerated", 0)
        parts.append(f"{mode} {got}" + (f" ({first[:160]})" if first else ""))
    example = f"#{case.index} {case.mutation.what}: " + "; ".join(parts)
    if case.mutation.sealed and outcome in ("OK", "STALE"):
        summary.unreported_sealed += 1
    summary.tallies.setdefault((case.codec, case.mutation.kind), Tally()).add(outcome, example)
    summary.copies += 1
    summary.slowest.append((case.elapsed, f"{case.codec} {case.mutation.kind} #{case.index}"))
    summary.slowest = sorted(summary.slowest, reverse=True)[:5]
    shutil.rmtree(case.path, ignore_errors=True)
    if keep and outcome in BAR + ("LOST",):
        kept = keep_case(keep, base, case)
        summary.kept.append(kept)


def keep_case(keep: str, base: Base, case: Case) -> str:
    """Re-make the damaged copy (as it was before any check) under ``keep``, with case.json beside it."""
    target = os.path.join(keep, f"{case.codec}-{case.index:06d}")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target, exist_ok=True)
    store = os.path.join(target, "store")
    files.copy_store(base.path, store)
    apply(store, case.mutation)
    info = {"seed": base.seed, "codec": case.codec, "index": case.index, "kind": case.mutation.kind,
            "what": case.mutation.what, "outcome": case.outcome, "ops": ops_json(case.mutation.ops),
            "results": {mode: {"outcome": r[0], "first": r[1], "notes": r[2].get("notes", {})}
                        for mode, r in case.results.items()},
            "replay": f"python -m tools.mutate --replay {target}"}
    Path(target, "case.json").write_text(json.dumps(info, indent=1, default=repr))
    return target


def replay(target: str, timeout: float) -> int:
    """Check a kept copy again, both ways, printing every note; 1 when it still misses the bar."""
    info = json.loads(Path(target, "case.json").read_text())
    print(f"{info['codec']} {info['kind']} #{info['index']} (seed {info['seed']}): {info['what']}")
    work = scratch_dir(None)
    runner = Runner(1, timeout)
    worst = "OK"
    try:
        base = build_base(os.path.join(work, "base"), info["codec"], info["seed"])
        prepare(base, runner, work)
        for mode in ("ro", "rw"):
            path = os.path.join(work, f"copy-{mode}")
            files.copy_store(os.path.join(target, "store"), path)
            unit = Unit(None, mode, path, err_path=path + ".err")
            runner.start(unit, lambda p=path, m=mode: examine(base, p, m))
            ((_, end),) = runner.wait_any()
            outcome, first, result = verdict(end, timeout)
            worst = max(worst, outcome, key=_RANK.__getitem__)
            print(f"\n{mode}: {outcome} {first}  ({end['elapsed']:.2f} s)")
            for name, notes in result.get("notes", {}).items():
                for text in notes:
                    print(f"  [{name}] {text}")
            if end.get("stderr"):
                print("  stderr: " + end["stderr"].replace("\n", "\n          "))
    finally:
        runner.kill_all()
        shutil.rmtree(work, ignore_errors=True)
    return 1 if worst in BAR else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--copies", type=int, default=2000, help="damaged copies per codec (default 2000)")
    parser.add_argument("--codec", default=",".join(CODECS),
                        help=f"comma-separated spill codecs among {', '.join(CODECS)} (default all)")
    parser.add_argument("--kind", default="all", help=f"comma-separated kinds of damage among {', '.join(KINDS)}"
                                                      " (default all, taken in turn)")
    parser.add_argument("--seed", type=lambda text: int(text, 0), default=None,
                        help="seed (default: PAGEDKV_SEED, else random; printed either way)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a check may run (default 30)")
    parser.add_argument("--jobs", type=int, default=2, help="checks run at once (default 2)")
    parser.add_argument("--keep", default=None, help="directory where copies that miss the bar are kept")
    parser.add_argument("--dir", default=None, help="scratch directory (default: /dev/shm if tmpfs, else temp)")
    parser.add_argument("--strict", action="store_true", help="LOST copies fail the run too")
    parser.add_argument("--progress", type=int, default=500, help="a line every N copies per codec (0: never)")
    parser.add_argument("--replay", default=None, help="check one kept copy again (a --keep directory entry)")
    args = parser.parse_args(argv)
    args.codecs = tuple(c.strip() for c in args.codec.split(",") if c.strip())
    args.kinds = KINDS if args.kind == "all" else tuple(k.strip() for k in args.kind.split(",") if k.strip())
    if set(args.codecs) - set(CODECS):
        parser.error(f"unknown codec(s) {sorted(set(args.codecs) - set(CODECS))}")
    if set(args.kinds) - set(KINDS):
        parser.error(f"unknown kind(s) {sorted(set(args.kinds) - set(KINDS))}")
    if args.copies < 1 or args.jobs < 1 or args.timeout <= 0:
        parser.error("--copies and --jobs must be positive, --timeout above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the campaign (or ``--replay`` one copy); print the table; 1 when the bar is not met."""
    args = parse_args(argv)
    if args.replay:
        return replay(args.replay, args.timeout)
    seed = args.seed
    if seed is None:
        seed = get_seed("mutation campaign")
    else:
        print(f"PAGEDKV_SEED={seed} (mutation campaign)", flush=True)
    began = time.monotonic()
    summary = campaign(args.copies, args.codecs, seed, args.jobs, args.timeout, args.keep, args.kinds,
                       args.dir, args.progress)
    print()
    print(summary.table())
    print(f"\n{summary.copies} copies ({args.copies} per codec, {len(args.kinds)} kinds), jobs {args.jobs}, "
          f"{time.monotonic() - began:.1f} s in all; slowest copies: "
          + ", ".join(f"{what} {sec:.2f} s" for sec, what in summary.slowest[:3]))
    print(f"lossy pages accepted within the int8 bound only: {summary.tolerated}; "
          f"checksummed-record damage that read back clean and unreported: {summary.unreported_sealed}")
    examples = summary.examples()
    if examples:
        print("\nexamples:\n" + examples)
    if summary.kept:
        print(f"\n{len(summary.kept)} copies kept under {args.keep}")
    failed = summary.failures(args.strict)
    bar = "0 WRONG, UNTYPED, CRASH and HANG" + (" and LOST" if args.strict else "")
    print(f"\nseed {seed}: " + (f"FAILED the bar ({bar}): {failed} copies" if failed else f"met the bar ({bar})"))
    return 1 if failed else 0



if __name__ == "__main__":
    sys.exit(main())
