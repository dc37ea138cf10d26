"""Committing the in-memory state to LMDB, and loading it back on reopen.

The commit protocol holds the write-ahead order: checksums of changed pages are
computed, their pool slots flushed (durable mode), and only then one LMDB
transaction records directory, block tables, LRU stamps and counters together.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack
import numpy as np
import xxhash

from . import faults
from .codec import FORMAT_VERSION, unpack_bounded
from .errors import FormatVersionError, StoreCorrupt
from .geometry import Geometry
from .manager import (CODEC_SHIFT, DIR_ENTRY, HAS_TOKENS, HASHED, NOWHERE, REC_CURRENT, REC_NONE, SPILLED,
                      BlockManager)
from .sequence import Sequence
from .spill import SpillStore, key_uid, uid_key

_DIR_DTYPE = np.dtype([("where", "<i4"), ("fill", "<u4"), ("csum", "<u8"), ("flags", "<u4"),
                       ("hash", "V16"), ("parent", "<u8")])
assert _DIR_DTYPE.itemsize == DIR_ENTRY.size
_IDENT_DTYPE = np.dtype([("uid", "<u8"), ("fill", "<u4")])  # what page_checksum hashes first
_GATHER_BYTES = 16 << 20  # partial-page bytes copied per checksum batch: bounded for big pages


def write_superblock(spill: SpillStore, fields: dict[str, Any]) -> None:
    """Record the store's identity once, at creation."""
    blob = msgpack.packb(fields)
    spill.write(lambda txn: spill.put(txn, spill.meta, b"superblock", blob), "create")


def rewrite_superblock(spill: SpillStore, superblock: dict[str, Any]) -> None:
    """Record a changed superblock field (the model fingerprint, when adopting another)."""
    fields = dict(superblock, geometry=superblock["geometry"].to_dict())
    write_superblock(spill, fields)


def read_superblock(spill: SpillStore) -> dict[str, Any]:
    """The superblock, validated as untrusted input."""
    with spill.begin_read() as txn:
        raw = txn.get(b"superblock", db=spill.meta)
        if raw is None:
            raise StoreCorrupt(f"{spill.path}: superblock is missing (store creation never completed)")
        try:
            sb = unpack_bounded(bytes(raw), 4096)
        except Exception:
            raise StoreCorrupt(f"{spill.path}: superblock does not decode") from None
    if not isinstance(sb, dict) or not {"format", "uuid", "geometry", "pool_pages"} <= set(sb):
        raise StoreCorrupt(f"{spill.path}: superblock lacks required fields")
    if type(sb["format"]) is not int or sb["format"] < 1:
        raise StoreCorrupt(f"{spill.path}: superblock format field is invalid")
    if sb["format"] > FORMAT_VERSION:
        raise FormatVersionError(
            f"{spill.path}: format version {sb['format']}; this pagedkv reads up to {FORMAT_VERSION}")
    if not isinstance(sb["uuid"], bytes) or len(sb["uuid"]) != 16 or type(sb["pool_pages"]) is not int:
        raise StoreCorrupt(f"{spill.path}: superblock identity fields are invalid")
    try:
        sb["geometry"] = Geometry.from_dict(sb["geometry"])
    except Exception as exc:
        raise StoreCorrupt(f"{spill.path}: superblock geometry is invalid ({exc})") from None
    return sb


