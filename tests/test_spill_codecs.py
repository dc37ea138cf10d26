"""Spill codecs on edge-case pages: all zeros, Inf, denormals; and through a real store."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv.storage import codecs as spillcodecs
from pagedkv.storage.codec import decode_record, encode_spill, page_checksum
from pagedkv.geometry import Geometry

GEOMS = [Geometry(2, 2, 8, 4, dtype) for dtype in ("float16", "float32", "bfloat16")]
SEED = 1234


def roundtrip(geom: Geometry, page: np.ndarray, codec: str, fill: int | None = None) -> tuple[str, np.ndarray]:
    fill = geom.page_size if fill is None else fill
    csum = page_checksum(page, fill, 7, SEED)
    record, used, _ = encode_spill(geom, 7, fill, csum, page, codec, SEED)
    header, out = decode_record(geom, bytes(record), 7, SEED)
    assert header["codec"] == used and header["fill"] == fill
    return used, out


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: g.dtype)
@pytest.mark.parametrize("codec", ["int8", "zstd"])
def test_all_zero_page_round_trips_exactly(geom: Geometry, codec: str) -> None:
    page = np.zeros(geom.page_shape, geom.np_dtype)
    used, out = roundtrip(geom, page, codec)
    assert used == codec
    assert np.array_equal(out.view(np.uint8), page.view(np.uint8))


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: g.dtype)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_int8_never_quantises_non_finite_pages(geom: Geometry, bad: float) -> None:
    rng = np.random.default_rng(3)
    page = rng.standard_normal(geom.page_shape).astype(geom.np_dtype)
    page[0, 1, 2, 1, 5] = bad
    used, out = roundtrip(geom, page, "int8")
    assert used == "zstd"
    assert np.array_equal(out.view(np.uint8), page.view(np.uint8))


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: g.dtype)
def test_int8_error_bound_with_denormals_and_mixed_scales(geom: Geometry) -> None:
    """Every value within half a step of its group's scale, plus the store dtype's rounding."""
    rng = np.random.default_rng(4)
    values = rng.standard_normal(geom.page_shape).astype(np.float32)
    values[0] *= 1e-6  # tiny groups (denormal range in float16) beside ordinary ones
    values[1, 1] *= 300.0
    page = values.astype(geom.np_dtype)
    used, out = roundtrip(geom, page, "int8")
    assert used == "int8"
    original = page.astype(np.float32)
    scale = np.abs(original).max(axis=(2, 4), keepdims=True) / 127.0
    dtype_ulp = np.abs(original) * float(np.finfo(np.float16).eps if geom.itemsize == 2 else 0) + 1e-30
    if geom.dtype == "bfloat16":
        dtype_ulp = np.abs(original) * 2.0 ** -7 + 1e-30
    error = np.abs(out.astype(np.float32) - original)
    assert (error <= scale / 2 * (1 + 1e-6) + dtype_ulp).all()


def test_int8_tokens_beyond_fill_do_not_set_the_scale() -> None:
    geom = GEOMS[1]
    page = np.ones(geom.page_shape, np.float32)
    page[:, :, 2:] = 1e30  # stale bytes past the fill must not blow up the scale
    used, out = roundtrip(geom, page, "int8", fill=2)
    assert used == "int8"
    assert np.allclose(out[:, :, :2], 1.0, atol=1 / 254)


def test_zstd_frame_must_declare_one_page() -> None:
    geom = GEOMS[0]
    with pytest.raises(spillcodecs.CodecError):
        spillcodecs.decode("zstd", geom, memoryview(b"\x28\xb5\x2f\xfd" + bytes(20)))


@pytest.mark.parametrize("codec", ["int8", "zstd"])
def test_codec_store_round_trip_and_stats(tmp_path, codec: str) -> None:
    geom = Geometry(2, 2, 16, 8, "float16")
    rng = np.random.default_rng(5)
    store = pagedkv.open(tmp_path / "s", geom, pool_pages=4, spill_codec=codec)
    data = {}
    for seq in range(4):
        k = rng.standard_normal((2, 30, 2, 16)).astype(np.float16)
        store.create(seq)
        store.append(seq, k, k)
        data[seq] = k
    stats = store.stats()
    assert stats[f"codec_{codec}_pages"] > 0 and stats[f"codec_{codec}_bytes"] > 0
    for seq, k in data.items():
        out, _ = store.read(seq)
        if codec == "zstd":
            assert np.array_equal(out.view(np.uint16), k.view(np.uint16))
        else:
            assert np.abs(out.astype(np.float32) - k.astype(np.float32)).max() < 0.05
    assert store.check() == []
    store.close()
    store = pagedkv.open(tmp_path / "s")
    assert store.check() == []
    store.close()
