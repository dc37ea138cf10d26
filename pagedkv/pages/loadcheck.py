"""Reading the committed metadata records back: every record checked before the page table takes it.

``persist.load`` reads the records in one transaction and hands them here: each
meta record, directory entry, block table and token list is checked (its
checksum when the store's records are sealed, then every field and every
reference between them), and what fails is damage, one line each, never a value
the page table takes.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from ..storage.codec import unpack_bounded
from ..storage.codecs import CODECS
from ..storage.metarecord import (DIR_DTYPE, DIR_DTYPE_V1, TAG_DIR, TAG_META, TAG_SEQS, TAG_TOKENS, TRAILER,
                                  sealed_ok, unseal)
from ..storage.schema import MAX_TICK, state_problems
from .directory import CODEC_SHIFT, HAS_TOKENS, HASHED, SPILLED
from .lrulog import BASE_KEY, StampLog, apply_deltas
from .manager import BlockManager
from .sequence import Sequence

FLAG_BITS = HASHED | HAS_TOKENS | 3 << CODEC_SHIFT  # every flag bit a directory entry may set
COUNTS = struct.Struct("<3Q")  # records in dir, seqs and tokens after the last write transaction


def check_counts(mgr: BlockManager, raw: bytes | None, found: tuple[int, int, int],
                  damage: list[str]) -> None:
    if not mgr.sealed or raw is None:
        if mgr.sealed and any(found):
            damage.append("the counts record of a store holding records is missing")
        return
    body = unseal(TAG_META, b"counts", raw, mgr.seed)
    if body is None or len(body) != COUNTS.size:
        damage.append("counts record fails its checksum")
        return
    for name, want, have in zip(("directory entries", "block tables", "token lists"), COUNTS.unpack(body),
                                found):
        if want != have:
            damage.append(f"{have} {name} found, the last write left {want}")


def check_tokens(mgr: BlockManager, count: int, keys: list[bytes], values: list[bytes],
                  damage: list[str]) -> None:
    """Every stored token list passes its checksum and holds exactly its page's committed ids,
    and every page that says its ids are known has them (token lists only grow, so an older
    list put back is too short)."""
    if mgr.sealed and keys:
        for index in np.flatnonzero(~sealed_ok(TAG_TOKENS, keys, values, mgr.seed))[:20].tolist():
            damage.append(f"token ids under key {keys[index].hex()} fail their checksum")
    has_ids = (mgr.flags[:count] & HAS_TOKENS) != 0
    with_ids = mgr.uid[:count][has_ids]
    sized = [index for index, key in enumerate(keys) if len(key) == 8]
    stored = np.frombuffer(b"".join(keys[i] for i in sized), ">u8").astype(np.uint64)
    for uid in np.setdiff1d(with_ids, stored)[:20].tolist():
        damage.append(f"page {uid} records token ids but none are stored")
    if mgr.sealed and count and len(stored):
        pos = np.minimum(np.searchsorted(mgr.uid[:count], stored), count - 1)
        mine = (mgr.uid[pos] == stored) & has_ids[pos]
        lengths = np.array([(len(values[i]) - TRAILER) // 4 for i in sized], np.int64)
        for index in np.flatnonzero(mine & (lengths != mgr.fill[pos]))[:20].tolist():
            damage.append(f"page {int(stored[index])} holds {int(mgr.fill[pos[index]])} tokens "
                          f"but {int(lengths[index])} stored token ids")


def meta_body(mgr: BlockManager, key: bytes, raw: Any, damage: list[str]) -> bytes | None:
    """The body of meta record ``key`` (checked when sealed); None if absent or damaged."""
    if raw is None:
        return None
    if not mgr.sealed:
        return bytes(raw)
    body = unseal(TAG_META, key, raw, mgr.seed)
    if body is None:
        damage.append(f"{key.decode()} record fails its checksum")
    return body


def load_state(mgr: BlockManager, raw: Any, damage: list[str]) -> dict[str, Any]:
    body = meta_body(mgr, b"state", raw, damage)
    if body is None:
        return {}
    try:
        state = unpack_bounded(body, 4096)
    except Exception:
        damage.append("state record does not decode")
        return {}
    problems = state_problems(state)
    damage += problems
    return {} if problems else state


def load_stamps(mgr: BlockManager, raw: Any, deltas: list[tuple[bytes, bytes]], span: list[int],
                damage: list[str]) -> tuple[np.ndarray | None, StampLog]:
    """The committed LRU stamps (base record ``raw`` with the log's ``deltas`` applied) and the log.

    None when the base is absent or damaged; the base alone when a delta is.
    """
    body = meta_body(mgr, BASE_KEY, raw, damage)
    stamps: np.ndarray | None = None
    if body is not None and len(body) != 8 * mgr.pool_pages:
        damage.append(f"lru record holds {len(body)} bytes for {mgr.pool_pages} slots")
    elif body is not None:
        stamps = np.frombuffer(body, dtype="<i8")
        if len(stamps) and (stamps.min() < 0 or stamps.max() > MAX_TICK):
            damage.append("lru record holds a stamp outside [0, 2**62]")
            stamps = None
    return apply_deltas(stamps, deltas, span, mgr.pool_pages, mgr.seed if mgr.sealed else None, damage)


def load_rows(mgr: BlockManager, keys: list[bytes], values: list[bytes],
               damage: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The uids and rows of the sound directory entries, in key order; the rest is damage."""
    dtype = DIR_DTYPE if mgr.sealed else DIR_DTYPE_V1
    size = dtype.itemsize + (TRAILER if mgr.sealed else 0)
    ok = np.array([len(k) == 8 and len(v) == size for k, v in zip(keys, values)], bool)
    if mgr.sealed and ok.any():
        good = np.flatnonzero(ok)
        ok[good] = sealed_ok(TAG_DIR, [keys[i] for i in good], [values[i] for i in good], mgr.seed)
    raw = np.frombuffer(b"".join(values[i][:dtype.itemsize] for i in np.flatnonzero(ok)), dtype)
    rows = np.zeros(len(raw), DIR_DTYPE)
    for name in DIR_DTYPE_V1.names or ():
        rows[name] = raw[name]
    uids = np.frombuffer(b"".join(keys[i] for i in np.flatnonzero(ok)), dtype=">u8").astype(np.uint64)
    # Format 1 kept no chain class: each hashed page was the first of its own.
    rows["chain"] = raw["chain"] if mgr.sealed else np.where(rows["flags"] & HASHED, uids, 0)
    for index in np.flatnonzero(~ok).tolist():
        damage.append(f"directory entry {keys[index].hex()} fails its checksum or has the wrong size")
    where, fill, flags = rows["where"], rows["fill"], rows["flags"]
    hashed = (flags & HASHED) != 0
    bad = ((uids == 0) | (where < SPILLED) | (where >= mgr.pool_pages) | (fill > mgr.geom.page_size)
           | ((flags & ~np.uint32(FLAG_BITS)) != 0) | ((flags >> CODEC_SHIFT & 3) >= len(CODECS))
           | (hashed & (((flags & HAS_TOKENS) == 0) | (fill != mgr.geom.page_size) | (rows["chain"] == 0))))
    resident = np.flatnonzero(where >= 0)
    slots, first, counts = np.unique(where[resident], return_index=True, return_counts=True)
    shared = np.isin(where, slots[counts > 1]) & (where >= 0)
    for index in np.flatnonzero(bad | shared).tolist():
        what = "claims a pool slot another page claims" if shared[index] else "holds an impossible field"
        damage.append(f"directory entry of page {int(uids[index])} {what}")
    keep = ~(bad | shared)
    return uids[keep], rows[keep]


def load_tables(mgr: BlockManager, tables: list[tuple[bytes, bytes]], uids: np.ndarray,
                 damage: list[str]) -> dict[bytes, Sequence]:
    """The sound block tables as sequences; the rest is damage."""
    page_size = mgr.geom.page_size
    seqs: dict[bytes, Sequence] = {}
    for key, value in tables:
        body = unseal(TAG_SEQS, key, value, mgr.seed) if mgr.sealed else value
        name = key_name(key)
        if body is None:
            damage.append(f"block table of {name} fails its checksum")
            continue
        try:
            seq_id, length, raw = unpack_bounded(body, 1 << 30)
            table_uids = np.frombuffer(raw, dtype="<u8")
        except Exception:
            damage.append(f"block table of {name} does not decode")
            continue
        if type(seq_id) not in (str, int) or type(length) is not int or length < 0 \
                or len(table_uids) != -(-length // page_size) or msgpack.packb(seq_id) != key:
            damage.append(f"block table of {name} is inconsistent")
            continue
        pos = np.searchsorted(uids, table_uids)
        if len(table_uids) and (pos.max() >= len(uids) or (uids[np.minimum(pos, len(uids) - 1)]
                                                           != table_uids).any()):
            damage.append(f"block table of {name} names a page not in the directory")
            continue
        expected = np.full(len(pos), page_size)
        if len(pos):
            expected[-1] = length - (len(pos) - 1) * page_size
        if (mgr.fill[pos] < expected).any():
            damage.append(f"block table of {name} is longer than its pages' fill")
            continue
        seqs[key] = Sequence(seq_id, key, pos.astype(np.int32), length)
    return seqs


def key_name(key: bytes) -> str:
    """A sequence key as the id it encodes (or its bytes, when it encodes none)."""
    try:
        seq_id = unpack_bounded(key, 1024)
    except Exception:
        return f"key {key.hex()}"
    return repr(seq_id) if type(seq_id) in (str, int) else f"key {key.hex()}"
