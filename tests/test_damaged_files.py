"""Corrupt files on disk (T7-T10): every damage is a typed error, never wrong data or a crash.

T7  pool.bin: every byte of the header page xor 0xFF, and random bit flips over the slots.
T8  spilled page records: bit flips, truncation, extension and a crafted hostile corpus.
T9  data.mdb structure: byte edits in the meta pages and in branch/leaf page headers.
T10 truncated/extended files, altered geometry fields, foreign pool.bin, future versions.

Crash-prone opens (anything that maps a damaged file) run in forked children; the
store is always closed while a test edits its files.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Callable

import lmdb
import msgpack
import numpy as np
import pytest
import zstandard

import pagedkv
from pagedkv.storage.codec import FORMAT_VERSION, payload_checksum
from pagedkv.storage.metarecord import SUPERBLOCK_SEED, TAG_META, TRAILER, seal
from pagedkv import (FormatVersionError, Geometry, GeometryMismatch, PageCorrupt, PagedKVError,
                     StoreCorrupt)

from tests.kits.child import describe, in_child, in_children
from tests.kits.content import get_seed
from tests.kits.faults import Tally, proc_status_kib, reset_peak_rss, scales, soak
from tests.kits.files import (DATA_MDB, HEADER_NBYTES, LOCK, LOCK_MDB, POOL, SPILL, copy_store, flip_bit,
                              poke, read_header, resize, spill_dbs, spill_env, store_bytes, write_header)
from tests.kits.lmdbfile import META_END, PSIZE, mdb_pages
from tests.kits.model import Model, build_committed
from tests.kits.store import GEOM




TYPED_OPEN = (StoreCorrupt, GeometryMismatch, FormatVersionError)


def build(path: Path, seqs: dict[str, int], seed: int, pool_pages: int, chunks: int = 1,
          geom: Geometry = GEOM) -> Model:
    """A closed store holding ``seqs`` (id -> tokens), appended in ``chunks`` commits each."""
    return build_committed(path, seqs, seed, pool_pages, geom, chunks=chunks)


def page_reads(model: Model) -> list[tuple[str, int, int, int]]:
    """(seq, page index, start, stop) for every page of every sequence."""
    size = model.geom.page_size
    out = []
    for seq, length in model.lens.items():
        for page in range(-(-length // size)):
            out.append((seq, page, page * size, min(length, (page + 1) * size)))
    return out


def read_page(store: pagedkv.KVStore, model: Model, seq: str, start: int, stop: int,
              expected: tuple[bytes, bytes] | None = None) -> tuple[str, float]:
    """Read one page's tokens: ("exact" | "corrupt" | "WRONG" | "untyped: ..."), seconds.

    The time is the CPU time of the read with the garbage collector paused, so that the
    bound measures pagedkv's work rather than the scheduling noise of a shared CI box;
    ``read_page.wall`` keeps the wall-clock time of the last call (for hang checks).
    """
    gc.disable()
    began, wall = time.process_time(), time.perf_counter()
    try:
        k, v = store.read(seq, start, stop)
    except PageCorrupt:
        return "corrupt", time.process_time() - began
    except BaseException as exc:  # noqa: BLE001
        return f"untyped: {describe(exc)}", time.process_time() - began
    finally:
        read_page.wall = time.perf_counter() - wall  # type: ignore[attr-defined]
        gc.enable()
    elapsed = time.process_time() - began
    if expected is None:
        ek, ev = model.expected(seq, start, stop)
        expected = (ek.tobytes(), ev.tobytes())
    same = (k.tobytes(), v.tobytes()) == expected
    return ("exact" if same else "WRONG"), elapsed


read_page.wall = 0.0  # type: ignore[attr-defined]


def covered_token(geom: Geometry, offset_in_page: int) -> int:
    """The token index of a byte inside a page laid out (layers, 2, page_size, heads, dim)."""
    element = offset_in_page // geom.itemsize
    return int(np.unravel_index(element, geom.page_shape)[2])


# -- T7: pool.bin ---------------------------------------------------------------------------

T7_SEQS = {"a": 13, "b": 16, "c": 7, "d": 21}  # 16 pages: the pool is exactly full, 4 partial
T7_POOL = 16


def t7_build(path: Path, seqs: dict[str, int], pool_pages: int, seed: int
             ) -> tuple[Path, Model, dict[int, tuple[str, int, int, int, int]]]:
    """A closed, fully resident store and its layout: slot -> (seq, page, start, stop, fill)."""
    model = build(path, seqs, seed, pool_pages)
    store = pagedkv.open(path)
    try:
        with store.step({seq: 0 for seq in seqs}) as step:
            tables = step.block_tables.copy()
        assert store.stats()["spilled_pages"] == 0
    finally:
        store.close()
    layout = {}
    for row, seq in enumerate(seqs):
        for seq_, page, start, stop in page_reads(model):
            if seq_ == seq:
                layout[int(tables[row, page])] = (seq, page, start, stop, stop - start)
    assert len(layout) == pool_pages
    return path, model, layout


@pytest.fixture
def t7_store(fast_tmp: Path) -> tuple[Path, Model, dict[int, tuple[str, int, int, int, int]]]:
    return t7_build(fast_tmp / "t7", T7_SEQS, T7_POOL, get_seed("T7"))


def header_trials(path: str, bits: bool = False) -> dict[str, Any]:
    """Each header byte xor 0xFF (or, with ``bits``, each header bit flipped) -> open."""
    tally = Tally()
    pool_path = os.path.join(path, POOL)
    original = Path(pool_path).read_bytes()
    worst = 0.0
    changed = 0
    for trial in range(HEADER_NBYTES * (8 if bits else 1)):
        index = trial // 8 if bits else trial
        mutated = bytes([original[index] ^ (1 << (trial % 8) if bits else 0xFF)])
        poke(pool_path, index, mutated)
        readonly = bool(trial % 2)
        began = time.perf_counter()
        try:
            store = pagedkv.open(path, readonly=readonly)
        except StoreCorrupt as exc:
            outcome = "StoreCorrupt" if POOL in str(exc) else "StoreCorrupt without naming pool.bin"
            tally.add(outcome, f"byte {index}: {exc}")
        except BaseException as exc:  # noqa: BLE001
            tally.add(type(exc).__name__, f"byte {index}: {describe(exc)}")
        else:
            store.close()
            tally.add("opened", f"byte {index} xor 0xFF opened cleanly")
        worst = max(worst, time.perf_counter() - began)
        with open(pool_path, "rb") as fh:
            head = fh.read(HEADER_NBYTES)
        if head[index:index + 1] != mutated or len(head) != HEADER_NBYTES:
            changed += 1
        poke(pool_path, index, original[index:index + 1])
    return dict(counts=tally.counts, text=str(tally), worst=worst, changed=changed)


@pytest.mark.slow
def test_pool_header_every_byte(t7_store) -> None:
    path, model, _ = t7_store
    before = store_bytes(path)
    result = in_child(header_trials, str(path), timeout=120)
    assert result.status == "ok", str(result)
    out = result.value
    print(f"T7 header: {HEADER_NBYTES} trials, worst open {out['worst'] * 1e3:.1f} ms\n{out['text']}")
    # The checksum is checked before the version field, so even the version bytes give StoreCorrupt.
    assert out["counts"] == {"StoreCorrupt": HEADER_NBYTES}, out["text"]
    assert out["changed"] == 0, "a failed open rewrote the header page"
    assert out["worst"] < 1.0
    assert store_bytes(path) == before
    store = pagedkv.open(path, readonly=True)
    try:
        model.verify_all(store)
    finally:
        store.close()


def slot_flip_rounds(path: Path, model: Model, layout: dict[int, tuple[str, int, int, int, int]],
                     rounds: Any) -> tuple[Tally, float, int, int]:
    """Apply each round of flips {slot: (offset in page, bit)}, open, read every page, undo.

    Every flip sits in its own slot, so each error is attributable to one page.
    Returns the tally, the worst wall time of a read, the flips and the opens.
    """
    geom = model.geom
    pool_path = path / POOL
    original = pool_path.read_bytes()
    tally = Tally()
    worst = 0.0
    reads = page_reads(model)
    done = opens = 0
    for round_flips in rounds:
        flips = {}
        for slot, (in_page, bit) in round_flips.items():
            seq, page, _, _, fill = layout[slot]
            flips[(seq, page)] = (HEADER_NBYTES + slot * geom.page_nbytes + in_page, bit,
                                  covered_token(geom, in_page) < fill)
        for offset, bit, _ in flips.values():
            flip_bit(pool_path, offset, bit)
        readonly = opens % 2 == 0
        store = pagedkv.open(path, readonly=readonly, durability="nosync" if not readonly else "durable")
        try:
            for seq_, page_, start, stop in reads:
                outcome, _ = read_page(store, model, seq_, start, stop)
                worst = max(worst, read_page.wall)
                flip = flips.get((seq_, page_))
                where = f"open {opens} {'ro' if readonly else 'rw'} {seq_}[{page_}]"
                if flip is None:
                    if outcome != "exact":
                        tally.add(f"other page {outcome}", where)
                elif flip[2]:
                    tally.add("detected" if outcome == "corrupt" else f"flip returned: {outcome}",
                              f"{where}: bit {flip[1]} of byte {flip[0]}")
                else:
                    tally.add("flip outside the covered tokens" if outcome == "exact"
                              else f"uncovered flip -> {outcome}", f"{where}: bit {flip[1]} of byte {flip[0]}")
        finally:
            store.close()
        for offset, bit, _ in flips.values():
            flip_bit(pool_path, offset, bit)
        done += len(flips)
        opens += 1
    assert pool_path.read_bytes() == original, "opening and reading rewrote pool slots"
    return tally, worst, done, opens


def check_slot_flips(tally: Tally, worst: float, flips: int) -> None:
    bad = {k: v for k, v in tally.counts.items() if k not in ("detected", "flip outside the covered tokens")}
    assert not bad, str(tally)
    assert tally.counts.get("detected", 0) > flips // 2
    assert worst < 1.0


@pytest.mark.slow
def test_pool_slot_bit_flips(t7_store) -> None:
    path, model, layout = t7_store
    seed = get_seed("T7 slots")
    rng = random.Random(seed)
    trials, batch = 2000, 4
    rounds = ({slot: (rng.randrange(model.geom.page_nbytes), rng.randrange(8))
               for slot in rng.sample(sorted(layout), batch)} for _ in range(trials // batch))
    tally, worst, flips, opens = slot_flip_rounds(path, model, layout, rounds)
    print(f"T7 slots (seed {seed}): {flips} flips in {opens} opens, worst read {worst * 1e3:.1f} ms\n{tally}")
    check_slot_flips(tally, worst, flips)


@pytest.mark.soak
@pytest.mark.timeout(0)
@pytest.mark.skipif(not soak(), reason="soak size: PAGEDKV_SOAK=1 pytest -m soak")
def test_pool_every_bit_of_a_64k_store(fast_tmp: Path) -> None:
    """Soak: every bit of a 64 KiB pool.bin (524 288 flips): header bits, then slot bits."""
    seed = get_seed("T7 soak")
    rng = random.Random(seed)
    pool_pages = (64 * 1024 - HEADER_NBYTES) // GEOM.page_nbytes
    seqs, left = {}, pool_pages * GEOM.page_size
    while left:
        tokens = min(left, rng.randrange(1, 40))
        if -(-tokens // GEOM.page_size) * GEOM.page_size > left:
            tokens = left
        seqs[f"s{len(seqs)}"] = tokens
        left -= -(-tokens // GEOM.page_size) * GEOM.page_size
    path, model, layout = t7_build(fast_tmp / "t7soak", seqs, pool_pages, seed)
    assert (path / POOL).stat().st_size == 64 * 1024
    result = in_child(header_trials, str(path), True, timeout=36000)
    assert result.status == "ok", str(result)
    assert result.value["counts"] == {"StoreCorrupt": HEADER_NBYTES * 8}, result.value["text"]
    rounds = ({slot: (bit // 8, bit % 8) for slot in layout} for bit in range(GEOM.page_nbytes * 8))
    tally, worst, flips, opens = slot_flip_rounds(path, model, layout, rounds)
    print(f"T7 soak: {HEADER_NBYTES * 8} header bits + {flips} slot bits in {opens} opens\n{tally}")
    check_slot_flips(tally, worst, flips)


# -- T8: spilled records -----------------------------------------------------------------------

T8_SEQS = {"a": 50, "b": 45, "c": 38, "d": 30}  # 43 pages through an 8-slot pool
T8_POOL = 8
_DIR_HEAD = struct.Struct("<iI")  # where (slot, -1 spilled), committed fill: the dir entry's prefix


def spilled_layout(path: Path, model: Model) -> dict[int, tuple[str, int, int, int, int, bytes]]:
    """uid -> (seq, page, start, stop, fill, record) for every spilled page of a closed store."""
    env = spill_env(path, readonly=True, lock=False)
    try:
        dbs = spill_dbs(env)
        with env.begin() as txn:
            tables = {}
            for _, value in txn.cursor(db=dbs["seqs"]):
                seq_id, length, raw = msgpack.unpackb(value[:-8], raw=False)  # less its checksum
                tables[seq_id] = np.frombuffer(raw, "<u8").tolist()
            where = {struct.unpack(">Q", key)[0]: _DIR_HEAD.unpack_from(value)
                     for key, value in txn.cursor(db=dbs["dir"])}
            records = {struct.unpack(">Q", key)[0]: bytes(value) for key, value in txn.cursor(db=dbs["pages"])}
    finally:
        env.close()
    out = {}
    for seq, uids in tables.items():
        for page, uid in enumerate(uids):
            slot, fill = where[uid]
            if slot == -1:
                start = page * model.geom.page_size
                out[uid] = (seq, page, start, min(model.lens[seq], start + model.geom.page_size), fill,
                            records[uid])
    return out


def write_records(path: Path, values: dict[int, bytes]) -> None:
    env = spill_env(path)
    try:
        pages = spill_dbs(env)["pages"]
        with env.begin(write=True) as txn:
            for uid, value in values.items():
                txn.put(struct.pack(">Q", uid), value, db=pages)
    finally:
        env.close()


def t8_build(path: Path, seed: int, codec: str = "raw") -> tuple[Path, Model, dict, dict]:
    """A closed store with spilled pages, its spilled layout and the bytes every page reads as
    (for a lossy codec the reference is what the undamaged store returns, not the input)."""
    model = build_committed(path, T8_SEQS, seed, T8_POOL, spill_codec=codec)
    layout = spilled_layout(path, model)
    assert len(layout) >= 30, len(layout)
    reference = {}
    store = pagedkv.open(path, readonly=True)
    try:
        for seq, page, start, stop in page_reads(model):
            k, v = store.read(seq, start, stop)
            reference[(seq, page)] = (k.tobytes(), v.tobytes())
    finally:
        store.close()
    return path, model, layout, reference


@pytest.fixture
def t8_store(fast_tmp: Path):
    seed = get_seed("T8")
    path, model, layout, _ = t8_build(fast_tmp / "t8", seed)
    return path, model, layout, seed


def mutate_record(rng: random.Random, record: bytes, geom: Geometry, fill: int) -> tuple[bytes, str, bool]:
    """A damaged copy of a record, a description, and whether the damage must be detected."""
    hlen = struct.unpack_from("<I", record)[0]
    start = 4 + hlen
    roll = rng.random()
    if roll < 0.1:
        cut = rng.randrange(0, len(record))
        return record[:cut], f"truncated to {cut}", True
    if roll < 0.2:
        extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600)))
        return record + extra, f"extended by {len(extra)}", True
    offset = rng.randrange(len(record))
    bit = rng.randrange(8)
    damaged = bytearray(record)
    damaged[offset] ^= 1 << bit
    if offset < start:
        return bytes(damaged), f"bit {bit} of header byte {offset}", False
    if msgpack.unpackb(record[4:start], raw=False)["codec"] != "raw":  # its checksum covers every byte
        return bytes(damaged), f"bit {bit} of encoded payload byte {offset - start}", True
    token = covered_token(geom, offset - start)
    return bytes(damaged), f"bit {bit} of payload byte {offset - start} (token {token})", token < fill


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
@pytest.mark.parametrize("codec", ["raw", "zstd", "int8"])
def test_spilled_record_bit_flips(fast_tmp: Path, codec: str, scale: str) -> None:
    seed = get_seed(f"T8 {codec}")
    path, model, layout, reference = t8_build(fast_tmp / "t8", seed, codec)
    codecs = {msgpack.unpackb(rec[4:4 + struct.unpack_from("<I", rec)[0]], raw=False)["codec"]
              for *_, rec in layout.values()}
    assert codec in codecs, codecs  # int8 falls back to zstd for pages holding NaN/Inf
    rng = random.Random(seed + 1)
    trials = {"ci": 2000, "soak": 100000}[scale]
    batch = 12
    uids = sorted(layout)
    reads = page_reads(model)
    by_page = {(seq, page): uid for uid, (seq, page, *_rest) in layout.items()}
    tally = Tally()
    worst, worst_at, worst_wall, worst_kib = 0.0, "", 0.0, 0
    done = 0
    rounds = 0
    while done < trials:
        chosen = rng.sample(uids, min(batch, trials - done))
        damage = {}
        for uid in chosen:
            seq, page, start, stop, fill, record = layout[uid]
            value, what, must = mutate_record(rng, record, model.geom, fill)
            damage[uid] = (value, what, must)
        work = copy_store(path, fast_tmp / f"r{rounds}")
        write_records(work, {uid: value for uid, (value, _, _) in damage.items()})
        readonly = rounds % 2 == 0
        store = pagedkv.open(work, readonly=readonly, durability="durable" if readonly else "nosync")
        try:
            for seq, page, start, stop in reads:
                uid = by_page.get((seq, page))
                tracked = uid in damage and reset_peak_rss()
                base = proc_status_kib("VmRSS") if tracked else 0
                outcome, elapsed = read_page(store, model, seq, start, stop, reference[(seq, page)])
                if tracked:
                    worst_kib = max(worst_kib, proc_status_kib("VmHWM") - base)
                if elapsed > worst:
                    worst, worst_at = elapsed, f"round {rounds} {'ro' if readonly else 'rw'} {seq}[{page}]"
                worst_wall = max(worst_wall, read_page.wall)
                if uid in damage:
                    _, what, must = damage[uid]
                    where = f"{'ro' if readonly else 'rw'} {seq}[{page}] {what}"
                    if outcome == "corrupt":
                        tally.add("detected")
                    elif outcome == "exact" and not must:
                        tally.add("harmless (not returned / not covered)")
                    else:
                        tally.add(f"damaged record -> {outcome}", where)
                elif outcome != "exact":
                    tally.add(f"undamaged page -> {outcome}", f"{seq}[{page}]")
        finally:
            store.close()
        shutil.rmtree(work)
        done += len(chosen)
        rounds += 1
    print(f"T8 flips {codec} (seed {seed}): {trials} damaged records in {rounds} opens, worst read "
          f"{worst * 1e3:.1f} ms CPU ({worst_at}), {worst_wall * 1e3:.1f} ms wall, worst extra peak RSS "
          f"{worst_kib} KiB\n{tally}")
    bad = {k: v for k, v in tally.counts.items()
           if k not in ("detected", "harmless (not returned / not covered)")}
    assert not bad, str(tally)
    assert worst < 0.05, f"a read took {worst * 1e3:.1f} ms of CPU"
    assert worst_wall < 1.0, f"a read took {worst_wall:.2f} s"
    assert worst_kib < 16 << 10, f"a damaged record cost {worst_kib} KiB of extra RSS"


def zstd_frame(declared: int, body: bytes = b"") -> bytes:
    """A zstd frame header declaring ``declared`` content bytes, then one 512-byte RLE block."""
    block = struct.pack("<I", 1 | (1 << 1) | (512 << 3))[:3] + b"\x00"
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", declared) + (body or block)


def corpus(layout: dict[int, tuple], model: Model, store_seed: int
           ) -> list[tuple[str, Callable[[int, bytes], bytes]]]:
    """Hostile records: (name, make(uid, valid record) -> bytes). Every one must be PageCorrupt.

    The encoded-codec entries carry a correct payload checksum (it is a checksum, not a
    MAC: anyone who can write the file can compute it), so they reach the decoder.
    """
    geom = model.geom

    def split(record: bytes) -> tuple[dict[str, Any], bytes]:
        hlen = struct.unpack_from("<I", record)[0]
        return msgpack.unpackb(record[4:4 + hlen], raw=False), record[4 + hlen:]

    def with_header(raw_header: bytes, payload: bytes, hlen: int | None = None) -> bytes:
        return struct.pack("<I", len(raw_header) if hlen is None else hlen) + raw_header + payload

    def field(name: str, value: Any) -> Callable[[int, bytes], bytes]:
        def make(uid: int, record: bytes) -> bytes:
            header, payload = split(record)
            header[name] = value
            return with_header(msgpack.packb(header), payload)
        return make

    def raw_header(blob: bytes, hlen: int | None = None) -> Callable[[int, bytes], bytes]:
        return lambda uid, record: with_header(blob, split(record)[1], hlen)

    def edit(fn: Callable[[dict[str, Any]], Any]) -> Callable[[int, bytes], bytes]:
        def make(uid: int, record: bytes) -> bytes:
            header, payload = split(record)
            header = fn(header)
            return with_header(msgpack.packb(header), payload)
        return make

    def payload(fn: Callable[[bytes], bytes]) -> Callable[[int, bytes], bytes]:
        def make(uid: int, record: bytes) -> bytes:
            header, body = split(record)
            return with_header(msgpack.packb(header), fn(body))
        return make

    other = sorted(layout)
    deep = b"\x91" * 100000 + b"\xc0"
    big = [1 << 20, 1 << 20, 2, geom.kv_heads, geom.head_dim]
    items: list[tuple[str, Callable[[int, bytes], bytes]]] = [
        ("empty value", lambda uid, r: b""),
        ("3 bytes", lambda uid, r: r[:3]),
        ("header length 2^32-1", lambda uid, r: struct.pack("<I", 0xFFFFFFFF) + r[4:]),
        ("header length 0", lambda uid, r: struct.pack("<I", 0) + r[4:]),
        ("header length past the value", lambda uid, r: struct.pack("<I", len(r)) + r[4:]),
        ("nesting 10^5 (declared length)", raw_header(deep)),
        ("nesting 1023 inside 1024 bytes", raw_header(b"\x91" * 1023 + b"\xc0")),
        ("map32 of 2^32-1 entries", raw_header(b"\xdf\xff\xff\xff\xff")),
        ("array32 of 2^32-1 items", raw_header(b"\xdd\xff\xff\xff\xff")),
        ("bin32 of 2^32-1 bytes", raw_header(b"\xc6\xff\xff\xff\xff")),
        ("str32 of 2^32-1 bytes", raw_header(b"\xdb\xff\xff\xff\xff")),
        ("ext32 of 2^32-1 bytes", raw_header(b"\xc9\xff\xff\xff\xff\x01")),
        ("header is nil", raw_header(msgpack.packb(None))),
        ("header is a list", raw_header(msgpack.packb([1, 2, 3]))),
        ("header is an int", raw_header(msgpack.packb(7))),
        ("int keys", edit(lambda h: {i: v for i, v in enumerate(h.values())})),
        ("bytes keys", edit(lambda h: {k.encode(): v for k, v in h.items()})),
        ("extra key", edit(lambda h: {**h, "x": 1})),
        ("missing key", edit(lambda h: {k: v for k, v in h.items() if k != "csum"})),
        ("ExtType value", field("fill", msgpack.ExtType(1, b"\x01"))),
        ("Timestamp value", field("csum", msgpack.Timestamp(1, 0))),
        ("bad UTF-8 in dtype", lambda uid, r: r),  # replaced below (needs raw bytes)
        ("bad UTF-8 key", lambda uid, r: r),  # replaced below
        ("fill is a float", field("fill", 1.0)),
        ("fill is a bool", field("fill", True)),
        ("uid is a str", field("uid", "1")),
        ("shape is a dict", field("shape", {"a": 1})),
        ("shape is a str", field("shape", "shape")),
        ("dtype is an int", field("dtype", 2)),
        ("v is a bool", field("v", True)),
        ("nbytes is nil", field("nbytes", None)),
        ("negative dims", field("shape", [-geom.layers, 2, geom.page_size, geom.kv_heads, geom.head_dim])),
        ("zero dim", field("shape", [0, 2, geom.page_size, geom.kv_heads, geom.head_dim])),
        ("prod(shape) > 2^40", edit(lambda h: {**h, "shape": big,
                                               "nbytes": int(np.prod(big, dtype=object)) * geom.itemsize})),
        ("dtype object", field("dtype", "object")),
        ("dtype float64", field("dtype", "float64")),
        ("dtype <U8", field("dtype", "<U8")),
        ("dtype V512", field("dtype", "V512")),
        ("nbytes 2^63", field("nbytes", 1 << 63)),
        ("nbytes -1", field("nbytes", -1)),
        ("fill -1", field("fill", -1)),
        ("fill past the page", field("fill", geom.page_size + 1)),
        ("fill 2^64-1", field("fill", (1 << 64) - 1)),
        ("csum -1", field("csum", -1)),
        ("csum off by one", edit(lambda h: {**h, "csum": (h["csum"] + 1) % (1 << 64)})),
        ("future record version", field("v", 2)),
        ("record version 0", field("v", 0)),
        ("unknown codec", field("codec", "lz4")),
        ("codec is an int", field("codec", 1)),
        ("uid of another page", edit(lambda h: {**h, "uid": h["uid"] + 1})),
        ("payload one byte short", payload(lambda b: b[:-1])),
        ("payload empty", payload(lambda b: b"")),
        ("one trailing byte", payload(lambda b: b + b"\x00")),
        ("1 MiB trailing", payload(lambda b: b + bytes(1 << 20))),
        ("trailing bytes inside the header", lambda uid, r: with_header(
            msgpack.packb(split(r)[0]) + b"\xc0", split(r)[1])),
        ("another page's record", lambda uid, r: layout[other[(other.index(uid) + 1) % len(other)]][5]),
        ("payload bytes of another page", lambda uid, r: with_header(
            msgpack.packb(split(r)[0]), split(layout[other[(other.index(uid) + 1) % len(other)]][5])[1])),
    ]

    def encoded(codec: str, payload_of: Callable[[dict[str, Any]], bytes]) -> Callable[[int, bytes], bytes]:
        def make(uid: int, record: bytes) -> bytes:
            header, _ = split(record)
            payload = payload_of(header)
            header.update(codec=codec, nbytes=len(payload),
                          csum=payload_checksum(payload, header["fill"], uid, store_seed))
            return with_header(msgpack.packb(header), payload)
        return make

    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(32 << 20))
    nscales = geom.layers * 2 * geom.kv_heads
    quant = bytes(geom.page_nbytes // geom.itemsize)
    items += [
        ("zstd bomb: 32 MiB of zeros", encoded("zstd", lambda h: bomb)),
        ("zstd frame declaring 2^40 bytes", encoded("zstd", lambda h: zstd_frame(1 << 40))),
        ("zstd frame declaring 1 GiB", encoded("zstd", lambda h: zstd_frame(1 << 30))),
        ("zstd frame declaring one byte too many", encoded("zstd", lambda h: zstd_frame(geom.page_nbytes + 1))),
        ("zstd garbage", encoded("zstd", lambda h: bytes(range(200)))),
        ("zstd of a short page", encoded("zstd", lambda h: zstandard.ZstdCompressor().compress(
            bytes(geom.page_nbytes - 4)))),
        ("int8 NaN scale", encoded("int8", lambda h: np.full(nscales, np.nan, np.float32).tobytes() + quant)),
        ("int8 negative scale", encoded("int8", lambda h: np.full(nscales, -1, np.float32).tobytes() + quant)),
        ("int8 payload one byte short", encoded("int8", lambda h: bytes(4 * nscales) + quant[:-1])),
        ("zstd payload with a wrong checksum", edit(lambda h: {**h, "codec": "zstd"})),
    ]

    def bad_utf8(key: bool) -> Callable[[int, bytes], bytes]:
        def make(uid: int, record: bytes) -> bytes:
            header, body = split(record)
            packed = bytearray(msgpack.packb(header))
            needle = msgpack.packb("dtype") if key else msgpack.packb(header["dtype"])
            at = bytes(packed).index(needle)
            packed[at + 1] = 0xFF  # the first character byte becomes invalid UTF-8
            return with_header(bytes(packed), body)
        return make

    named = dict(items)
    named["bad UTF-8 in dtype"] = bad_utf8(False)
    named["bad UTF-8 key"] = bad_utf8(True)
    return list(named.items())


def corpus_child(path: str, model: Model, cases: dict[int, str], readonly: bool) -> list[tuple]:
    """Read each crafted page once; return (name, outcome, ms, extra peak RSS KiB)."""
    store = pagedkv.open(path, readonly=readonly, durability="durable" if readonly else "nosync")
    seq_of = {}
    out = []
    try:
        for uid, (name, seq, start, stop) in cases.items():
            seq_of[uid] = seq
            tracked = reset_peak_rss()
            base = proc_status_kib("VmRSS")
            outcome, elapsed = read_page(store, model, seq, start, stop)
            extra = proc_status_kib("VmHWM") - base if tracked else -1
            out.append((name, outcome, elapsed * 1e3, extra, read_page.wall * 1e3))
    finally:
        store.close()
    return out


def test_hostile_record_corpus(t8_store, fast_tmp: Path) -> None:
    path, model, layout, _ = t8_store
    uids = sorted(layout)
    items = corpus(layout, model, int.from_bytes(read_header(path)["uuid"][:8], "little"))
    results: list[tuple] = []
    for batch_no, first in enumerate(range(0, len(items), len(uids))):
        batch = items[first:first + len(uids)]
        work = copy_store(path, fast_tmp / f"corpus{batch_no}")
        values, cases = {}, {}
        for (name, make), uid in zip(batch, uids):
            seq, page, start, stop, fill, record = layout[uid]
            values[uid] = make(uid, record)
            assert values[uid] != record, name
            cases[uid] = (name, seq, start, stop)
        write_records(work, values)
        for readonly in (True, False):
            run = copy_store(work, fast_tmp / f"corpus{batch_no}-{readonly}")
            result = in_child(corpus_child, str(run), model, cases, readonly, timeout=60)
            assert result.status == "ok", f"corpus batch {batch_no} ({'ro' if readonly else 'rw'}): {result}"
            results += [(f"{'ro' if readonly else 'rw'} {name}", *rest) for name, *rest in result.value]
    bad = [r for r in results if r[1] != "corrupt"]
    slow = [r for r in results if r[2] >= 50]
    fat = [r for r in results if r[3] >= 16 << 10]
    worst_ms = max(r[2] for r in results)
    worst_kib = max(r[3] for r in results)
    worst_wall = max(r[4] for r in results)
    print(f"T8 corpus: {len(items)} crafted records x 2 modes; worst {worst_ms:.2f} ms CPU "
          f"({worst_wall:.2f} ms wall), worst extra peak RSS {worst_kib} KiB")
    assert len(items) >= 50
    problems = [f"{name}: {outcome}" for name, outcome, *_ in bad]
    problems += [f"{name}: {ms:.1f} ms of CPU (> 50 ms)" for name, _, ms, *_ in slow]
    problems += [f"{name}: {kib} KiB of extra peak RSS (>= 16 MiB)" for name, _, _, kib, _ in fat]
    problems += [f"{name}: {wall:.0f} ms wall (a hang)" for name, _, _, _, wall in results if wall >= 1000]
    assert not problems, "\n".join(problems)


# -- T9: data.mdb structure ---------------------------------------------------------------------

def open_read_all(path: str, model: Model, readonly: bool) -> str:
    """Open, read every sequence, check and close; classify what happened (runs in a child)."""
    try:
        store = pagedkv.open(path, readonly=readonly, durability="durable" if readonly else "nosync")
    except PagedKVError as exc:
        return f"typed {type(exc).__name__} at open"
    except BaseException as exc:  # noqa: BLE001
        return f"UNTYPED at open: {describe(exc)}"
    outcome = "clean"
    try:
        seqs = store.sequences()
        for seq in seqs:
            if seq not in model.lens:
                return f"WRONG: unknown sequence {seq!r}"
            length = store.length(seq)
            if length > model.lens[seq]:
                return f"WRONG: {seq!r} has {length} tokens, more than ever written"
            try:
                k, v = store.read(seq)
            except PagedKVError as exc:
                outcome = f"typed {type(exc).__name__} on read"
                continue
            ek, ev = model.expected(seq, 0, length)
            if k.tobytes() != ek.tobytes() or v.tobytes() != ev.tobytes():
                return f"WRONG data in {seq!r}"
            if length != model.lens[seq]:
                outcome = "clean, an earlier commit" if outcome == "clean" else outcome
        if len(seqs) != len(model.lens) and outcome == "clean":
            outcome = "clean, an earlier commit"
        if not readonly:
            try:
                store.check()
            except PagedKVError as exc:
                outcome = f"typed {type(exc).__name__} in check"
    except BaseException as exc:  # noqa: BLE001
        return f"UNTYPED: {describe(exc)}"
    finally:
        try:
            store.close()
        except PagedKVError as exc:
            outcome = f"typed {type(exc).__name__} at close"
        except BaseException as exc:  # noqa: BLE001
            outcome = f"UNTYPED at close: {describe(exc)}"
    return outcome


@pytest.fixture
def t9_store(fast_tmp: Path):
    seed = get_seed("T9")
    path = fast_tmp / "t9"
    model = build(path, {"a": 90, "b": 70, "c": 50, "d": 33, "e": 21}, seed, 8, chunks=3)
    return path, model, seed


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_lmdb_structure_edits(t9_store, fast_tmp: Path, scale: str) -> None:
    path, model, seed = t9_store
    rng = random.Random(seed)
    data = (path / DATA_MDB).read_bytes()
    kinds = mdb_pages(data)
    assert kinds["branch"] and kinds["leaf"], {k: len(v) for k, v in kinds.items()}
    edits = {"ci": 500, "soak": 20000}[scale]
    plan = []
    for trial in range(edits):
        roll = rng.random()
        if roll < 0.4:
            pgno, span, kind = rng.choice([0, 1]), META_END, "meta"
        else:
            kind = "branch" if roll < 0.6 else "leaf"
            pgno = rng.choice(kinds[kind])
            lower = struct.unpack_from("<H", data, pgno * PSIZE + 12)[0]
            span = max(16, min(lower, PSIZE))  # header and the node offset array
        offset = pgno * PSIZE + rng.randrange(span)
        value = rng.choice([0x00, 0xFF, data[offset] ^ (1 << rng.randrange(8)), rng.randrange(256)])
        if value == data[offset]:
            value ^= 0x80
        readonly = trial % 2 == 0
        what = f"{kind} page {pgno} byte {offset % PSIZE}: {data[offset]:#04x}->{value:#04x} " \
               f"({'ro' if readonly else 'rw'})"
        plan.append((str(path), str(fast_tmp / f"edit{trial}"), offset, value, readonly, what))

    def edit_and_read(item: tuple) -> str:
        source, work, offset, value, readonly, _ = item
        shutil.rmtree(work, ignore_errors=True)  # left behind if a crash is being re-run alone
        copy_store(source, work)
        try:
            poke(Path(work, DATA_MDB), offset, bytes([value]))
            return open_read_all(work, model, readonly)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    tally = Tally()
    for item, result in zip(plan, in_children(edit_and_read, plan, timeout=5)):
        what = item[-1]
        tally.add_result(result, what, 5)
    print(f"T9 (seed {seed}): {edits} edits of data.mdb (pages: "
          f"{ {k: len(v) for k, v in kinds.items()} }), lmdb {lmdb.version(True)}\n{tally}")
    bad = {k: v for k, v in tally.counts.items() if not (k.startswith("clean") or k.startswith("typed"))}
    assert not bad, str(tally)


def test_lmdb_is_the_bundled_patched_build() -> None:
    """T9 relies on py-lmdb's bundled, patched LMDB (not LMDB_FORCE_SYSTEM or the cffi build)."""
    assert hasattr(lmdb, "cpython"), "py-lmdb's C extension is not in use"
    assert len(lmdb.version(True)) == 4 and lmdb.version(True)[3] >= 1, lmdb.version(True)


