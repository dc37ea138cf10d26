"""Page geometry: shapes, dtype and the byte sizes derived from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GeometryMismatch, PagedKVError

try:  # bfloat16 has no numpy builtin; ml_dtypes gives an exact 2-byte type
    import ml_dtypes

    _BF16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    _BF16 = None

DTYPES: dict[str, np.dtype | None] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "bfloat16": _BF16,
}

# Bounds keep every derived size inside int64 and every header field inside u32.
_MAX_DIM = 1 << 20
_MAX_PAGE_NBYTES = 1 << 31


@dataclass(frozen=True, slots=True)
class Geometry:
    """Shape of one KV page.

    A page holds K and V of ``page_size`` tokens for all layers, contiguous, with
    shape ``(layers, 2, page_size, kv_heads, head_dim)``.
    """

    layers: int  # transformer layers stored per page
    kv_heads: int  # key/value heads (fewer than query heads under GQA)
    head_dim: int  # elements per head
    page_size: int = 16  # tokens per page (vLLM's block_size)
    dtype: str = "float16"  # one of DTYPES

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PagedKVError(f"geometry {name} must be an int, got {value!r}")
            if not 1 <= int(value) <= _MAX_DIM:
                raise PagedKVError(f"geometry {name} must be in 1..{_MAX_DIM}, got {value}")
            object.__setattr__(self, name, int(value))
        if isinstance(self.dtype, np.dtype) or (
            isinstance(self.dtype, type) and issubclass(self.dtype, np.generic)
        ):
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise PagedKVError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if DTYPES[self.dtype] is None:
            raise PagedKVError("bfloat16 needs the ml_dtypes package")
        if self.page_nbytes > _MAX_PAGE_NBYTES:
            raise PagedKVError(f"page of {self.page_nbytes} bytes exceeds {_MAX_PAGE_NBYTES}")

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of every element (little-endian)."""
        dtype = DTYPES[self.dtype]
        assert dtype is not None
        return dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.np_dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one page: (layers, 2, page_size, kv_heads, head_dim)."""
        return (self.layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def token_shape(self) -> tuple[int, int]:
        """Shape of one token of one layer's K or V: (kv_heads, head_dim)."""
        return (self.kv_heads, self.head_dim)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token of one layer's K (or V)."""
        return self.kv_heads * self.head_dim * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of K and V of one token across all layers."""
        return 2 * self.layers * self.row_nbytes

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page."""
        return self.page_size * self.token_nbytes

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the five fields (for metadata and JSON)."""
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Geometry:
        """Build a geometry from ``to_dict`` output; unknown or missing keys are an error."""
        names = {"layers", "kv_heads", "head_dim", "page_size", "dtype"}
        if not isinstance(fields, dict) or set(fields) != names:
            raise PagedKVError(f"geometry record must have exactly the keys {sorted(names)}")
        return cls(**fields)

    def require_same(self, other: Geometry) -> None:
        """Raise ``GeometryMismatch`` naming every field where ``other`` differs."""
        diffs = [
            f"{name}: on disk {getattr(self, name)!r}, asked {getattr(other, name)!r}"
            for name in ("layers", "kv_heads", "head_dim", "page_size", "dtype")
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise GeometryMismatch("geometry differs from the store's: " + "; ".join(diffs))


PRESETS: dict[str, Geometry] = {
    "tiny": Geometry(layers=2, kv_heads=2, head_dim=16, page_size=16, dtype="float16"),
    "small": Geometry(layers=4, kv_heads=4, head_dim=64, page_size=16, dtype="float16"),
    "llama-3-8b": Geometry(layers=32, kv_heads=8, head_dim=128, page_size=16, dtype="float16"),
}
