"""Committing the in-memory state to LMDB, and loading it back on reopen.

The commit protocol holds the write-ahead order: checksums of changed pages are
computed, their pool slots flushed (durable mode), and only then one LMDB
transaction records directory, block tables, LRU stamps and counters together.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from .. import faults
from ..storage.codec import FORMAT_VERSION, unpack_bounded
from .directory import HAS_TOKENS, REC_NONE
from ..errors import FormatVersionError, StoreCorrupt
from ..geometry import Geometry
from .entries import GATHER_BYTES, dir_entries, pack_tables
from .entries import refresh_checksums as _refresh_checksums
from . import lrulog
from .loadcheck import (COUNTS, check_counts, check_tokens, load_rows, load_stamps, load_state,
                        load_tables)
from .manager import BlockManager
from ..storage.metarecord import (DIR_DTYPE, DIR_DTYPE_V1, SUPERBLOCK_SEED, TAG_DIR, TAG_META, TAG_SEQS,
                                  TAG_TOKENS, seal, seal_many, unseal)
from ..storage.schema import MAX_UID, superblock_problems
from .sequence import Sequence
from ..storage.spill import SpillStore, entry_count, key_uid, uid_key

_DIR_DTYPE = DIR_DTYPE
SEALED_FORMAT = 2  # the first format whose metadata records carry checksums
_META_KEYS = {b"superblock", b"state", b"lru", b"counts"}
_GATHER_BYTES = GATHER_BYTES  # bytes copied per checksum batch (tests make it small)


def write_superblock(spill: SpillStore, fields: dict[str, Any], what: str = "create") -> None:
    """Record the store's identity (at creation, or when a field changes), sealed; one transaction."""
    blob = msgpack.packb(fields)
    if fields["format"] >= SEALED_FORMAT:
        blob = seal(TAG_META, b"superblock", blob, SUPERBLOCK_SEED)
    spill.write(lambda txn: spill.put(txn, spill.meta, b"superblock", blob), what)


