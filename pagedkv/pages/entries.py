"""What a commit writes, built in batches: page checksums, sealed directory entries, block tables.

A decode step changes one page and one block table per running sequence, so a
commit seals hundreds of small records. Each helper here does the per-record
work in as few Python-level operations per record as it can (numpy for the
fields, one C call per record for the checksums), and gives exactly what its
one-record form gives: ``codec.page_checksum``, ``metarecord.seal``,
``msgpack.packb``.
"""

from __future__ import annotations

from itertools import repeat

import msgpack
import numpy as np
import xxhash
from numpy.typing import NDArray

from ..storage.metarecord import DIR_DTYPE, TAG_DIR
from .directory import CODEC_SHIFT, SPILLED
from .manager import BlockManager
from .sequence import Sequence

__all__ = ["GATHER_BYTES", "dir_entries", "pack_tables", "refresh_checksums"]

GATHER_BYTES = 16 << 20  # partial-page bytes copied per checksum batch: bounded for big pages
_IDENT_DTYPE = np.dtype([("uid", "<u8"), ("fill", "<u4")])  # what page_checksum hashes first
# A directory entry's checksum covers the database tag, the key's length, the key, then the body.
_DIR_HEAD = TAG_DIR + (8).to_bytes(2, "little")  # uid keys are 8 bytes
# One sealed directory record: the checksummed input (head, key, body), then the checksum.
_DIR_RECORD = np.dtype([("head", f"V{len(_DIR_HEAD)}"), ("key", ">u8"), ("body", DIR_DTYPE), ("sum", "<u8")])
_DIR_KEY_AT = len(_DIR_HEAD)
_DIR_BODY_AT = _DIR_KEY_AT + 8
_DIR_SUM_AT = _DIR_BODY_AT + DIR_DTYPE.itemsize


def dir_entries(mgr: BlockManager, pids: NDArray[np.int64]) -> tuple[list[tuple[bytes, bytes]], NDArray[np.int32]]:
    """The sealed directory entries of ``pids`` as (key, value) pairs, and each page's placement.

    A resident page is recorded at its slot, any other as ``SPILLED``. The same
    bytes ``metarecord.dir_value`` gives: every record is one fixed-size row of
    one array (the checksummed input, then the checksum), so the inputs, the
    keys and the values each turn into a list of bytes in one call.
    """
    count = len(pids)
    slots = mgr.slot[pids]
    if not count:
        return [], slots.astype(np.int32)
    where = np.where(slots >= 0, slots, SPILLED).astype(np.int32)
    records = np.empty(count, _DIR_RECORD)
    records["head"] = _DIR_HEAD
    records["key"] = mgr.uid[pids]
    body = records["body"]
    body["where"], body["fill"], body["csum"] = where, mgr.fill[pids], mgr.csum[pids]
    body["flags"] = mgr.flags[pids].astype(np.uint32) | mgr.codec[pids].astype(np.uint32) << CODEC_SHIFT
    body["hash"], body["parent"], body["chain"] = mgr.hash[pids], mgr.parent[pids], mgr.chain[pids]
    raw = records.view(np.uint8).reshape(count, _DIR_RECORD.itemsize)
    inputs = raw[:, :_DIR_SUM_AT].view(f"V{_DIR_SUM_AT}")[:, 0].tolist()
    records["sum"] = np.fromiter(map(xxhash.xxh3_64_intdigest, inputs, repeat(mgr.seed)), np.uint64, count)
    keys = raw[:, _DIR_KEY_AT:_DIR_BODY_AT].view("V8")[:, 0].tolist()
    values = raw[:, _DIR_BODY_AT:].view(f"V{_DIR_RECORD.itemsize - _DIR_BODY_AT}")[:, 0].tolist()
    return list(zip(keys, values)), where


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
        values.append(pack((seq.seq_id, seq.length, uids[low:high])))  # a tuple packs as the list does
        low = high
    return values


def refresh_checksums(mgr: BlockManager, pids: NDArray[np.int64], gather_bytes: int = GATHER_BYTES) -> None:
    """Recompute the checksums of resident pages ``pids`` (``codec.page_checksum``, batched).

    Full pages are hashed in place. The first ``fill`` tokens of a partial page are
    strided across layers, so the token rows of many pages are gathered with one
    ``np.take`` per batch of about ``gather_bytes``; each page is then hashed as
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
        with rows.data.cast("B") as pool_bytes:
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
        if ends[-1] > gather_bytes:
            batches = np.split(part, np.searchsorted(ends, np.arange(gather_bytes, ends[-1], gather_bytes)))
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