def commit(mgr: BlockManager, dirty: dict[bytes, Sequence], dropped: set[bytes],
           state: dict[str, Any], durable: bool) -> None:
    """Make the current state the committed one, in write-ahead order."""
    pids = np.flatnonzero(mgr.chg & mgr.live)
    refresh_checksums(mgr, pids[(mgr.slot[pids] >= 0) & ~mgr.csum_ok[pids]])
    where = np.where(mgr.slot[pids] >= 0, mgr.slot[pids], SPILLED).astype(np.int32)
    rows = np.zeros(len(pids), _DIR_DTYPE)
    rows["where"], rows["fill"], rows["csum"] = where, mgr.fill[pids], mgr.csum[pids]
    rows["flags"] = mgr.flags[pids].astype(np.uint32) | mgr.codec[pids].astype(np.uint32) << CODEC_SHIFT
    rows["hash"], rows["parent"] = mgr.hash[pids], mgr.parent[pids]
    keys, blob, size = mgr.uid[pids].astype(">u8").tobytes(), rows.tobytes(), _DIR_DTYPE.itemsize
    entries = [(keys[at:at + 8], blob[row:row + size])
               for at, row in zip(range(0, len(keys), 8), range(0, len(blob), size))]
    token_puts = [(uid_key(int(mgr.uid[pid])), mgr.page_tokens[pid].tobytes())
                  for pid in pids[(mgr.flags[pids] & HAS_TOKENS) != 0].tolist() if pid in mgr.page_tokens]
    zombies = np.asarray(mgr.zombies, np.int64)
    gone = np.concatenate([pids[(where >= 0) & (mgr.rec[pids] != REC_NONE)],
                           zombies[mgr.rec[zombies] != REC_NONE]])  # records no longer needed
    record_deletes = _uid_keys(mgr.uid[gone]) + [uid_key(uid) for uid, _ in mgr.doomed]
    zombie_keys = _uid_keys(mgr.uid[zombies])
    faults.crashpoint("commit.before_flush")
    if durable:
        mgr.pool_file.flush_slots(np.flatnonzero(mgr.dirty_slot))
    faults.crashpoint("commit.after_flush")
    seq_puts = list(zip(dirty, pack_tables(mgr, list(dirty.values()))))
    seq_deletes = [key for key in dropped if key not in dirty]
    meta_puts = [(b"lru", mgr.stamp.astype("<i8").tobytes()), (b"state", msgpack.packb(state))]
    spill = mgr.spill

    def body(txn: Any) -> None:
        for db, items in ((spill.dir, entries), (spill.tokens, token_puts), (spill.seqs, seq_puts),
                          (spill.meta, meta_puts)):
            if items:
                faults.io("put")
                txn.cursor(db=db).putmulti(items)
        for key in zombie_keys:
            txn.delete(key, db=spill.dir)
            txn.delete(key, db=spill.tokens)
        for key in record_deletes:
            txn.delete(key, db=spill.pages)
        for key in seq_deletes:
            txn.delete(key, db=spill.seqs)

    spill.write(body, "commit")
    faults.crashpoint("commit.after_commit")
    _apply(mgr, pids, where, zombies, gone)
    dirty.clear()
    dropped.clear()


def _uid_keys(uids: np.ndarray) -> list[bytes]:
    blob = np.asarray(uids, np.uint64).astype(">u8").tobytes()
    return [blob[i:i + 8] for i in range(0, len(blob), 8)]


def _apply(mgr: BlockManager, pids: np.ndarray, where: np.ndarray, zombies: np.ndarray,
           gone: np.ndarray) -> None:
    """Update the in-memory committed view after a commit returned."""
    mgr.spill_bytes -= int(mgr.rec_bytes[gone].sum()) + sum(nbytes for _, nbytes in mgr.doomed)
    mgr.rec_bytes[gone] = 0
    mgr.rec[gone] = REC_NONE
    moved = np.concatenate([pids, zombies])
    old = mgr.c_where[moved]
    held = old >= 0
    clear = old[held][mgr.slot_cpid[old[held]] == moved[held]]
    mgr.slot_cpid[clear] = -1
    mgr.c_where[pids], mgr.c_fill[pids], mgr.c_csum[pids] = where, mgr.fill[pids], mgr.csum[pids]
    mgr.c_flags[pids] = mgr.flags[pids]
    resident = where >= 0
    mgr.slot_cpid[where[resident]] = pids[resident]
    if mgr.page_tokens:  # token ids of full pages now live in the tokens table
        for pid in pids[mgr.fill[pids] == mgr.geom.page_size].tolist():
            mgr.page_tokens.pop(pid, None)
    mgr.c_where[zombies] = NOWHERE
    for pid in zombies.tolist():
        mgr._recycle(pid)
    mgr.c_ref[:] = mgr.ref
    mgr.free_slots = np.flatnonzero((mgr.slot_pid < 0) & (mgr.slot_cpid < 0)
                                    & (mgr.bg_pins == 0))[::-1].tolist()
    mgr.chg[:] = False
    mgr.dirty_slot[:] = False
    mgr.zombies = []
    mgr.doomed = []


def pack_tables(mgr: BlockManager, seqs: list[Sequence]) -> list[bytes]:
    """The block-table values of ``seqs``: [seq id, length, uids as little-endian u64] each.

    One uid gather for all tables, then one msgpack call per sequence: a decode
    step dirties every running sequence, so per-table numpy calls would dominate.
    """
    if not seqs:
        return []
    uids = mgr.uid[np.concatenate([seq.pids[:seq.npages] for seq in seqs])].astype("<u8").tobytes()
    pack = msgpack.Packer().pack  # packb's defaults, without a Packer per call
    values, low = [], 0
    for seq in seqs:
        high = low + 8 * seq.npages
        values.append(pack([seq.seq_id, seq.length, uids[low:high]]))
        low = high
    return values