# -- T10: truncation, geometry fields, foreign files, future versions ---------------------------


@pytest.fixture
def t10_store(fast_tmp: Path):
    seed = get_seed("T10")
    path = fast_tmp / "t10"
    model = build(path, {"a": 30, "b": 21}, seed, 8, chunks=2)
    other = fast_tmp / "other"
    build(other, {"z": 9}, seed + 1, 8)
    return path, model, other


def superblock(path: Path) -> dict[str, Any]:
    env = spill_env(path, readonly=True, lock=False)
    try:
        meta = spill_dbs(env)["meta"]
        with env.begin() as txn:
            return msgpack.unpackb(txn.get(b"superblock", db=meta)[:-TRAILER], raw=False)
    finally:
        env.close()


def put_superblock(path: Path, fields: dict[str, Any]) -> None:
    env = spill_env(path)
    try:
        meta = spill_dbs(env)["meta"]
        with env.begin(write=True) as txn:
            # Sealed as a writer would: these cases test the fields, not the checksum.
            txn.put(b"superblock", seal(TAG_META, b"superblock", msgpack.packb(fields), SUPERBLOCK_SEED),
                    db=meta)
    finally:
        env.close()


def t10_cases(path: Path, other: Path) -> list[tuple[str, Callable[[Path], None], tuple[str, ...], bool]]:
    """(name, damage(work dir), words of which the error must name one, a clean open is fine)."""
    cases: list[tuple[str, Callable[[Path], None], tuple[str, ...], bool]] = []
    for name, benign_extension in ((POOL, False), (DATA_MDB, True), (LOCK_MDB, True), (LOCK, True)):
        full = os.path.getsize(path / name)
        names = (POOL,) if name == POOL else ("data.mdb", SPILL) if name == DATA_MDB else (name,)
        benign_cut = name in (LOCK, LOCK_MDB)  # lock files are rebuilt; they hold no data
        for size in sorted({0, 1, 4095, full // 2, full - 1}):
            cases.append((f"{name} truncated to {size}", lambda w, n=name, s=size: resize(w / n, s),
                          names, benign_cut))
        cases.append((f"{name} extended by a page", lambda w, n=name, s=full: resize(w / n, s + 4096),
                      names, benign_extension))
    header = read_header(path)
    changes = {
        "layers": header["layers"] + 1, "kv_heads": header["kv_heads"] * 2, "head_dim": header["head_dim"] + 4,
        "page_size": header["page_size"] * 2, "dtype": b"float16", "pool_pages": header["pool_pages"] + 1,
        "page_nbytes": header["page_nbytes"] * 2, "uuid": bytes(16), "version": 0,
    }
    for field_name, value in changes.items():
        cases.append((f"header {field_name} altered (checksum recomputed)",
                      lambda w, f=field_name, v=value: write_header(w, {**read_header(w), f: v}),
                      (POOL,), False))
    cases.append(("header layers and page_nbytes altered consistently",
                  lambda w: write_header(w, {**read_header(w), "layers": header["layers"] * 2,
                                             "page_nbytes": header["page_nbytes"] * 2}), (POOL,), False))
    cases.append(("header future format version", lambda w: write_header(w, {**read_header(w), "version": FORMAT_VERSION + 1}),
                  (POOL,), False))
    sb = superblock(path)
    for key in sb["geometry"]:
        value = "float16" if key == "dtype" else sb["geometry"][key] + 1
        cases.append((f"superblock geometry {key} altered",
                      lambda w, k=key, v=value: put_superblock(w, {**sb, "geometry": {**sb["geometry"], k: v}}),
                      ("superblock", SPILL, POOL), False))
    for key, value in (("pool_pages", sb["pool_pages"] + 1), ("uuid", bytes(16)), ("format", FORMAT_VERSION + 1),
                       ("format", 0), ("format", -1), ("format", "1"), ("geometry", {"layers": 1})):
        cases.append((f"superblock {key}={value!r}",
                      lambda w, k=key, v=value: put_superblock(w, {**sb, k: v}),
                      ("superblock", SPILL, POOL), False))
    cases.append(("superblock missing", lambda w: put_superblock(w, {}), ("superblock", SPILL), False))
    cases.append(("pool.bin of another store", lambda w: shutil.copyfile(other / POOL, w / POOL),
                  (POOL,), False))
    cases.append(("spill/ of another store", lambda w: (shutil.rmtree(w / SPILL),
                                                        shutil.copytree(other / SPILL, w / SPILL)),
                  (POOL, SPILL, "superblock"), False))
    return cases


def attempt_open(path: str, model: Model, readonly: bool, **kwargs: Any) -> tuple[str, str]:
    """(outcome, message): "clean" (exact data), "WRONG", or the exception type."""
    try:
        store = pagedkv.open(path, readonly=readonly, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    try:
        model.verify_all(store)
    except AssertionError as exc:
        return "WRONG", str(exc)[:200]
    except BaseException as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    finally:
        store.close()
    return "clean", ""


@pytest.mark.slow
def test_damaged_files_fail_typed_and_untouched(t10_store, fast_tmp: Path) -> None:
    path, model, other = t10_store
    problems = []
    cases = t10_cases(path, other)
    for number, (name, damage, names, clean_ok) in enumerate(cases):
        for readonly in (False, True):
            work = copy_store(path, fast_tmp / f"case{number}-{readonly}")
            damage(work)
            before = store_bytes(work)
            result = in_child(attempt_open, str(work), model, readonly, timeout=10)
            where = f"{name} ({'read-only' if readonly else 'writer'})"
            if result.status != "ok":
                problems.append(f"{where}: child {result}")
                continue
            outcome, message = result.value
            if outcome == "clean":
                if not clean_ok:
                    problems.append(f"{where}: opened cleanly")
                continue
            if outcome == "WRONG":
                problems.append(f"{where}: WRONG DATA {message}")
                continue
            if outcome not in {t.__name__ for t in TYPED_OPEN}:
                problems.append(f"{where}: {outcome}: {message}")
            elif not any(word in message for word in names):
                problems.append(f"{where}: {outcome} does not name {' or '.join(names)}: {message}")
            if store_bytes(work) != before:
                problems.append(f"{where}: the failed open changed the store's bytes (re-initialised?)")
            shutil.rmtree(work)
    print(f"T10: {len(cases)} damages x 2 modes")
    assert not problems, "\n".join(problems)


def test_explicit_geometry_mismatch_names_the_field(t10_store) -> None:
    path, model, _ = t10_store
    before = store_bytes(path)
    variants = {
        "layers": Geometry(GEOM.layers + 1, GEOM.kv_heads, GEOM.head_dim, GEOM.page_size, GEOM.dtype),
        "kv_heads": Geometry(GEOM.layers, GEOM.kv_heads + 1, GEOM.head_dim, GEOM.page_size, GEOM.dtype),
        "head_dim": Geometry(GEOM.layers, GEOM.kv_heads, GEOM.head_dim * 2, GEOM.page_size, GEOM.dtype),
        "page_size": Geometry(GEOM.layers, GEOM.kv_heads, GEOM.head_dim, GEOM.page_size * 2, GEOM.dtype),
        "dtype": Geometry(GEOM.layers, GEOM.kv_heads, GEOM.head_dim, GEOM.page_size, "float16"),
    }
    for field_name, geom in variants.items():
        for readonly in (False, True):
            with pytest.raises(GeometryMismatch, match=field_name):
                pagedkv.open(path, geom, readonly=readonly)
    with pytest.raises(GeometryMismatch, match="pool"):
        pagedkv.open(path, GEOM, 9)
    assert store_bytes(path) == before
    store = pagedkv.open(path, GEOM, 8)
    try:
        model.verify_all(store)
    finally:
        store.close()
