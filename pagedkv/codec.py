"""The spilled-page record and page checksums.

A record is ``u32 header length | msgpack header | payload``. The header is
decoded as untrusted input: bounded msgpack, then an exact schema check against
the store's geometry, before a byte of the payload is looked at.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import xxhash

from .errors import PageCorrupt
from .geometry import Geometry

FORMAT_VERSION = 1
CODECS = ("raw",)

_LEN = struct.Struct("<I")
_IDENT = struct.Struct("<QI")
_MAX_HEADER = 1024
_HEADER_KEYS = frozenset({"v", "uid", "dtype", "shape", "fill", "codec", "csum", "nbytes"})


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("ext types are not allowed")


def unpack_bounded(blob: bytes | memoryview, max_len: int) -> Any:
    """Decode msgpack from an untrusted source with explicit limits and no ext types."""
    return msgpack.unpackb(
        blob,
        raw=False,
        strict_map_key=True,
        ext_hook=_no_ext,
        max_bin_len=max_len,
        max_str_len=max_len,
        max_array_len=max_len,
        max_map_len=max_len,
        max_ext_len=0,
    )


def page_checksum(page: np.ndarray, fill: int, uid: int, seed: int) -> int:
    """64-bit xxh3 of a page's first ``fill`` tokens, bound to its uid and the store.

    The uid and fill are hashed too, so a record or slot holding another page's
    bytes (or a stale fill) fails; the seed is the store's, so a pool file swapped
    in from another store fails as well.
    """
    hasher = xxhash.xxh3_64(seed=seed)
    hasher.update(_IDENT.pack(uid, fill))
    # Viewed as bytes: the buffer protocol cannot export extension dtypes (bfloat16).
    if fill == page.shape[2]:
        hasher.update(np.ascontiguousarray(page).view(np.uint8))
    elif fill:
        hasher.update(np.ascontiguousarray(page[:, :, :fill]).view(np.uint8))
    return hasher.intdigest()


def encode_record(geom: Geometry, uid: int, fill: int, csum: int, page: np.ndarray) -> bytearray:
    """Build the spill value for a page with one copy of its bytes."""
    header = msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "uid": uid,
            "dtype": geom.dtype,
            "shape": list(geom.page_shape),
            "fill": fill,
            "codec": "raw",
            "csum": csum,
            "nbytes": geom.page_nbytes,
        }
    )
    start = _LEN.size + len(header)
    out = bytearray(start + geom.page_nbytes)
    _LEN.pack_into(out, 0, len(header))
    out[_LEN.size : start] = header
    dst = np.frombuffer(out, dtype=geom.np_dtype, offset=start).reshape(geom.page_shape)
    np.copyto(dst, page)
    return out


def decode_record(geom: Geometry, value: bytes | memoryview, uid: int) -> tuple[dict[str, Any], np.ndarray]:
    """Validate a record and return its header and a read-only view of its page.

    Raises ``PageCorrupt`` for any malformed header, a field that disagrees with
    the geometry or with ``uid``, or a payload of the wrong length. The checksum
    itself is left to the caller, who knows which fill the metadata committed.
    """
    view = memoryview(value)
    if len(view) < _LEN.size:
        raise PageCorrupt(f"page {uid}: record of {len(view)} bytes is truncated", uid)
    (hlen,) = _LEN.unpack_from(view, 0)
    if not 1 <= hlen <= _MAX_HEADER or _LEN.size + hlen > len(view):
        raise PageCorrupt(f"page {uid}: header length {hlen} is out of range", uid)
    try:
        header = unpack_bounded(view[_LEN.size : _LEN.size + hlen], 64)
    except Exception as exc:  # msgpack raises a zoo of types on hostile input
        raise PageCorrupt(f"page {uid}: header does not decode ({type(exc).__name__})", uid) from None
    problem = _header_problem(geom, header, uid)
    if problem:
        raise PageCorrupt(f"page {uid}: {problem}", uid)
    payload = view[_LEN.size + hlen :]
    if len(payload) != header["nbytes"]:
        raise PageCorrupt(
            f"page {uid}: payload is {len(payload)} bytes, header declares {header['nbytes']}", uid
        )
    page = np.frombuffer(payload, dtype=geom.np_dtype).reshape(geom.page_shape)
    return header, page


def _header_problem(geom: Geometry, header: Any, uid: int) -> str | None:
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        return "header keys are not the expected schema"
    ints = ("v", "uid", "fill", "csum", "nbytes")
    if any(type(header[key]) is not int for key in ints):
        return "header integer field has the wrong type"
    if header["v"] != FORMAT_VERSION:
        return f"record format version {header['v']} is not {FORMAT_VERSION}"
    if header["uid"] != uid:
        return f"record belongs to page {header['uid']}"
    if header["codec"] not in CODECS:
        return f"unknown codec {header['codec']!r}"
    if header["dtype"] != geom.dtype:
        return f"dtype {header['dtype']!r} is not the store's {geom.dtype!r}"
    shape = header["shape"]
    if not isinstance(shape, list) or any(type(d) is not int or d < 1 for d in shape):
        return "shape must be a list of positive ints"
    if tuple(shape) != geom.page_shape:
        return f"shape {shape} is not the store's {list(geom.page_shape)}"
    if header["nbytes"] != geom.page_nbytes:
        return f"nbytes {header['nbytes']} is not the page size {geom.page_nbytes}"
    if not 0 <= header["fill"] <= geom.page_size:
        return f"fill {header['fill']} is outside 0..{geom.page_size}"
    if not 0 <= header["csum"] < 1 << 64:
        return "checksum is out of range"
    return None