def rewrite_superblock(spill: SpillStore, superblock: dict[str, Any], what: str = "create") -> None:
    """Record a changed superblock field (the model fingerprint when adopting another, the format)."""
    fields = dict(superblock, geometry=superblock["geometry"].to_dict())
    write_superblock(spill, fields, what)


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
    faults.crashpoint("commit.before_flush")
    if durable:
        # The disk writes the slots while the records are built (PagePool.start_flush).
        mgr.pool_file.start_flush(mgr.dirty.rows())
    refresh_checksums(mgr, pids[(mgr.slot[pids] >= 0) & ~mgr.csum_ok[pids]])
    entries, where = dir_entries(mgr, pids)
    flags = mgr.flags[pids]
    token_keys, token_bodies = [], []
    for pid in pids[(flags & HAS_TOKENS) != 0].tolist():
        held = mgr.page_tokens.get(pid)
        if held is not None:
            token_keys.append(uid_key(int(mgr.uid[pid])))
            token_bodies.append(held.tobytes())
    token_puts = list(zip(token_keys, seal_many(TAG_TOKENS, token_keys, token_bodies, mgr.seed)))
    lost = pids[(mgr.c_flags[pids] & ~flags & HAS_TOKENS) != 0]
    token_deletes = uid_keys(mgr.uid[lost])  # ids no longer known: their stored list is stale
    zombies = np.asarray(mgr.zombies, np.int64)
    gone = pids[(where >= 0) & (mgr.rec[pids] != REC_NONE)]  # records no longer needed
    if len(zombies):
        gone = np.concatenate([gone, zombies[mgr.rec[zombies] != REC_NONE]])
    record_deletes = uid_keys(mgr.uid[gone]) + [uid_key(uid) for uid, _ in mgr.doomed]
    zombie_keys = uid_keys(mgr.uid[zombies])
    seq_keys = list(dirty)
    seq_puts = list(zip(seq_keys, seal_many(TAG_SEQS, seq_keys, pack_tables(mgr, list(dirty.values())),
                                            mgr.seed)))
    seq_deletes = [key for key in dropped if key not in dirty]
    lru = lrulog.plan(mgr.stamp_log, mgr.stamped.rows(), mgr.stamp, mgr.seed, state)
    meta_puts = lru.puts + [(b"state", seal(TAG_META, b"state", msgpack.packb(state), mgr.seed))]
    if durable:
        mgr.pool_file.finish_flush()  # write-ahead: the slots are durable before the transaction
    faults.crashpoint("commit.after_flush")
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
        for key in lru.deletes:
            txn.delete(key, db=spill.meta)

    spill.write(body, "commit")
    faults.crashpoint("commit.after_commit")
    mgr.settle_stamps(lru.log)
    mgr.settle_commit(noted, pids, where, zombies, gone)
    dirty.clear()
    dropped.clear()


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
    spill = mgr.spill
    mgr.sealed = sealed
    damage: list[str] = []
    with spill.begin_read() as txn:
        state_raw = txn.get(b"state", db=spill.meta)
        stamps_raw = txn.get(lrulog.BASE_KEY, db=spill.meta)
        deltas = lrulog.read_deltas(txn, spill.meta)
        counts_raw = txn.get(b"counts", db=spill.meta)
        counts_raw = bytes(counts_raw) if counts_raw is not None else None
        state = load_state(mgr, state_raw, damage)
        stamps, stamp_log = load_stamps(mgr, stamps_raw, deltas, state.get("lru_log", [0, 0]), damage)
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
    unknown = {key for key in meta_keys - _META_KEYS if not lrulog.is_delta_key(key)}
    if unknown:
        damage.append(f"meta holds unknown records {sorted(unknown)}")
    if (keys or tables) and not {b"state", b"lru"} <= meta_keys:
        damage.append("the state or lru record of a committed store is missing")
    check_counts(mgr, counts_raw, (len(keys), len(tables), len(token_keys)), damage)
    # A page's key is its uid: 8 bytes below MAX_UID, so that the next uid after it is one too.
    # Spill records are not sealed under their key, and a key that damage made huge would
    # otherwise become the store's next uid, which the next open refuses. One pass, in numpy.
    whole = [key for key in record_sizes if len(key) == 8]
    record_uids = np.frombuffer(b"".join(whole), ">u8") if whole else np.zeros(0, ">u8")
    sound = (record_uids > 0) & (record_uids < MAX_UID)
    if len(whole) != len(record_sizes) or not sound.all():
        damage.append("a spill record's key is not a page uid")
        record_sizes = {key: record_sizes[key] for key, ok in zip(whole, sound.tolist()) if ok}
    uids, rows = load_rows(mgr, keys, values, damage)
    # Uids are never reused, not even those of records a crash left uncommitted.
    highest = int(record_uids[sound].max()) if sound.any() else 0
    next_uid = max(int(state.get("next_uid", 1)), int(uids.max()) + 1 if len(uids) else 1, highest + 1)
    mgr.load_committed(uids, rows, [record_sizes.get(key, 0) for key in uid_keys(uids)],
                       sum(record_sizes.values()), stamps, next_uid, int(state.get("tick", 0)))
    mgr.settle_stamps(stamp_log)
    count = len(uids)
    seqs = load_tables(mgr, tables, uids, damage)
    mgr.set_references(np.concatenate([seq.pids[:seq.npages] for seq in seqs.values()])
                       if seqs else np.empty(0, np.int64))
    check_tokens(mgr, count, token_keys, token_values, damage)
    if writer:
        spill.on_write = lambda txn: record_counts(mgr, txn)
        if damage:
            more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
            raise StoreCorrupt(f"{spill.path}: {damage[0]}{more}; nothing was changed "
                               "(pagedkv verify lists the damage)")
        known = set(uid_keys(uids))
        mgr.doomed = [(key_uid(k), size) for k, size in record_sizes.items() if k not in known]
        mgr.collect_unreferenced()  # indexed cache pages are kept, the rest collected
    return seqs, state, damage


def record_counts(mgr: BlockManager, txn: Any) -> None:
    """Record how many directory entries, block tables and token lists the store holds now.

    Runs inside every write transaction of a writer, so a record that vanishes
    later (deleted by another program, or a page of the B-tree lost) is damage
    at the next open rather than a sequence or a cached prefix silently gone.
    """
    spill = mgr.spill
    counts = COUNTS.pack(*(entry_count(txn, db) for db in (spill.dir, spill.seqs, spill.tokens)))
    txn.put(b"counts", seal(TAG_META, b"counts", counts, mgr.seed), db=spill.meta)


def uid_keys(uids: np.ndarray) -> list[bytes]:
    """The LMDB keys of ``uids`` (big-endian u64 each)."""
    if not len(uids):  # most of a commit's lists of deletions are empty
        return []
    blob = np.asarray(uids, np.uint64).astype(">u8").tobytes()
    return [blob[at:at + 8] for at in range(0, len(blob), 8)]


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


def upgrade_superblock(mgr: BlockManager, superblock: dict[str, Any]) -> int:
    """Rewrite a sealed store's superblock as the current format, in one transaction; the format it had.

    Format 2 differs from 3 only in what its state record may name (format 3
    may add a log of LRU deltas, ``lrulog``), so its records stay as they are.
    """
    old = int(superblock["format"])
    superblock["format"] = FORMAT_VERSION
    try:
        rewrite_superblock(mgr.spill, superblock, "upgrade")
    except BaseException:
        superblock["format"] = old
        raise
    return old
