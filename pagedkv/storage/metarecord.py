"""Committed metadata records: each value carries a checksum bound to its database, key and store.

A value is ``body | u64 xxh3`` where the checksum covers the database's tag, the
key and the body, seeded with the store's seed. A bit flip anywhere in a block
table, directory entry, token list or state record, a value moved under another
key (a renamed sequence) or into another database, and a record copied in from
another store all fail it, so damaged metadata is reported instead of followed.

Stores of format version 1 wrote bare bodies; a writer rewrites them sealed
when it opens one (``persist.upgrade``).
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

TRAILER = 8
SUPERBLOCK_SEED = 0  # the superblock holds the store's identity, so it binds only its key
_KEY_LEN = struct.Struct("<H")
_TRAILER = struct.Struct("<Q")

# Directory value: placement (slot, or -1 spilled), committed fill, checksum, flags,
# content hash, the chain class of the page it follows (0: the first page) and its own.
DIR_ENTRY = struct.Struct("<iIQI16sQQ")
DIR_ENTRY_V1 = struct.Struct("<iIQI16sQ")  # format 1: no chain class of its own
DIR_DTYPE = np.dtype([("where", "<i4"), ("fill", "<u4"), ("csum", "<u8"), ("flags", "<u4"),
                      ("hash", "V16"), ("parent", "<u8"), ("chain", "<u8")])
DIR_DTYPE_V1 = np.dtype([("where", "<i4"), ("fill", "<u4"), ("csum", "<u8"), ("flags", "<u4"),
                         ("hash", "V16"), ("parent", "<u8")])
assert DIR_DTYPE.itemsize == DIR_ENTRY.size and DIR_DTYPE_V1.itemsize == DIR_ENTRY_V1.size

TAG_DIR, TAG_SEQS, TAG_TOKENS, TAG_META = b"dir", b"seqs", b"tokens", b"meta"


def _digest(tag: bytes, key: bytes, body: bytes | bytearray | memoryview, seed: int) -> int:
    hasher = xxhash.xxh3_64(tag, seed)
    hasher.update(_KEY_LEN.pack(len(key)))
    hasher.update(key)
    hasher.update(body)
    return hasher.intdigest()


def seal(tag: bytes, key: bytes, body: bytes | bytearray | memoryview, seed: int) -> bytes:
    """``body`` followed by its checksum bound to ``tag`` (the database), ``key`` and ``seed``."""
    return bytes(body) + _TRAILER.pack(_digest(tag, key, body, seed))


def unseal(tag: bytes, key: bytes, raw: bytes | memoryview, seed: int) -> bytes | None:
    """The body of a sealed value, or None when it is too short or fails its checksum."""
    if len(raw) < TRAILER:
        return None
    view = memoryview(raw)
    body = view[:-TRAILER]
    if _digest(tag, key, body, seed) != _TRAILER.unpack(view[-TRAILER:])[0]:
        return None
    return bytes(body)


def seal_many(tag: bytes, keys: list[bytes], bodies: list[bytes], seed: int) -> list[bytes]:
    """``seal`` for many records of one database (one call: the commit's hot loop)."""
    pack, digest = _TRAILER.pack, xxhash.xxh3_64_intdigest
    # The tag and key length lead every checksummed input; a batch's keys have few lengths.
    heads = {size: tag + _KEY_LEN.pack(size) for size in set(map(len, keys))}
    return [body + pack(digest(heads[len(key)] + key + body, seed)) for key, body in zip(keys, bodies)]


def sealed_ok(tag: bytes, keys: list[bytes], values: list[bytes], seed: int) -> np.ndarray:
    """For each (key, sealed value): whether it passes its checksum (a reopen's bulk check)."""
    digest, unpack = xxhash.xxh3_64_intdigest, _TRAILER.unpack_from
    ok = np.zeros(len(keys), bool)
    for index, (key, value) in enumerate(zip(keys, values)):
        if len(value) >= TRAILER:
            body = value[:-TRAILER]
            ok[index] = digest(tag + _KEY_LEN.pack(len(key)) + key + body, seed) == \
                unpack(value, len(value) - TRAILER)[0]
    return ok


def dir_value(key: bytes, where: int, fill: int, csum: int, flags: int, digest: bytes, parent: int,
              chain: int, seed: int) -> bytes:
    """A sealed directory value of the page whose uid key is ``key``."""
    return seal(TAG_DIR, key, DIR_ENTRY.pack(where, fill, csum, flags, digest, parent, chain), seed)


def read_dir_value(key: bytes, raw: bytes | memoryview, seed: int) -> tuple[int, int, int, int, bytes, int, int]:
    """The fields of a sealed directory value; ``ValueError`` if it is damaged."""
    body = unseal(TAG_DIR, key, raw, seed)
    if body is None or len(body) != DIR_ENTRY.size:
        raise ValueError("directory entry fails its checksum")
    return DIR_ENTRY.unpack(body)
