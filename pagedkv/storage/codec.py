"""The spilled-page record and page checksums.

A record is ``u32 header length | msgpack header | payload``. The header is
decoded as untrusted input: bounded msgpack, then an exact schema check against
the store's geometry, before a byte of the payload is looked at.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import msgpack
import numpy as np
import xxhash

from . import codecs as spillcodecs
from ..errors import PageCorrupt
from ..geometry import Geometry
from .codecs import CODECS

# The store's: format 2 seals every metadata record with a checksum, format 3 commits the LRU
# stamps as a base record and a log of deltas (pages/lrulog.py).
FORMAT_VERSION = 3
RECORD_VERSION = 1  # the spilled-page record's header, unchanged since format 1

_LEN = struct.Struct("<I")
_IDENT = struct.Struct("<QI")
_MAX_HEADER = 1024
_RUN_MIN = 4096  # bytes: shorter filled runs are checksummed from one copy of them all
_SMALL_PAGE = 4096  # bytes: pages up to this size are hashed from one copy of their tokens
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
    tokens = page.shape[2]
    if page.nbytes <= _SMALL_PAGE:
        return bytes_checksum(page.tobytes() if fill == tokens else page[:, :, :fill].tobytes(), fill, uid, seed)
    if fill == tokens:
        # Viewed as bytes: the buffer protocol cannot export extension dtypes (bfloat16).
        return bytes_checksum(np.ascontiguousarray(page).view(np.uint8).data, fill, uid, seed)
    if page.flags.c_contiguous:
        return runs_checksum(page.reshape(-1).view(np.uint8).data, fill, tokens, page.shape[0] * page.shape[1],
                             uid, seed)
    return bytes_checksum(np.ascontiguousarray(page[:, :, :fill]).view(np.uint8).data, fill, uid, seed)


def runs_checksum(body: bytes | memoryview, fill: int, tokens: int, runs: int, uid: int,
                  seed: int) -> int:
    """``page_checksum`` of a C-order page given as its flat bytes: ``runs`` (layer, K/V) runs of ``tokens`` tokens.

    What a restore checks a slot with, straight from the slot's bytes: the
    page's array and its checks cost a third of hashing a 64 KiB page.
    """
    if fill == tokens:
        return bytes_checksum(body, fill, uid, seed)
    stride = len(body) // runs  # body is one-dimensional: len() counts bytes
    width = stride // tokens * fill
    if width < _RUN_MIN:  # short runs: hashed from one copy of them all
        return bytes_checksum(b"".join([body[start:start + width] for start in range(0, len(body), stride)]),
                              fill, uid, seed)
    # Each run's filled part hashed in place: copying them out first cost a 2 MiB
    # page 3x as much (xxh3 streams, so the digest is the same).
    hasher = xxhash.xxh3_64(seed=seed)
    hasher.update(_IDENT.pack(uid, fill))
    for start in range(0, len(body), stride):
        hasher.update(body[start:start + width])
    return hasher.intdigest()


def bytes_checksum(body: bytes | memoryview, fill: int, uid: int, seed: int) -> int:
    """``page_checksum`` of a page given as the bytes it hashes: each (layer, K/V) run's first ``fill`` tokens.

    A full page's bytes are simply its C-order bytes (a pool slot, or a raw
    record's payload), which is how a one-page restore checks the slot it wrote.
    """
    if len(body) <= _SMALL_PAGE:
        # One call over one short buffer: the streaming hasher's setup costs more than
        # hashing a small page (xxh3 streams, so the digest is the same).
        return xxhash.xxh3_64_intdigest(_IDENT.pack(uid, fill) + body, seed)
    hasher = xxhash.xxh3_64(seed=seed)
    hasher.update(_IDENT.pack(uid, fill))
    hasher.update(body)
    return hasher.intdigest()


def payload_checksum(payload: bytes | memoryview, fill: int, uid: int, seed: int) -> int:
    """64-bit xxh3 of an encoded payload, bound to its page uid, fill and store (``bytes_checksum``'s digest)."""
    return bytes_checksum(payload, fill, uid, seed)


def encode_record(geom: Geometry, uid: int, fill: int, csum: int, page: np.ndarray) -> bytearray:
    """Build the raw (bit-exact) spill value of a page with one copy of its bytes."""
    return encode_spill(geom, uid, fill, csum, page)[0]


def encode_spill(geom: Geometry, uid: int, fill: int, csum: int, page: np.ndarray,
                 codec: str = "raw", seed: int = 0) -> tuple[bytearray, str, np.ndarray | None]:
    """Build the spill value of a page; return (record, codec used, decoded page if lossy).

    A raw record carries ``csum`` (the page checksum of its ``fill`` tokens) and
    costs one copy of the page; an encoded record carries the checksum of its
    encoded payload, which is verified before anything is decoded.
    """
    layout = record_layout(geom)
    if codec == "raw":
        payload: Any = None
        nbytes, used, decoded = layout.page_nbytes, "raw", None
    else:
        used, payload, decoded = spillcodecs.encode(codec, geom, page, fill)
        nbytes, csum = len(payload), payload_checksum(payload, fill, uid, seed)
    if payload is None:
        return layout.raw_record(uid, fill, np.ascontiguousarray(page).view(np.uint8).data.cast("B"), csum,
                                 seed)[0], used, decoded
    out = bytearray(layout.prefix(uid, fill, used, csum, nbytes))
    out += payload  # appended rather than copied into a zeroed buffer: one pass over the payload, not two
    return out, used, decoded


class RecordLayout:
    """What every record of one geometry shares, computed once: the per-page paths read it.

    ``prefix`` is the only place a record header is built, so a record this
    version wrote can be recognised by comparing bytes (``match_raw``).
    """

    __slots__ = ("_before_fill", "_before_uid", "_codec_fields", "_nbytes_field", "_raw_middles",
                 "_raw_tail", "_shape", "dtype", "np_dtype", "page_nbytes", "page_shape", "runs")

    def __init__(self, geom: Geometry) -> None:
        self.dtype = geom.dtype
        self.np_dtype = geom.np_dtype
        self.page_shape = geom.page_shape
        self.page_nbytes = geom.page_nbytes
        self.runs = self.page_shape[0] * self.page_shape[1]  # (layer, K/V) runs of tokens in a page
        self._shape = list(self.page_shape)
        # The header's msgpack bytes between its integers, in the map's key order: a
        # header is these pieces with the integers packed in between (see prefix).
        packb = msgpack.packb
        self._before_uid: bytes = b"\x88" + packb("v") + packb(RECORD_VERSION) + packb("uid")
        self._before_fill: bytes = (packb("dtype") + packb(self.dtype) + packb("shape")
                                    + packb(self._shape) + packb("fill"))
        self._codec_fields: dict[str, bytes] = {
            name: packb("codec") + packb(name) + packb("csum") for name in CODECS}
        self._nbytes_field: bytes = packb("nbytes")
        # A raw header's pieces after the uid, for each possible fill, and after the checksum.
        self._raw_middles = [self._before_fill + _uint(fill) + self._codec_fields["raw"]
                             for fill in range(geom.page_size + 1)]
        self._raw_tail: bytes = self._nbytes_field + _uint(self.page_nbytes)

    def prefix(self, uid: int, fill: int, codec: str, csum: int, nbytes: int) -> bytes:
        """The bytes before a record's payload: u32 header length, then the msgpack header.

        The header is the msgpack map ``{"v", "uid", "dtype", "shape", "fill",
        "codec", "csum", "nbytes"}`` in that order, assembled from constant
        pieces and the integers packed as msgpack packs them (the smallest
        unsigned format): the same bytes, without building a dict per page.
        """
        fields = self._codec_fields.get(codec)
        if fields is None or not (0 <= uid < 1 << 64 and 0 <= fill < 1 << 64 and 0 <= csum < 1 << 64
                                  and 0 <= nbytes < 1 << 64):
            header: bytes = msgpack.packb({"v": RECORD_VERSION, "uid": uid, "dtype": self.dtype,
                                           "shape": self._shape, "fill": fill, "codec": codec,
                                           "csum": csum, "nbytes": nbytes})
            return _LEN.pack(len(header)) + header
        header = b"".join((self._before_uid, _uint(uid), self._before_fill, _uint(fill), fields,
                           _uint(csum), self._nbytes_field, _uint(nbytes)))
        return _LEN.pack(len(header)) + header

    def raw_record(self, uid: int, fill: int, body: memoryview, csum: int | None,
                   seed: int) -> tuple[bytearray, int]:
        """The raw record of a page given as its flat bytes, and the checksum it carries.

        With ``csum`` None, the checksum of the ``fill`` tokens copied is computed
        from the copy, where the bytes are hot: a 64 KiB page's cold bytes cost
        twice as much to hash as to copy. The header is written once the checksum
        is known (its length is that of a 64-bit one but for one checksum in 2**32).
        """
        nbytes = self.page_nbytes
        if csum is not None:
            out = bytearray(self.prefix(uid, fill, "raw", csum, nbytes))
            out += body  # appended rather than copied into a zeroed buffer: one pass over the page, not two
            return out, csum
        head = len(self.prefix(uid, fill, "raw", 1 << 63, nbytes))
        out = bytearray(head)
        out += body
        csum = runs_checksum(memoryview(out)[head:], fill, self.page_shape[2], self.runs, uid, seed)
        prefix = self.prefix(uid, fill, "raw", csum, nbytes)
        if len(prefix) != head:
            return bytearray(prefix) + out[head:], csum
        out[:head] = prefix
        return out, csum

    def match_raw(self, value: bytes | memoryview, uid: int, fill: int, csum: int) -> np.ndarray | None:
        """The page of a raw record whose header is exactly the one written for (uid, fill, csum).

        ``raw_payload_at``'s check, with the payload returned as a read-only
        view; None for any other record, valid or not.
        """
        start = self.raw_payload_at(value, uid, fill, csum)
        if start < 0:
            return None
        return np.ndarray(self.page_shape, self.np_dtype, value, start)

    def raw_payload_at(self, value: bytes | memoryview, uid: int, fill: int, csum: int) -> int:
        """Where the payload of a raw record starts whose header is exactly the one written for (uid, fill, csum).

        Such a header passes every check of ``decode_record`` by construction, so
        only the payload's length is left to check (its checksum is the caller's).
        Returns -1 for any other record, valid or not: the caller then takes the
        full path, which reports what is wrong. The expected header is
        ``prefix``'s, from the pieces it precomputed for a raw page.
        """
        if not (0 <= fill <= self.page_shape[2] and 0 <= uid < 1 << 64 and 0 <= csum < 1 << 64):
            return -1
        header = b"".join((self._before_uid, _uint(uid), self._raw_middles[fill],
                           _UINT64.pack(0xCF, csum) if csum > 0xFFFFFFFF else _uint(csum), self._raw_tail))
        start = _LEN.size + len(header)
        # Compared as bytes: a memoryview compares element by element, 3x slower.
        if len(value) != start + self.page_nbytes or \
                memoryview(value)[:start].tobytes() != _LEN.pack(len(header)) + header:
            return -1
        return start


_UINT8, _UINT16, _UINT32, _UINT64 = (struct.Struct(">BB"), struct.Struct(">BH"), struct.Struct(">BI"),
                                     struct.Struct(">BQ"))
_FIXINTS = [bytes((value,)) for value in range(0x80)]


def _uint(value: int) -> bytes:
    """An unsigned integer (below 2**64) as msgpack packs it: fixint, then uint 8/16/32/64."""
    if value > 0xFFFFFFFF:  # most checksums
        return _UINT64.pack(0xCF, value)
    if value > 0xFFFF:
        return _UINT32.pack(0xCE, value)
    if value > 0xFF:
        return _UINT16.pack(0xCD, value)
    if value >= 0x80:
        return _UINT8.pack(0xCC, value)
    return _FIXINTS[value]


@functools.lru_cache(maxsize=32)
def _layout_of(geom: Geometry) -> RecordLayout:
    return RecordLayout(geom)


_last_layout: tuple[Geometry, RecordLayout] | None = None


def record_layout(geom: Geometry) -> RecordLayout:
    """The shared ``RecordLayout`` of ``geom``.

    The last one asked for is kept beside the cache and found by identity:
    hashing a geometry costs a one-page read more than the rest of this lookup.
    """
    global _last_layout
    last = _last_layout
    if last is not None and last[0] is geom:
        return last[1]
    layout = _layout_of(geom)
    _last_layout = (geom, layout)
    return layout


def decode_record(geom: Geometry, value: bytes | memoryview, uid: int,
                  seed: int | None = None) -> tuple[dict[str, Any], np.ndarray]:
    """Validate a record and return its header and its page (a read-only view for raw).

    Raises ``PageCorrupt`` for any malformed header, a field that disagrees with
    the geometry or with ``uid``, a payload of the wrong length, an encoded
    payload that fails its checksum (checked when ``seed`` is given) or does not
    decode. A raw payload's checksum is left to the caller, who knows which fill
    the metadata committed.
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
    codec = header["codec"]
    if codec != "raw" and seed is not None and \
            payload_checksum(payload, header["fill"], uid, seed) != header["csum"]:
        raise PageCorrupt(f"page {uid}: {codec} payload fails its checksum", uid)
    try:
        page = spillcodecs.decode(codec, geom, payload)
    except spillcodecs.CodecError as exc:
        raise PageCorrupt(f"page {uid}: {exc}", uid) from None
    return header, page


def _header_problem(geom: Geometry, header: Any, uid: int) -> str | None:
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        return "header keys are not the expected schema"
    ints = ("v", "uid", "fill", "csum", "nbytes")
    if any(type(header[key]) is not int for key in ints):
        return "header integer field has the wrong type"
    if header["v"] != RECORD_VERSION:
        return f"record format version {header['v']} is not {RECORD_VERSION}"
    if header["uid"] != uid:
        return f"record belongs to page {header['uid']}"
    if not isinstance(header["codec"], str) or header["codec"] not in CODECS:
        return f"unknown codec {header['codec']!r}"
    if header["dtype"] != geom.dtype:
        return f"dtype {header['dtype']!r} is not the store's {geom.dtype!r}"
    shape = header["shape"]
    if not isinstance(shape, list) or any(type(d) is not int or d < 1 for d in shape):
        return "shape must be a list of positive ints"
    if tuple(shape) != geom.page_shape:
        return f"shape {shape} is not the store's {list(geom.page_shape)}"
    exact = spillcodecs.expected_nbytes(geom, header["codec"])
    if exact is not None and header["nbytes"] != exact:
        return f"nbytes {header['nbytes']} is not the {header['codec']} page size {exact}"
    if not 1 <= header["nbytes"] <= spillcodecs.max_nbytes(geom, header["codec"]):
        return f"nbytes {header['nbytes']} is out of range for {header['codec']}"
    if not 0 <= header["fill"] <= geom.page_size:
        return f"fill {header['fill']} is outside 0..{geom.page_size}"
    if not 0 <= header["csum"] < 1 << 64:
        return "checksum is out of range"
    return None
