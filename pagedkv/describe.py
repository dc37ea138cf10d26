"""The store's read API: typed, read-only views of a store's pages, sequences, pool and files.

``KVStore.describe()``, ``describe_pages()``, ``describe_sequences()``,
``slot_states()``, ``page_content()``, ``spill_info()``, ``last_commit()`` and
``garbage()`` delegate here; each function takes a ``StoreCore`` (like ``check.py``) and
returns frozen values that hold no reference into the store, so they stay
valid after the store changes or closes. Nothing here writes: neither memory
nor disk, not even an LRU stamp. ``pagedkv inspect`` and ``verify`` are built
on these functions alone.

What the last commit recorded (``CommitInfo``) is read from the state record,
untrusted input: a field that is absent or malformed is None (unknown), never
a made-up 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import lmdb
import numpy as np
from numpy.typing import NDArray

from .check import Problem, stray_problems
from .core import StoreCore
from .errors import PageCorrupt, PagedKVError
from .geometry import Geometry
from .options import PERSISTED_COUNTERS
from .pages.directory import HASHED, REC_NONE
from .pages.restore import read_record
from .pages.sequence import SeqId
from .remote.counters import committed_section
from .storage.codec import decode_record, page_checksum
from .storage.codecs import CODECS
from .storage.spill import uid_key

__all__ = ["SLOT_STATES", "CodecUse", "CommitInfo", "PageContent", "PageCounts", "PageInfo", "PageNotFound",
           "SequenceInfo", "SpillInfo", "StoreSummary"]

# What a pool slot holds; ``slot_states`` gives each slot's index into this tuple.
SLOT_STATES = ("free", "resident", "shared", "pinned", "cached", "orphan")
_RECORD_STATES = ("none", "current", "stale")  # index = the directory's rec value
_SCAN_UIDS = 16  # up to this many uids are looked up by a scan each, more by one sort


class PageNotFound(PagedKVError):
    """No live page has the uid asked for."""


@dataclass(frozen=True)
class PageCounts:
    """Live pages by where they are and who holds them.

    ``cached`` pages are referenced by no sequence but kept by the prefix index
    (a writer keeps them for prefix reuse); ``orphan`` pages are referenced by
    nothing at all (the next writer's commit collects them).
    """

    total: int
    resident: int  # in a pool slot
    spilled: int  # in a spill record only
    shared: int  # refcount > 1
    hashed: int  # full pages with a chained prefix hash
    cached: int
    orphan: int


@dataclass(frozen=True)
class CodecUse:
    """The live pages whose directory entry names a spill record in one codec, and those records' bytes."""

    pages: int
    bytes: int


@dataclass(frozen=True)
class SpillInfo:
    """Facts about ``spill/``, the LMDB environment, as this handle sees it."""

    map_size: int  # bytes this handle maps
    map_used: int  # bytes up to the last page in use
    last_txnid: int  # id of the last committed write transaction
    entries: Mapping[str, int]  # records per named database (meta, seqs, dir, pages, tokens)
    locking: bool  # the handle uses spill/lock.mdb; a read-only one then holds a reader slot there
    reader_pids: tuple[int, ...] | None  # pids of LMDB's reader table (None: not locking, or unreadable)


@dataclass(frozen=True)
class CommitInfo:
    """What the state record of the last commit says (each field None when unknown)."""

    time: float | None  # when, in seconds since the epoch
    commits: int | None  # commits so far, over every session
    durability: str | None  # the mode of the writer that made it
    counters: Mapping[str, int | None]  # each of PERSISTED_COUNTERS, totalled over every session
    remote: Mapping[str, Any] | None  # the remote tier's section: url, namespace, cluster, counters


@dataclass(frozen=True)
class StoreSummary:
    """``KVStore.describe()``: the store's identity, occupancy and last commit, counted now."""

    path: str
    uuid: str
    format_version: int
    metadata_checked: bool  # committed metadata carries checksums (format 1 kept none)
    created: float | None  # seconds since the epoch
    model: str | None  # the model fingerprint the store was created for
    geometry: Geometry
    pool_pages: int
    slots: Mapping[str, int]  # pool slots per state of SLOT_STATES
    pages: PageCounts
    records: int  # page records in LMDB, those of no page included
    record_bytes: int
    codecs: Mapping[str, CodecUse]  # per codec of storage.codecs.CODECS
    sequences: int
    tokens: int  # over every sequence
    last_commit: CommitInfo
    spill: SpillInfo


@dataclass(frozen=True)
class PageInfo:
    """One live page's directory entry, and with ``check=True`` whether its bytes pass their checksum."""

    uid: int
    slot: int | None  # its pool slot, None when spilled
    tokens: int  # tokens it holds
    refcount: int  # references from block tables (0: cached or orphan)
    checksum: int  # xxh3-64 of its tokens, as the directory holds it
    prefix_hash: bytes | None  # its chained 16-byte hash, when hashed
    parent: int | None  # chain class of the page before it (0: a first page), when hashed
    cached: bool  # refcount 0 and kept by the prefix index
    record: str  # its spill record: "none", "current" or "stale" (written past since)
    record_bytes: int  # that record's size (0: none)
    codec: str | None  # that record's codec
    ok: bool | None = None  # checked: passes its checksum; None when not checked (or not checkable)
    problem: str | None = None  # why it fails

    @property
    def resident(self) -> bool:
        """Whether the page is in a pool slot."""
        return self.slot is not None


@dataclass(frozen=True)
class SequenceInfo:
    """One sequence: its id, its length and its block table as page uids."""

    id: SeqId
    length: int  # tokens, those of an active step included
    pages: tuple[int, ...]  # uids, in logical order
    resident: int  # how many of them are in a pool slot now


@dataclass(frozen=True)
class PageContent:
    """A copy of one page's bytes and, for a spilled page, its record's header.

    ``page`` is ``(layers, 2, page_size, kv_heads, head_dim)`` in the store's
    dtype, as the pool slot or the record holds it (positions past the page's
    tokens hold leftovers), or None when the record is missing or undecodable;
    ``problem`` then says why.
    """

    page: NDArray[Any] | None
    record: Mapping[str, Any] | None  # the record's decoded header (None for a resident page)
    record_bytes: int | None  # the record's size in LMDB (None for a resident page, or no record)
    problem: str | None


def describe(core: StoreCore) -> StoreSummary:
    """The summary ``KVStore.describe()`` returns (reads every spill record's size once)."""
    mgr, sb = core._mgr, core.superblock
    live = np.flatnonzero(mgr.live)
    resident = int(np.count_nonzero(mgr.slot[live] >= 0))
    cached = int(np.count_nonzero(_cached(core, live)))
    codes = slot_states(core)
    slot_counts = np.bincount(codes, minlength=len(SLOT_STATES))
    records = record_bytes = 0
    spill = core._spill
    with spill.begin_read() as txn:
        for _, value in spill.iterate(txn, spill.pages):
            records += 1
            record_bytes += len(value)
    created, model = sb.get("created"), sb.get("model")
    seqs = core._seqs.values()
    return StoreSummary(
        path=core.path, uuid=core.uuid, format_version=sb["format"], metadata_checked=bool(mgr.sealed),
        created=_seconds(created),
        model=model if isinstance(model, str) else None,
        geometry=core.geometry, pool_pages=core.pool_pages,
        slots={state: int(slot_counts[i]) for i, state in enumerate(SLOT_STATES)},
        pages=PageCounts(
            total=len(live), resident=resident, spilled=len(live) - resident,
            shared=int(np.count_nonzero(mgr.ref[live] > 1)),
            hashed=int(np.count_nonzero(mgr.flags[live] & HASHED)), cached=cached,
            orphan=int(np.count_nonzero(mgr.ref[live] == 0)) - cached),
        records=records, record_bytes=record_bytes, codecs=_codecs(core),
        sequences=len(seqs), tokens=sum(seq.length for seq in seqs),
        last_commit=_commit_info(core._state), spill=spill_info(core))


def _seconds(value: Any) -> float | None:
    """A time stamp of a record as a float; None unless a finite number after the epoch."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def _cached(core: StoreCore, pids: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Which of ``pids`` no sequence references but the prefix index keeps."""
    mgr = core._mgr
    out = np.zeros(len(pids), bool)
    # The index lookup is per page: only unreferenced hashed pages can be cached.
    maybe = np.flatnonzero((mgr.ref[pids] == 0) & (mgr.flags[pids] & HASHED).astype(bool))
    holds, hashes = mgr.prefix.holds, mgr.hash
    out[maybe] = [holds(bytes(hashes[pid]), pid) for pid in pids[maybe].tolist()]
    return out


def _codecs(core: StoreCore) -> dict[str, CodecUse]:
    mgr = core._mgr
    stored = np.flatnonzero(mgr.live & (mgr.rec != REC_NONE))
    codes = mgr.codec[stored]
    sizes = mgr.rec_bytes[stored].astype(np.int64)
    return {name: CodecUse(int(np.count_nonzero(codes == i)), int(sizes[codes == i].sum()))
            for i, name in enumerate(CODECS)}


def last_commit(core: StoreCore) -> CommitInfo:
    """What ``KVStore.last_commit()`` returns: the state record as of the last commit."""
    return _commit_info(core._state)


def _commit_info(state: dict[str, Any]) -> CommitInfo:
    when, commits, durability = state.get("time"), state.get("commits", 0), state.get("durability")
    return CommitInfo(
        time=_seconds(when),
        commits=commits if type(commits) is int else None,
        durability=durability if isinstance(durability, str) else None,
        counters={name: _counter(state, name) for name in PERSISTED_COUNTERS},
        remote=committed_section(state))


def _counter(state: dict[str, Any], name: str) -> int | None:
    value = state.get(name)
    return value if type(value) is int and value >= 0 else None


def spill_info(core: StoreCore) -> SpillInfo:
    """What ``KVStore.spill_info()`` returns: no record is read."""
    spill = core._spill
    info = spill.info()
    locking = bool(spill.env.flags()["lock"])
    pids: tuple[int, ...] | None = None
    if locking:
        try:
            table = spill.env.readers()
        except lmdb.Error:  # a figure for display: unknown is an answer
            table = None
        if table is not None:
            rows = (row.split() for row in table.splitlines()[1:])
            pids = tuple(int(row[0]) for row in rows if row and row[0].isdigit())
    return SpillInfo(map_size=info["map_size"], map_used=info["map_used"], last_txnid=info["last_txnid"],
                     entries=dict(info["entries"]), locking=locking, reader_pids=pids)


def slot_states(core: StoreCore) -> NDArray[np.int8]:
    """Per pool slot, its index into ``SLOT_STATES`` (a pinned slot is "pinned" whatever it holds)."""
    mgr = core._mgr
    owner = mgr.slot_pid
    used = owner >= 0
    ref = np.where(used, mgr.ref[np.maximum(owner, 0)], 0)
    codes = np.zeros(len(owner), np.int8)
    codes[used] = 1
    codes[used & (ref > 1)] = 2
    unowned = np.flatnonzero(used & (ref == 0))
    codes[unowned] = np.where(_cached(core, owner[unowned]), 4, 5)
    codes[mgr.pins > 0] = 3
    return codes


def describe_pages(core: StoreCore, uids: Iterable[int] | None = None, check: bool = False) -> list[PageInfo]:
    """The pages ``uids`` names, in that order (every live page, in row order, for None).

    With ``check``, a resident page's pool slot is checked against its checksum
    and a spilled page's record is read and checked as a restore would (nothing
    is restored). Raises ``PageNotFound`` if a uid names no live page.
    """
    mgr = core._mgr
    pids = np.flatnonzero(mgr.live) if uids is None else _pids(core, uids)
    columns = zip(pids.tolist(), mgr.uid[pids].tolist(), mgr.slot[pids].tolist(), mgr.fill[pids].tolist(),
                  mgr.ref[pids].tolist(), mgr.csum[pids].tolist(), (mgr.flags[pids] & HASHED).tolist(),
                  _cached(core, pids).tolist(), mgr.rec[pids].tolist(), mgr.rec_bytes[pids].tolist(),
                  mgr.codec[pids].tolist())
    out = []
    spill = core._spill
    with spill.begin_read() as txn:
        for pid, uid, slot, fill, ref, csum, hashed, cached, rec, nbytes, codec in columns:
            ok, problem = _check_page(core, txn, pid, uid, slot, fill, csum) if check else (None, None)
            out.append(PageInfo(
                uid=uid, slot=slot if slot >= 0 else None, tokens=fill, refcount=ref, checksum=csum,
                prefix_hash=bytes(mgr.hash[pid]) if hashed else None,
                parent=int(mgr.parent[pid]) if hashed else None, cached=cached,
                record=_RECORD_STATES[rec] if 0 <= rec < len(_RECORD_STATES) else "none",
                record_bytes=nbytes, codec=CODECS[codec] if rec != REC_NONE and codec < len(CODECS) else None,
                ok=ok, problem=problem))
    return out


def _pids(core: StoreCore, uids: Iterable[int]) -> NDArray[np.int64]:
    """The live rows of ``uids``, in their order; ``PageNotFound`` for a uid no live page has."""
    wanted = list(uids)
    for uid in wanted:
        if isinstance(uid, bool) or not isinstance(uid, (int, np.integer)) or not 0 <= uid < 1 << 64:
            raise PagedKVError(f"page uid must be an integer in 0..2**64-1, got {uid!r}")
    mgr = core._mgr
    live = np.flatnonzero(mgr.live)
    keys = np.array(wanted, np.uint64)
    if len(keys) <= _SCAN_UIDS:  # a scan per uid costs less than sorting the directory
        rows = [np.flatnonzero(mgr.live & (mgr.uid == key)) for key in keys]
        found = np.array([len(hit) > 0 for hit in rows], bool)
        pids = np.array([hit[0] if len(hit) else -1 for hit in rows], np.int64)
    else:
        order = np.argsort(mgr.uid[live])
        ordered = mgr.uid[live][order]
        at = np.minimum(np.searchsorted(ordered, keys), max(len(live) - 1, 0))
        found = ordered[at] == keys if len(live) else np.zeros(len(keys), bool)
        pids = live[order[at]] if len(live) else np.full(len(keys), -1, np.int64)
    if not found.all():
        raise PageNotFound(f"no page with uid {wanted[int(np.argmin(found))]} in {core.path}")
    return pids


def _check_page(core: StoreCore, txn: Any, pid: int, uid: int, slot: int, fill: int,
                csum: int) -> tuple[bool | None, str | None]:
    mgr = core._mgr
    if slot >= 0:
        if not mgr.csum_ok[pid]:
            return None, None  # written since its checksum was computed: nothing to check against yet
        if page_checksum(mgr.pool[slot], fill, uid, mgr.seed) == csum:
            return True, None
        return False, f"page {uid}: pool slot {slot} fails its checksum"
    try:
        read_record(mgr, txn, pid)
    except PageCorrupt as exc:
        return False, str(exc)
    return True, None


def describe_sequences(core: StoreCore) -> list[SequenceInfo]:
    """Every sequence, in the order ``KVStore.sequences()`` lists them."""
    mgr = core._mgr
    out = []
    for seq in core._seqs.values():
        table = seq.table
        out.append(SequenceInfo(id=seq.seq_id, length=seq.length, pages=tuple(mgr.uid[table].tolist()),
                                resident=int(np.count_nonzero(mgr.slot[table] >= 0))))
    return out


def page_content(core: StoreCore, uid: int) -> PageContent:
    """A copy of page ``uid``'s bytes, and its record's header when it is spilled.

    The record is decoded (its header checked against the geometry and the
    uid, its length against the header) but its bytes are not checked against
    the directory's checksum: ``describe_pages(check=True)`` does that.
    Raises ``PageNotFound``.
    """
    mgr = core._mgr
    pid = int(_pids(core, [uid])[0])
    slot = int(mgr.slot[pid])
    if slot >= 0:
        return PageContent(np.array(mgr.pool[slot]), None, None, None)
    spill = core._spill
    with spill.begin_read() as txn:
        value = txn.get(uid_key(int(uid)), db=spill.pages)
        if value is None:
            return PageContent(None, None, None, None)
        try:
            header, view = decode_record(core.geometry, value, int(uid))
        except PageCorrupt as exc:
            return PageContent(None, None, len(value), str(exc))
        return PageContent(np.array(view), dict(header), len(value), None)  # copy: the buffer dies with txn


def garbage(core: StoreCore) -> list[Problem]:
    """Spill records no page owns, as problems of kind ``"stray_record"``.

    After a crash these are the uncommitted evictions of the writer that
    stopped; the next writer's open deletes them. ``check()`` of a writer
    reports them; a read-only handle's leaves them out, and this lists them.
    """
    return stray_problems(core)

