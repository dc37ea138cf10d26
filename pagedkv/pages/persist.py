"""Committing the in-memory state to LMDB, and loading it back on reopen.

The commit protocol holds the write-ahead order: checksums of changed pages are
computed, their pool slots flushed (durable mode), and only then one LMDB
transaction records directory, block tables, LRU stamps and counters together.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

import msgpack
import numpy as np

from .. import faults
from ..storage.codec import FORMAT_VERSION, unpack_bounded
from .directory import CODEC_SHIFT, HAS_TOKENS, HASHED, NOWHERE, ONE, REC_CURRENT, REC_NONE, SPILLED
from ..errors import FormatVersionError, StoreCorrupt
from ..geometry import Geometry
from .entries import GATHER_BYTES, dir_entries, pack_tables
from .entries import refresh_checksums as _refresh_checksums
from .manager import BlockManager
from ..storage.metarecord import (DIR_DTYPE, DIR_DTYPE_V1, SUPERBLOCK_SEED, TAG_DIR, TAG_META, TAG_SEQS,
                                  TAG_TOKENS, TRAILER, seal, seal_many, sealed_ok, unseal)
from ..storage.schema import MAX_TICK, state_problems, superblock_problems
from .sequence import Sequence
from ..storage.spill import SpillStore, key_uid, uid_key
from ..storage.codecs import CODECS

_DIR_DTYPE = DIR_DTYPE
SEALED_FORMAT = 2  # the first format whose metadata records carry checksums
_FLAG_BITS = HASHED | HAS_TOKENS | 3 << CODEC_SHIFT
_META_KEYS = {b"superblock", b"state", b"lru", b"counts"}
_COUNTS = struct.Struct("<3Q")  # records in dir, seqs and tokens after the last write transaction
_GATHER_BYTES = GATHER_BYTES  # bytes copied per checksum batch (tests make it small)


def write_superblock(spill: SpillStore, fields: dict[str, Any]) -> None:
    """Record the store's identity (at creation, or when a field changes), sealed."""
    blob = msgpack.packb(fields)
    if fields["format"] >= SEALED_FORMAT:
        blob = seal(TAG_META, b"superblock", blob, SUPERBLOCK_SEED)
    spill.write(lambda txn: spill.put(txn, spill.meta, b"superblock", blob), "create")


def rewrite_superblock(spill: SpillStore, superblock: dict[str, Any]) -> None:
    """Record a changed superblock field (the model fingerprint, when adopting another)."""
    fields = dict(superblock, geometry=superblock["geometry"].to_dict())
    write_superblock(spill, fields)


def read_superblock(spill: SpillStore) -> dict[str, Any]:
    """The superblock, validated as untrusted input (its checksum from format 2 on)."""
    with spill.begin_read() as txn:
        raw = txn.get(b"superblock", db=spill.meta)
        if raw is None:
            raise StoreCorrupt(f"{spill.path}: superblock is missing (store creation never completed)")
        raw = bytes(raw)
    body = unseal(TAG_META, b"superblock", raw, SUPERBLOCK_SEED)
    try:
        # A sealed value never decodes whole: its checksum trails a complete msgpack object.
        sb = unpack_bounded(body if body is not None else raw, 4096)
    except Exception:
        raise StoreCorrupt(f"{spill.path}: superblock does not decode (or fails its checksum)") from None
    if not isinstance(sb, dict) or not {"format", "uuid", "geometry", "pool_pages"} <= set(sb):
        raise StoreCorrupt(f"{spill.path}: superblock lacks required fields")
    if type(sb["format"]) is not int or sb["format"] < 1:
        raise StoreCorrupt(f"{spill.path}: superblock format field is invalid")
    if sb["format"] > FORMAT_VERSION:
        raise FormatVersionError(
            f"{spill.path}: format version {sb['format']}; this pagedkv reads up to {FORMAT_VERSION}")
    if (body is None) != (sb["format"] < SEALED_FORMAT):
        raise StoreCorrupt(f"{spill.path}: superblock of format {sb['format']} is "
                           f"{'unsealed' if body is None else 'sealed'}")
    if not isinstance(sb["uuid"], bytes) or len(sb["uuid"]) != 16 or type(sb["pool_pages"]) is not int:
        raise StoreCorrupt(f"{spill.path}: superblock identity fields are invalid")
    problems = superblock_problems(sb)
    if problems:
        raise StoreCorrupt(f"{spill.path}: {problems[0]}")
    try:
        sb["geometry"] = Geometry.from_dict(sb["geometry"])
    except Exception as exc:
        raise StoreCorrupt(f"{spill.path}: superblock geometry is invalid ({exc})") from None
    return sb