def refresh_checksums(mgr: BlockManager, pids: np.ndarray) -> None:
    """Recompute the checksums of resident pages ``pids`` (``codec.page_checksum``, batched).

    Full pages are hashed in place. The first ``fill`` tokens of a partial page are
    strided across layers, so the token rows of many pages are gathered with one
    ``np.take`` per batch of about ``_GATHER_BYTES``; each page is then hashed as
    ``page_checksum`` does: its identity, then its bytes.
    """
    if not len(pids):
        return
    geom, seed = mgr.geom, mgr.seed
    page_size, planes = geom.page_size, 2 * geom.layers  # a page is (planes, page_size, token row)
    row_nbytes = geom.page_nbytes // (planes * page_size)
    rows = mgr.pool.view(np.uint8).reshape(-1, row_nbytes)  # one row per (slot, plane, token)
    slots, fills = mgr.slot[pids].astype(np.int64), mgr.fill[pids].astype(np.int64)
    idents = np.empty(len(pids), _IDENT_DTYPE)
    idents["uid"], idents["fill"] = mgr.uid[pids], fills
    ident, size = idents.tobytes(), _IDENT_DTYPE.itemsize
    csums = np.empty(len(pids), np.uint64)
    full = fills == page_size
    if full.any():
        whole, nbytes = np.flatnonzero(full), geom.page_nbytes
        with memoryview(rows).cast("B") as pool_bytes:
            values = []
            for at, first in zip((whole * size).tolist(), (slots[whole] * nbytes).tolist()):
                hasher = xxhash.xxh3_64(ident[at:at + size], seed)
                hasher.update(pool_bytes[first:first + nbytes])
                values.append(hasher.intdigest())
        csums[whole] = values
    part = np.flatnonzero(~full)
    if len(part):
        ends = np.cumsum(fills[part]) * (planes * row_nbytes)
        batches = [part]
        if ends[-1] > _GATHER_BYTES:
            batches = np.split(part, np.searchsorted(ends, np.arange(_GATHER_BYTES, ends[-1], _GATHER_BYTES)))
        for batch in batches:
            if not len(batch):
                continue
            # Runs of fill rows, one per (page, plane), laid end to end in page order.
            lengths = np.repeat(fills[batch], planes)
            starts = ((slots[batch, None] * planes + np.arange(planes)) * page_size).ravel()
            stops = np.cumsum(lengths)
            taken = np.arange(int(stops[-1])) + np.repeat(starts - (stops - lengths), lengths)
            data = memoryview(np.take(rows, taken, axis=0)).cast("B")
            highs = (np.cumsum(fills[batch]) * (planes * row_nbytes)).tolist()
            values, low = [], 0
            for at, high in zip((batch * size).tolist(), highs):
                hasher = xxhash.xxh3_64(ident[at:at + size], seed)
                hasher.update(data[low:high])
                values.append(hasher.intdigest())
                low = high
            csums[batch] = values
    mgr.csum[pids] = csums
    mgr.csum_ok[pids] = True


