"""Payload codecs for spilled pages: ``raw`` (bit-exact), ``int8`` (lossy) and ``zstd`` (lossless).

``int8`` quantises each (layer, K/V, head) group of a page symmetrically: one
float32 scale ``max|x| / 127`` per group over the page's filled tokens, values
rounded to the nearest step. Every restored value is within half a step
(``scale / 2``) of the original, plus the rounding of the result to the store's
dtype. A page holding NaN or Inf in its filled tokens is never quantised: it
falls back to ``zstd`` so it round-trips exactly. Tokens beyond the fill are
stored as zeros by the non-raw codecs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
import zstandard

from ..geometry import Geometry

CODECS = ("raw", "int8", "zstd")
LOSSY = frozenset({"int8"})
_ZSTD_LEVEL = 1  # spills sit on the eviction path: favour speed over ratio


class CodecError(ValueError):
    """An encoded payload does not decode to a page of this geometry."""


def int8_nbytes(geom: Geometry) -> int:
    """Payload size of an int8 page: float32 scales, then one byte per element."""
    return 4 * geom.layers * 2 * geom.kv_heads + geom.page_nbytes // geom.itemsize


def max_nbytes(geom: Geometry, codec: str) -> int:
    """Largest payload a valid record of ``codec`` may declare."""
    if codec == "raw":
        return geom.page_nbytes
    if codec == "int8":
        return int8_nbytes(geom)
    return geom.page_nbytes + (geom.page_nbytes >> 7) + 1024  # above zstd's worst-case expansion


def expected_nbytes(geom: Geometry, codec: str) -> int | None:
    """The exact payload size of ``codec`` when it is fixed (None for zstd)."""
    return {"raw": geom.page_nbytes, "int8": int8_nbytes(geom)}.get(codec)


def encode(codec: str, geom: Geometry, page: np.ndarray, fill: int) -> tuple[str, bytes, np.ndarray | None]:
    """Encode a page's payload; return (codec used, payload, decoded page if lossy else None)."""
    if codec == "int8":
        filled = page[:, :, :fill].astype(np.float32)
        if np.isfinite(filled).all():
            return _encode_int8(geom, filled, fill)
        codec = "zstd"  # NaN/Inf: never mangle, keep it exact
    if codec == "zstd":
        if fill < geom.page_size:
            page = page.copy()
            page[:, :, fill:] = 0
        data = np.ascontiguousarray(page).view(np.uint8)
        return "zstd", zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data.data), None
    raise ValueError(f"unknown codec {codec!r}")


def _encode_int8(geom: Geometry, filled: np.ndarray, fill: int) -> tuple[str, bytes, np.ndarray]:
    amax = np.abs(filled).max(axis=(2, 4)) if fill else np.zeros((geom.layers, 2, geom.kv_heads), np.float32)
    scales = (amax / 127.0).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0)[:, :, None, :, None]
    quant = np.zeros(geom.page_shape, np.int8)
    quant[:, :, :fill] = np.clip(np.rint(filled / safe), -127, 127)
    decoded = _dequantise(geom, scales, quant)
    return "int8", scales.tobytes() + quant.tobytes(), decoded


def _dequantise(geom: Geometry, scales: np.ndarray, quant: np.ndarray) -> np.ndarray:
    values: NDArray[np.float32] = quant.astype(np.float32) * scales[:, :, None, :, None]
    return values.astype(geom.np_dtype)


def decode(codec: str, geom: Geometry, payload: memoryview) -> np.ndarray:
    """Decode a payload into a page ndarray (a read-only view for raw); raise CodecError."""
    if codec == "raw":
        return np.frombuffer(payload, dtype=geom.np_dtype).reshape(geom.page_shape)
    if codec == "int8":
        nscales = geom.layers * 2 * geom.kv_heads
        scales = np.frombuffer(payload, np.float32, nscales).reshape(geom.layers, 2, geom.kv_heads)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise CodecError("int8 scales are not finite and non-negative")
        quant = np.frombuffer(payload, np.int8, offset=4 * nscales).reshape(geom.page_shape)
        return _dequantise(geom, scales, quant)
    if codec == "zstd":
        # Bound memory before decompressing: the frame must declare exactly one page.
        try:
            declared = zstandard.frame_content_size(bytes(payload[:18]))
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload has no valid frame header ({exc})") from None
        if declared != geom.page_nbytes:
            raise CodecError(f"zstd frame declares {declared} bytes, not {geom.page_nbytes}")
        try:
            raw = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=geom.page_nbytes)
        except (zstandard.ZstdError, MemoryError) as exc:
            raise CodecError(f"zstd payload does not decompress ({type(exc).__name__})") from None
        if len(raw) != geom.page_nbytes:
            raise CodecError(f"zstd payload decompresses to {len(raw)} bytes, not {geom.page_nbytes}")
        return np.frombuffer(raw, dtype=geom.np_dtype).reshape(geom.page_shape)
    raise CodecError(f"unknown codec {codec!r}")