def commit(mgr: BlockManager, dirty: dict[bytes, Sequence], dropped: set[bytes],
           state: dict[str, Any], durable: bool) -> None:
    """Make the current state the committed one, in write-ahead order.

    Costs what changed since the last commit, not the size of the directory: the
    rows visited are those the page table noted (``PageTable.changed``,
    ``refs_moved``), filtered by the columns that stay the authority.
    """
    noted = mgr.changed.rows()
    pids = noted[mgr.chg[noted] & mgr.live[noted]]
    refresh_checksums(mgr, pids[(mgr.slot[pids] >= 0) & ~mgr.csum_ok[pids]])
    entries, where = dir_entries(mgr, pids)
    token_keys, token_bodies = [], []
    for pid in pids[(mgr.flags[pids] & HAS_TOKENS) != 0].tolist():
        held = mgr.page_tokens.get(pid)
        if held is not None:
            token_keys.append(uid_key(int(mgr.uid[pid])))
            token_bodies.append(held.tobytes())
    token_puts = list(zip(token_keys, seal_many(TAG_TOKENS, token_keys, token_bodies, mgr.seed)))
    lost = pids[((mgr.c_flags[pids] & HAS_TOKENS) != 0) & ((mgr.flags[pids] & HAS_TOKENS) == 0)]
    token_deletes = uid_keys(mgr.uid[lost])  # ids no longer known: their stored list is stale
    zombies = np.asarray(mgr.zombies, np.int64)
    gone = np.concatenate([pids[(where >= 0) & (mgr.rec[pids] != REC_NONE)],
                           zombies[mgr.rec[zombies] != REC_NONE]])  # records no longer needed
    record_deletes = uid_keys(mgr.uid[gone]) + [uid_key(uid) for uid, _ in mgr.doomed]
    zombie_keys = uid_keys(mgr.uid[zombies])
    faults.crashpoint("commit.before_flush")
    if durable:
        mgr.pool_file.flush_slots(np.flatnonzero(mgr.dirty_slot))
    faults.crashpoint("commit.after_flush")
    seq_keys = list(dirty)
    seq_puts = list(zip(seq_keys, seal_many(TAG_SEQS, seq_keys, pack_tables(mgr, list(dirty.values())),
                                            mgr.seed)))
    seq_deletes = [key for key in dropped if key not in dirty]
    meta_puts = [(b"lru", seal(TAG_META, b"lru", mgr.stamp.astype("<i8").tobytes(), mgr.seed)),
                 (b"state", seal(TAG_META, b"state", msgpack.packb(state), mgr.seed))]
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
        for key in token_deletes:
            txn.delete(key, db=spill.tokens)
        for key in record_deletes:
            txn.delete(key, db=spill.pages)
        for key in seq_deletes:
            txn.delete(key, db=spill.seqs)

    spill.write(body, "commit")
    faults.crashpoint("commit.after_commit")
    _apply(mgr, noted, pids, where, zombies, gone)
    dirty.clear()
    dropped.clear()