def load(mgr: BlockManager, writer: bool) -> tuple[dict[bytes, Sequence], dict[str, Any]]:
    """Rebuild the directory and the sequences from the last commit; O(metadata)."""
    spill, geom = mgr.spill, mgr.geom
    with spill.begin_read() as txn:
        state_raw = txn.get(b"state", db=spill.meta)
        stamps_raw = txn.get(b"lru", db=spill.meta)
        state = _decode(state_raw, "state") if state_raw is not None else {}
        stamps = bytes(stamps_raw) if stamps_raw is not None else b""
        keys, values = [], []
        for key, value in spill.iterate(txn, spill.dir):
            keys.append(bytes(key))
            values.append(bytes(value))
        tables = [(bytes(k), bytes(v)) for k, v in spill.iterate(txn, spill.seqs)]
        # Buffers make len() free: record sizes without reading the records.
        record_sizes = {bytes(k): len(v) for k, v in spill.iterate(txn, spill.pages)}
    if any(len(k) != 8 for k in keys) or any(len(v) != DIR_ENTRY.size for v in values) \
            or any(len(k) != 8 for k in record_sizes):
        raise StoreCorrupt(f"{spill.path}: page directory entries are malformed")
    count = len(keys)
    uids = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64)
    rows = np.frombuffer(b"".join(values), dtype=_DIR_DTYPE)
    if mgr._cap < count + 1:
        mgr._grow(count + max(64, count // 8))
    mgr.free_pids = array("q", range(mgr._cap - 1, count - 1, -1))
    pids = np.arange(count)
    where = rows["where"].astype(np.int32)
    fill = rows["fill"].astype(np.int64)
    if count and (where.min() < SPILLED or where.max() >= mgr.pool_pages or fill.max() > geom.page_size):
        raise StoreCorrupt(f"{spill.path}: page directory holds out-of-range placement or fill")
    resident = where >= 0
    if len(np.unique(where[resident])) != int(resident.sum()):
        raise StoreCorrupt(f"{spill.path}: two pages claim one pool slot")
    mgr.uid[:count] = uids
    mgr.live[:count] = True
    mgr.c_where[:count] = where
    mgr.slot[:count] = np.where(resident, where, -1)
    mgr.fill[:count] = mgr.c_fill[:count] = fill
    mgr.csum[:count] = mgr.c_csum[:count] = rows["csum"]
    mgr.csum_ok[:count] = True
    mgr.verified[:count] = ~resident  # resident bytes are checked on first use
    mgr.rec[:count] = np.where(resident, REC_NONE, REC_CURRENT)
    flags = rows["flags"]
    mgr.flags[:count] = mgr.c_flags[:count] = flags & ((1 << CODEC_SHIFT) - 1)
    mgr.codec[:count] = (flags >> CODEC_SHIFT) & 3
    mgr.tokens_seen = bool((flags & HAS_TOKENS).any())
    if (flags & HASHED).any() or rows["parent"].any():
        mgr.track_hashes()
        mgr.hash[:count] = rows["hash"]
        mgr.parent[:count] = rows["parent"]
    mgr.rec_bytes[:count] = [record_sizes.get(key, 0) for key in keys]
    mgr.spill_bytes = sum(record_sizes.values())
    mgr.prefix.add_many(np.flatnonzero(flags & HASHED), mgr.hash)
    mgr.slot_pid[where[resident]] = pids[resident]
    mgr.slot_cpid[where[resident]] = pids[resident]
    if len(stamps) == 8 * mgr.pool_pages:
        mgr.stamp[:] = np.frombuffer(stamps, dtype="<i8")
    mgr.free_slots = np.flatnonzero(mgr.slot_pid < 0)[::-1].tolist()
    # Uids are never reused, not even those of records a crash left uncommitted.
    highest = max((key_uid(key) for key in record_sizes), default=0)
    mgr.next_uid = max(int(state.get("next_uid", 1)), int(uids.max()) + 1 if count else 1, highest + 1)
    mgr.tick = max(int(state.get("tick", 0)), int(mgr.stamp.max()))
    seqs = _load_tables(mgr, tables, uids, spill.path)
    mgr.c_ref[:] = mgr.ref
    if writer:
        known = set(keys)
        mgr.doomed = [(key_uid(k), size) for k, size in record_sizes.items() if k not in known]
        for pid in np.flatnonzero(mgr.ref[:count] == 0).tolist():
            mgr._free(pid)  # kept if it is an indexed cache page, else collected
    return seqs, state


def _load_tables(mgr: BlockManager, tables: list[tuple[bytes, bytes]], uids: np.ndarray,
                 path: str) -> dict[bytes, Sequence]:
    page_size = mgr.geom.page_size
    seqs: dict[bytes, Sequence] = {}
    for key, value in tables:
        try:
            seq_id, length, raw = unpack_bounded(value, 1 << 30)
            table_uids = np.frombuffer(raw, dtype="<u8")
        except Exception:
            raise StoreCorrupt(f"{path}: a block table does not decode") from None
        if type(seq_id) not in (str, int) or type(length) is not int or length < 0 \
                or len(table_uids) != -(-length // page_size) or msgpack.packb(seq_id) != key:
            raise StoreCorrupt(f"{path}: block table of {seq_id!r} is inconsistent")
        pos = np.searchsorted(uids, table_uids)
        if len(table_uids) and (pos.max() >= len(uids) or (uids[pos] != table_uids).any()):
            raise StoreCorrupt(f"{path}: block table of {seq_id!r} names a page not in the directory")
        expected = np.full(len(pos), page_size)
        if len(pos):
            expected[-1] = length - (len(pos) - 1) * page_size
        if (mgr.fill[pos] < expected).any():
            raise StoreCorrupt(f"{path}: block table of {seq_id!r} is longer than its pages' fill")
        seqs[key] = Sequence(seq_id, key, pos.astype(np.int32), length)
        np.add.at(mgr.ref, pos, 1)
    return seqs


def _decode(raw: Any, what: str) -> dict[str, Any]:
    try:
        value = unpack_bounded(bytes(raw), 4096)
    except Exception:
        raise StoreCorrupt(f"{what} record does not decode") from None
    if not isinstance(value, dict):
        raise StoreCorrupt(f"{what} record is not a map")
    return value

