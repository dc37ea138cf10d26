"""The remote value: a versioned envelope around pagedkv's page record, and the key it lives under.

A value is::

    b"PKVR" | u8 envelope version | u8 0 | u16 token count | salt (16) | hash (16) | parent hash (16)
    | token ids (u32 little-endian each) | page record (u32 header length | msgpack header | payload)

The page record is the spill record of ``codec.py``, in any spill codec, with the
uid and checksum seed derived from the page's remote hash and the salt, so its
checksum binds the bytes to this page of this model. The key holds the salt and
the hash; a value is accepted only if its salt and hash are the key's, its hash is
the chained hash of its parent and token ids, its parent and token ids are the
ones the reader's prompt has there, its header fits the reader's geometry, and
its checksum holds. Anything else is refused (a miss), never served.

The salt is the fleet's, not a store's: stores on several hosts share pages, so
it binds the namespace, the model fingerprint and the page geometry, and nothing
of one store (each store's own prefix salt is random).
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from ..errors import PageCorrupt
from ..geometry import Geometry
from ..pages.prefix import ROOT, chain_hash
from ..pages.tokens import TOKEN_DTYPE
from ..storage.codec import decode_record, encode_spill, page_checksum

MAGIC = b"PKVR"
ENVELOPE_VERSION = 1
_FIXED = struct.Struct("<4sBBH16s16s16s")  # magic, version, reserved, token count, salt, hash, parent
_UID_MASK = (1 << 63) - 1


class Refused(Exception):
    """A remote value that must not be served; ``reason`` says why (for the log, never the bytes)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def remote_salt(namespace: str, model: str, geom: Geometry) -> bytes:
    """The salt of every remote hash of ``model``'s pages of ``geom`` in ``namespace``."""
    shape = f"{geom.layers}x{geom.kv_heads}x{geom.head_dim}x{geom.page_size}:{geom.dtype}"
    text = f"pagedkv remote\x00{namespace}\x00{model}\x00{shape}"
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


def remote_key(prefix: str, namespace: str, salt: bytes, digest: bytes) -> bytes:
    """The Redis key of the page with remote hash ``digest``."""
    return f"{prefix}{namespace}:{salt.hex()}:{digest.hex()}".encode("ascii")


def record_ident(salt: bytes, digest: bytes) -> tuple[int, int]:
    """(uid, checksum seed) the page record of ``digest`` is sealed with."""
    return int.from_bytes(digest[:8], "little") & _UID_MASK, int.from_bytes(salt[:8], "little")


def chain(salt: bytes, token_ids: np.ndarray, page_size: int, pages: int,
          parent: bytes = ROOT, first: int = 0) -> list[bytes]:
    """Remote hashes of pages ``first .. first + pages - 1`` of ``token_ids`` (``parent``: page ``first - 1``'s)."""
    out = []
    for index in range(first, first + pages):
        parent = chain_hash(parent, salt, token_ids[index * page_size:(index + 1) * page_size])
        out.append(parent)
    return out


def encode(geom: Geometry, salt: bytes, digest: bytes, parent: bytes, token_ids: np.ndarray,
           page: np.ndarray, codec: str = "raw") -> bytes:
    """The remote value of a full page (``token_ids``: its ``page_size`` ids)."""
    uid, seed = record_ident(salt, digest)
    fill = geom.page_size
    csum = page_checksum(page, fill, uid, seed) if codec == "raw" else 0
    record, _, _ = encode_spill(geom, uid, fill, csum, page, codec, seed)
    ids = np.ascontiguousarray(token_ids, TOKEN_DTYPE)
    head = _FIXED.pack(MAGIC, ENVELOPE_VERSION, 0, len(ids), salt, digest, parent)
    return b"".join((head, ids.tobytes(), record))


def decode(geom: Geometry, value: bytes | memoryview, salt: bytes, digest: bytes, parent: bytes,
           token_ids: np.ndarray) -> np.ndarray:
    """The page of a remote value, verified to be page ``digest`` after ``parent`` holding ``token_ids``.

    Returns a page ``(layers, 2, page_size, kv_heads, head_dim)`` (possibly a
    read-only view of ``value``). Raises ``Refused`` naming the first check failed.
    """
    view = memoryview(value)
    if len(view) < _FIXED.size:
        raise Refused(f"value of {len(view)} bytes is truncated")
    magic, version, _, count, v_salt, v_digest, v_parent = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise Refused("not a pagedkv page (bad magic)")
    if version != ENVELOPE_VERSION:
        raise Refused(f"envelope version {version}, this pagedkv reads {ENVELOPE_VERSION}")
    if v_salt != salt:
        raise Refused("a page of another model, geometry or namespace")
    if v_digest != digest:
        raise Refused("a page stored under another page's key")
    if v_parent != parent:
        raise Refused("a page that follows another prefix")
    if count != geom.page_size or count != len(token_ids):
        raise Refused(f"{count} token ids, not a full page of {geom.page_size}")
    start = _FIXED.size + 4 * count
    if len(view) < start:
        raise Refused("value is truncated inside its token ids")
    ids = np.frombuffer(view, TOKEN_DTYPE, count, _FIXED.size)
    if not np.array_equal(ids, token_ids):
        raise Refused("token ids differ from the prompt's (a hash collision)")
    if chain_hash(parent, salt, ids) != digest:
        raise Refused("hash is not the chained hash of its parent and token ids")
    uid, seed = record_ident(salt, digest)
    try:
        header, page = decode_record(geom, view[start:], uid, seed)
    except PageCorrupt as exc:
        raise Refused(str(exc).replace(f"page {uid}: ", "page record: ")) from None
    if header["fill"] != geom.page_size:
        raise Refused(f"page record holds {header['fill']} tokens, not {geom.page_size}")
    if header["codec"] == "raw" and page_checksum(page, header["fill"], uid, seed) != header["csum"]:
        raise Refused("page record fails its checksum")
    return page