def _apply(mgr: BlockManager, noted: np.ndarray, pids: np.ndarray, where: np.ndarray, zombies: np.ndarray,
           gone: np.ndarray) -> None:
    """Update the in-memory committed view after a commit returned.

    ``noted`` are the rows noted changed (``pids`` those of them written). Slots
    whose committed page moved away join the free list here; every other slot's
    standing is unchanged by a commit, so the list need not be rebuilt.
    """
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
        mgr.page_tokens.drop_many(pids[mgr.fill[pids] == mgr.geom.page_size].tolist())
    mgr.c_where[zombies] = NOWHERE
    for pid in zombies.tolist():
        mgr._recycle(pid)
    moved_refs = mgr.refs_moved.rows()
    mgr.c_ref[moved_refs] = mgr.ref[moved_refs]
    freed = clear[(mgr.slot_pid[clear] < 0) & (mgr.slot_cpid[clear] < 0) & (mgr.bg_pins[clear] == 0)]
    mgr.free_slots.extend(freed.tolist())
    mgr.chg[noted] = False
    mgr.changed.clear()
    mgr.refs_moved.clear()
    mgr.dirty_slot[:] = False
    mgr.zombies = []
    mgr.doomed = []


def refresh_checksums(mgr: BlockManager, pids: np.ndarray) -> None:
    """Recompute the checksums of resident pages ``pids`` (``entries.refresh_checksums``, batches of ``_GATHER_BYTES``)."""
    _refresh_checksums(mgr, pids, _GATHER_BYTES)


