"""The restore fast path: a record recognised by its exact header bytes, and run-wise checksums."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import xxhash

from pagedkv import Geometry, PageCorrupt
from pagedkv.storage.codec import encode_record, page_checksum, record_layout
from pagedkv.pages.restore import fetch_record

UID = 77
SEED = 0x5EED
BIG = Geometry(4, 4, 64, 16, "float16")  # runs of 512 B per token: the run-wise checksum path


def make_page(geom: Geometry, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(salt)
    return rng.standard_normal(geom.page_shape).astype(geom.np_dtype)


def copied_checksum(page: np.ndarray, fill: int, uid: int, seed: int) -> int:
    """The checksum's definition: xxh3 of (uid, fill) then the first ``fill`` tokens, copied out."""
    hasher = xxhash.xxh3_64(seed=seed)
    hasher.update(struct.pack("<QI", uid, fill))
    if fill:
        hasher.update(np.ascontiguousarray(page[:, :, :fill]).view(np.uint8))
    return hasher.intdigest()


class FakeTxn:
    def __init__(self, value: bytes | None) -> None:
        self.value = value

    def get(self, key: bytes, db: object = None) -> memoryview | None:
        return None if self.value is None else memoryview(self.value)


def fake_mgr(geom: Geometry) -> SimpleNamespace:
    return SimpleNamespace(geom=geom, seed=SEED, spill=SimpleNamespace(pages=None))


@pytest.mark.parametrize("uid", [0, 1, 127, 128, 65535, 65536, 1 << 32, (1 << 64) - 1])
@pytest.mark.parametrize("csum", [0, 200, 1 << 40, (1 << 64) - 1])
def test_record_prefix_is_the_format_header(uid: int, csum: int) -> None:
    for codec, nbytes in (("raw", BIG.page_nbytes), ("zstd", 1234)):
        header = msgpack.packb({"v": 1, "uid": uid, "dtype": BIG.dtype, "shape": list(BIG.page_shape),
                                "fill": 9, "codec": codec, "csum": csum, "nbytes": nbytes})
        assert record_layout(BIG).prefix(uid, 9, codec, csum, nbytes) == struct.pack("<I", len(header)) + header


@pytest.mark.parametrize("geom", [BIG, Geometry(2, 8, 128, 16, "bfloat16"), Geometry(3, 2, 4, 5, "float32")])
def test_record_page_checksum_runs_match_definition(geom: Geometry) -> None:
    page = make_page(geom)
    pool = np.stack([make_page(geom, 1), page])
    strided = pool.swapaxes(0, 1)[:, 1]  # the same page, not C-contiguous
    for fill in range(geom.page_size + 1):
        want = copied_checksum(page, fill, UID, SEED)
        assert page_checksum(page, fill, UID, SEED) == want
        assert page_checksum(strided, fill, UID, SEED) == want


@pytest.mark.parametrize("fill", [0, 5, 16])
def test_record_fast_path_restores_exact_record(fill: int) -> None:
    page = make_page(BIG)
    csum = page_checksum(page, fill, UID, SEED)
    record = bytes(encode_record(BIG, UID, fill, csum, page))
    assert record_layout(BIG).match_raw(memoryview(record), UID, fill, csum) is not None
    out, nbytes = fetch_record(fake_mgr(BIG), FakeTxn(record), UID, fill, csum)
    assert nbytes == len(record) and out.tobytes() == page.tobytes()


def test_record_fast_path_declines_other_records() -> None:
    page = make_page(BIG)
    csum = page_checksum(page, 16, UID, SEED)
    record = bytes(encode_record(BIG, UID, 16, csum, page))
    layout = record_layout(BIG)
    assert layout.match_raw(record, UID + 1, 16, csum) is None
    assert layout.match_raw(record, UID, 15, csum) is None
    assert layout.match_raw(record, UID, 16, csum ^ 1) is None
    assert layout.match_raw(record, UID, 17, csum) is None
    assert layout.match_raw(record[:-1], UID, 16, csum) is None
    assert layout.match_raw(record + b"\0", UID, 16, csum) is None


def test_record_other_encoding_takes_full_path() -> None:
    """A valid header packed differently (keys reordered) is still restored, by the full checks."""
    page = make_page(BIG)
    csum = page_checksum(page, 16, UID, SEED)
    header = {"nbytes": BIG.page_nbytes, "csum": csum, "codec": "raw", "fill": 16,
              "shape": list(BIG.page_shape), "dtype": BIG.dtype, "uid": UID, "v": 1}
    blob = msgpack.packb(header)
    record = struct.pack("<I", len(blob)) + blob + page.tobytes()
    assert record_layout(BIG).match_raw(record, UID, 16, csum) is None
    out, _ = fetch_record(fake_mgr(BIG), FakeTxn(record), UID, 16, csum)
    assert out.tobytes() == page.tobytes()


def test_record_fast_path_damage_is_page_corrupt() -> None:
    page = make_page(BIG)
    for fill in (7, 16):
        csum = page_checksum(page, fill, UID, SEED)
        record = bytearray(encode_record(BIG, UID, fill, csum, page))
        record[-BIG.page_nbytes] ^= 0x40  # the first payload byte: inside every fill's tokens
        with pytest.raises(PageCorrupt) as err:
            fetch_record(fake_mgr(BIG), FakeTxn(bytes(record)), UID, fill, csum)
        assert err.value.uid == UID
    with pytest.raises(PageCorrupt):
        fetch_record(fake_mgr(BIG), FakeTxn(None), UID, 16, 0)
    csum = page_checksum(page, 16, UID, SEED)
    record = bytes(encode_record(BIG, UID, 16, csum, page))
    with pytest.raises(PageCorrupt):  # the directory expects other content
        fetch_record(fake_mgr(BIG), FakeTxn(record), UID, 16, csum ^ 1)
    with pytest.raises(PageCorrupt):  # a truncated payload
        fetch_record(fake_mgr(BIG), FakeTxn(record[:-2]), UID, 16, csum)
