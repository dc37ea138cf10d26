"""Geometry: validation, derived byte sizes, dtypes, presets."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import pagedkv
from pagedkv import Geometry, GeometryMismatch, PagedKVError

from tests.kits.content import kv, same_bits




@pytest.mark.parametrize("dtype,itemsize", [("float16", 2), ("float32", 4), ("bfloat16", 2)])
def test_geometry_sizes_derived(dtype: str, itemsize: int) -> None:
    g = Geometry(layers=3, kv_heads=5, head_dim=7, page_size=11, dtype=dtype)
    assert g.itemsize == itemsize
    assert g.np_dtype.itemsize == itemsize
    assert g.page_shape == (3, 2, 11, 5, 7)
    assert g.token_shape == (5, 7)
    assert g.row_nbytes == 5 * 7 * itemsize
    assert g.token_nbytes == 2 * 3 * 5 * 7 * itemsize
    assert g.page_nbytes == 11 * 2 * 3 * 5 * 7 * itemsize
    assert g.page_nbytes == int(np.prod(g.page_shape)) * itemsize


def test_geometry_defaults() -> None:
    g = Geometry(layers=1, kv_heads=1, head_dim=1)
    assert g.page_size == 16
    assert g.dtype == "float16"


def test_geometry_dtypes_little_endian_exact() -> None:
    assert Geometry(1, 1, 1, 1, "float16").np_dtype == np.dtype("<f2")
    assert Geometry(1, 1, 1, 1, "float32").np_dtype == np.dtype("<f4")
    assert Geometry(1, 1, 1, 1, "bfloat16").np_dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("spec", [np.float16, np.dtype("float32"), ml_dtypes.bfloat16,
                                  np.dtype(ml_dtypes.bfloat16)])
def test_geometry_dtype_numpy_spellings_normalised(spec: object) -> None:
    g = Geometry(2, 2, 2, 2, spec)  # type: ignore[arg-type]
    assert isinstance(g.dtype, str)
    assert g.dtype in ("float16", "float32", "bfloat16")
    assert g == Geometry(2, 2, 2, 2, g.dtype)


def test_geometry_numpy_ints_accepted() -> None:
    g = Geometry(np.int64(2), np.int32(3), np.uint8(4), np.int16(5))  # type: ignore[arg-type]
    assert (g.layers, g.kv_heads, g.head_dim, g.page_size) == (2, 3, 4, 5)
    assert all(type(x) is int for x in (g.layers, g.kv_heads, g.head_dim, g.page_size))


@pytest.mark.parametrize("field", ["layers", "kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("bad", [0, -1, 1 << 20 | 1, 1 << 40, 2.0, "4", None, True, False, [4]])
def test_geometry_bad_dimension_raises(field: str, bad: object) -> None:
    fields = dict(layers=2, kv_heads=2, head_dim=4, page_size=4, dtype="float32")
    fields[field] = bad
    with pytest.raises(PagedKVError):
        Geometry(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["float64", "int8", "fp16", "FLOAT16", "", None, 5,
                                 np.dtype("float64"), np.int8, ">f2", "<f4",
                                 ["float16"], {"float16": 1}])
def test_geometry_bad_dtype_raises(bad: object) -> None:
    with pytest.raises(PagedKVError):
        Geometry(2, 2, 4, 4, bad)  # type: ignore[arg-type]


def test_geometry_page_too_large_raises() -> None:
    with pytest.raises(PagedKVError, match="exceeds"):
        Geometry(layers=1024, kv_heads=1024, head_dim=1024, page_size=1, dtype="float32")
    # Just under the bound is fine.
    g = Geometry(layers=1 << 10, kv_heads=1 << 10, head_dim=1 << 9, page_size=1, dtype="float16")
    assert g.page_nbytes == 1 << 31


def test_geometry_frozen_and_hashable() -> None:
    g = Geometry(2, 2, 4, 4, "float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.layers = 3  # type: ignore[misc]
    assert {g: 1}[Geometry(2, 2, 4, 4, "float32")] == 1
    assert g != Geometry(2, 2, 4, 4, "float16")


def test_geometry_dict_round_trip() -> None:
    g = Geometry(3, 4, 5, 6, "bfloat16")
    assert Geometry.from_dict(g.to_dict()) == g
    assert g.to_dict() == {"layers": 3, "kv_heads": 4, "head_dim": 5, "page_size": 6, "dtype": "bfloat16"}


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("dtype"),
    lambda d: d.update(extra=1),
    lambda d: d.update(layers=0),
    lambda d: d.update(dtype="int4"),
])
def test_geometry_from_dict_bad_raises(mutate) -> None:
    d = Geometry(2, 2, 4, 4, "float32").to_dict()
    mutate(d)
    with pytest.raises(PagedKVError):
        Geometry.from_dict(d)


@pytest.mark.parametrize("bad", [None, [], "layers", 5])
def test_geometry_from_dict_not_a_dict_raises(bad: object) -> None:
    with pytest.raises(PagedKVError):
        Geometry.from_dict(bad)  # type: ignore[arg-type]


def test_geometry_require_same_names_every_field() -> None:
    a = Geometry(2, 2, 4, 4, "float32")
    a.require_same(Geometry(2, 2, 4, 4, "float32"))
    with pytest.raises(GeometryMismatch) as info:
        a.require_same(Geometry(3, 2, 5, 4, "float16"))
    text = str(info.value)
    assert "layers" in text and "head_dim" in text and "dtype" in text
    assert "kv_heads" not in text and "page_size" not in text
    assert isinstance(info.value, PagedKVError)


def test_geometry_presets() -> None:
    assert {"tiny", "small", "llama-3-8b"} <= set(pagedkv.PRESETS)
    for name, g in pagedkv.PRESETS.items():
        assert isinstance(g, Geometry), name
        assert Geometry.from_dict(g.to_dict()) == g
    llama = pagedkv.PRESETS["llama-3-8b"]
    assert (llama.layers, llama.kv_heads, llama.head_dim, llama.page_size, llama.dtype) == \
        (32, 8, 128, 16, "float16")
    assert llama.page_nbytes == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB


def test_geometry_bfloat16_exact_round_trip(stores) -> None:
    """Every bfloat16 bit pattern (NaNs, infinities, denormals, -0) survives append/read/reopen."""
    g = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=4, dtype="bfloat16")
    per_token = 2 * 2 * 4
    patterns = np.arange(1 << 16, dtype=np.uint16)
    ntok = -(-len(patterns) // (2 * per_token))
    raw = np.resize(patterns, 2 * ntok * per_token)
    k = raw[: ntok * per_token].view(ml_dtypes.bfloat16).reshape(2, ntok, 2, 4)
    v = raw[ntok * per_token:].view(ml_dtypes.bfloat16).reshape(2, ntok, 2, 4)
    store = stores.open("bf16", g, pool_pages=16)
    store.create("all")
    store.append("all", k, v)
    rk, rv = store.read("all")
    assert rk.dtype == np.dtype(ml_dtypes.bfloat16)
    assert same_bits(rk, k) and same_bits(rv, v)
    store = stores.reopen(store)
    assert store.geometry == g
    rk, rv = store.read("all")
    assert same_bits(rk, k) and same_bits(rv, v)
    assert store.check() == []


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_geometry_raw_bits_round_trip(stores, dtype: str) -> None:
    g = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=4, dtype=dtype)
    store = stores.open(dtype, g, pool_pages=4)
    store.create(0)
    k, v = kv(7, "x", 0, 37, g)
    store.append(0, k, v)
    store = stores.reopen(store)
    rk, rv = store.read(0)
    assert same_bits(rk, k) and same_bits(rv, v)
    assert store.check() == []