def load(mgr: BlockManager, writer: bool,
         sealed: bool = True) -> tuple[dict[bytes, Sequence], dict[str, Any], list[str]]:
    """Rebuild the directory and the sequences from the last commit; O(metadata).

    Every record is checked (its checksum when ``sealed``, then every field). A
    read-only handle leaves damaged records out and returns what is wrong with
    them, one line each; a writer refuses the store (``StoreCorrupt``) instead,
    so nothing is collected or rewritten while a damaged record might still
    reference it.
    """
    spill, geom = mgr.spill, mgr.geom
    mgr.sealed = sealed
    damage: list[str] = []
    with spill.begin_read() as txn:
        state_raw = txn.get(b"state", db=spill.meta)
        stamps_raw = txn.get(b"lru", db=spill.meta)
        counts_raw = txn.get(b"counts", db=spill.meta)
        counts_raw = bytes(counts_raw) if counts_raw is not None else None
        state = _load_state(mgr, state_raw, damage)
        stamps = _load_stamps(mgr, stamps_raw, damage)
        keys, values = [], []
        for key, value in spill.iterate(txn, spill.dir):
            keys.append(bytes(key))
            values.append(bytes(value))
        tables = [(bytes(k), bytes(v)) for k, v in spill.iterate(txn, spill.seqs)]
        # Buffers make len() free: record sizes without reading the records.
        record_sizes = {bytes(k): len(v) for k, v in spill.iterate(txn, spill.pages)}
        meta_keys = {bytes(k) for k in spill.iterate(txn, spill.meta, keys_only=True)}
        token_keys, token_values = [], []
        for key, value in spill.iterate(txn, spill.tokens):
            token_keys.append(bytes(key))
            token_values.append(bytes(value))
    if meta_keys - _META_KEYS:
        damage.append(f"meta holds unknown records {sorted(meta_keys - _META_KEYS)}")
    if (keys or tables) and not {b"state", b"lru"} <= meta_keys:
        damage.append("the state or lru record of a committed store is missing")
    _check_counts(mgr, counts_raw, (len(keys), len(tables), len(token_keys)), damage)
    if any(len(k) != 8 for k in record_sizes):
        damage.append("a spill record's key is not a page uid")
        record_sizes = {k: n for k, n in record_sizes.items() if len(k) == 8}
    uids, rows = _load_rows(mgr, keys, values, damage)
    count = len(uids)
    if mgr._cap < count + 1:
        mgr._grow(count + max(64, count // 8))
    mgr.free_pids = array("q", range(mgr._cap - 1, count - 1, -1))
    pids = np.arange(count)
    where = rows["where"].astype(np.int32)
    fill = rows["fill"].astype(np.int64)
    resident = where >= 0
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
        mgr.chain[:count] = rows["chain"]
    mgr.rec_bytes[:count] = [record_sizes.get(key, 0) for key in uid_keys(uids)]
    mgr.spill_bytes = sum(record_sizes.values())
    mgr.prefix.add_many(np.flatnonzero(flags & HASHED), mgr.hash)
    mgr.slot_pid[where[resident]] = pids[resident]
    mgr.slot_cpid[where[resident]] = pids[resident]
    if stamps is not None:
        mgr.stamp[:] = stamps
    mgr.free_slots = np.flatnonzero(mgr.slot_pid < 0)[::-1].tolist()
    # Uids are never reused, not even those of records a crash left uncommitted.
    highest = max((key_uid(key) for key in record_sizes), default=0)
    mgr.next_uid = max(int(state.get("next_uid", 1)), int(uids.max()) + 1 if count else 1, highest + 1)
    mgr.tick = max(int(state.get("tick", 0)), int(mgr.stamp.max()))
    seqs = _load_tables(mgr, tables, uids, damage)
    _check_tokens(mgr, count, token_keys, token_values, damage)
    mgr.c_ref[:] = mgr.ref
    if writer:
        spill.on_write = lambda txn: record_counts(mgr, txn)
        if damage:
            more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
            raise StoreCorrupt(f"{spill.path}: {damage[0]}{more}; nothing was changed "
                               "(pagedkv verify lists the damage)")
        known = set(uid_keys(uids))
        mgr.doomed = [(key_uid(k), size) for k, size in record_sizes.items() if k not in known]
        for pid in np.flatnonzero(mgr.ref[:count] == 0).tolist():
            mgr._free(pid)  # kept if it is an indexed cache page, else collected
    return seqs, state, damage


def record_counts(mgr: BlockManager, txn: Any) -> None:
    """Record how many directory entries, block tables and token lists the store holds now.

    Runs inside every write transaction of a writer, so a record that vanishes
    later (deleted by another program, or a page of the B-tree lost) is damage
    at the next open rather than a sequence or a cached prefix silently gone.
    """
    spill = mgr.spill
    counts = _COUNTS.pack(*(txn.stat(db)["entries"] for db in (spill.dir, spill.seqs, spill.tokens)))
    txn.put(b"counts", seal(TAG_META, b"counts", counts, mgr.seed), db=spill.meta)


def _check_counts(mgr: BlockManager, raw: bytes | None, found: tuple[int, int, int],
                  damage: list[str]) -> None:
    if not mgr.sealed or raw is None:
        if mgr.sealed and any(found):
            damage.append("the counts record of a store holding records is missing")
        return
    body = unseal(TAG_META, b"counts", raw, mgr.seed)
    if body is None or len(body) != _COUNTS.size:
        damage.append("counts record fails its checksum")
        return
    for name, want, have in zip(("directory entries", "block tables", "token lists"), _COUNTS.unpack(body),
                                found):
        if want != have:
            damage.append(f"{have} {name} found, the last write left {want}")


def _check_tokens(mgr: BlockManager, count: int, keys: list[bytes], values: list[bytes],
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


def uid_keys(uids: np.ndarray) -> list[bytes]:
    """The LMDB keys of ``uids`` (big-endian u64 each)."""
    blob = np.asarray(uids, np.uint64).astype(">u8").tobytes()
    return [blob[at:at + 8] for at in range(0, len(blob), 8)]


def _meta_body(mgr: BlockManager, key: bytes, raw: Any, damage: list[str]) -> bytes | None:
    """The body of meta record ``key`` (checked when sealed); None if absent or damaged."""
    if raw is None:
        return None
    if not mgr.sealed:
        return bytes(raw)
    body = unseal(TAG_META, key, raw, mgr.seed)
    if body is None:
        damage.append(f"{key.decode()} record fails its checksum")
    return body


def _load_state(mgr: BlockManager, raw: Any, damage: list[str]) -> dict[str, Any]:
    body = _meta_body(mgr, b"state", raw, damage)
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


def _load_stamps(mgr: BlockManager, raw: Any, damage: list[str]) -> np.ndarray | None:
    body = _meta_body(mgr, b"lru", raw, damage)
    if body is None:
        return None
    if len(body) != 8 * mgr.pool_pages:
        damage.append(f"lru record holds {len(body)} bytes for {mgr.pool_pages} slots")
        return None
    stamps = np.frombuffer(body, dtype="<i8")
    if len(stamps) and (stamps.min() < 0 or stamps.max() > MAX_TICK):
        damage.append("lru record holds a stamp outside [0, 2**62]")
        return None
    return stamps


def _load_rows(mgr: BlockManager, keys: list[bytes], values: list[bytes],
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
           | ((flags & ~np.uint32(_FLAG_BITS)) != 0) | ((flags >> CODEC_SHIFT & 3) >= len(CODECS))
           | (hashed & (((flags & HAS_TOKENS) == 0) | (fill != mgr.geom.page_size) | (rows["chain"] == 0))))
    resident = np.flatnonzero(where >= 0)
    slots, first, counts = np.unique(where[resident], return_index=True, return_counts=True)
    shared = np.isin(where, slots[counts > 1]) & (where >= 0)
    for index in np.flatnonzero(bad | shared).tolist():
        what = "claims a pool slot another page claims" if shared[index] else "holds an impossible field"
        damage.append(f"directory entry of page {int(uids[index])} {what}")
    keep = ~(bad | shared)
    return uids[keep], rows[keep]


def upgrade(mgr: BlockManager, superblock: dict[str, Any]) -> None:
    """Rewrite a format-1 store's metadata sealed, and its superblock as the current format.

    One transaction: a crash leaves the store wholly in one format or the other.
    """
    spill, seed = mgr.spill, mgr.seed
    with spill.begin_read() as txn:
        dbs = {db: [(bytes(k), bytes(v)) for k, v in spill.iterate(txn, db)]
               for db in (spill.dir, spill.seqs, spill.tokens)}
        meta = {key: txn.get(key, db=spill.meta) for key in (b"state", b"lru")}
        meta = {key: bytes(value) for key, value in meta.items() if value is not None}
    chains = mgr.chain
    rows = {uid: pid for pid, uid in enumerate(mgr.uid.tolist()) if mgr.live[pid]}
    puts: list[tuple[Any, bytes, bytes]] = []
    for key, value in dbs[spill.dir]:
        old = np.frombuffer(value, DIR_DTYPE_V1)[0]
        new = np.zeros(1, DIR_DTYPE)
        for name in DIR_DTYPE_V1.names or ():
            new[name] = old[name]
        pid = rows.get(key_uid(key))
        new["chain"] = int(chains[pid]) if pid is not None else 0
        puts.append((spill.dir, key, seal(TAG_DIR, key, new.tobytes(), seed)))
    for tag, db in ((TAG_SEQS, spill.seqs), (TAG_TOKENS, spill.tokens)):
        puts += [(db, key, seal(tag, key, value, seed)) for key, value in dbs[db]]
    puts += [(spill.meta, key, seal(TAG_META, key, value, seed)) for key, value in meta.items()]
    fields = dict(superblock, geometry=superblock["geometry"].to_dict(), format=FORMAT_VERSION)
    puts.append((spill.meta, b"superblock",
                 seal(TAG_META, b"superblock", msgpack.packb(fields), SUPERBLOCK_SEED)))

    def body(txn: Any) -> None:
        for db, key, value in puts:
            spill.put(txn, db, key, value)

    spill.write(body, "upgrade")
    mgr.sealed = True
    superblock["format"] = FORMAT_VERSION


def _load_tables(mgr: BlockManager, tables: list[tuple[bytes, bytes]], uids: np.ndarray,
                 damage: list[str]) -> dict[bytes, Sequence]:
    """The sound block tables as sequences (counting their page references); the rest is damage."""
    page_size = mgr.geom.page_size
    seqs: dict[bytes, Sequence] = {}
    for key, value in tables:
        body = unseal(TAG_SEQS, key, value, mgr.seed) if mgr.sealed else value
        name = _key_name(key)
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
        np.add.at(mgr.ref, pos, ONE)
    return seqs


def _key_name(key: bytes) -> str:
    """A sequence key as the id it encodes (or its bytes, when it encodes none)."""
    try:
        seq_id = unpack_bounded(key, 1024)
    except Exception:
        return f"key {key.hex()}"
    return repr(seq_id) if type(seq_id) in (str, int) else f"key {key.hex()}"
