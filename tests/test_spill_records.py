"""The spilled-page record (u32 length | msgpack header | payload), its checksums and the restore fast path.

Round trips, every header field wrong, length prefixes, msgpack bombs, checksums and
encoded payloads; then the restore fast path: a record recognised by its exact header
bytes, and run-wise checksums.
"""

from __future__ import annotations

import struct
import time
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import xxhash

from pagedkv import Geometry, PageCorrupt, PagedKVError
from pagedkv.storage.codec import RECORD_VERSION, decode_record, encode_record, page_checksum, record_layout
from pagedkv.pages.restore import fetch_record

from tests.kits.content import kv
from tests.kits.store import GEOM



UID = 1234
SEED = 0x5EED


def make_page(geom: Geometry = GEOM, salt: int = 1) -> np.ndarray:
    k, v = kv(salt, "page", 0, geom.page_size, geom)
    page = np.empty(geom.page_shape, geom.np_dtype)
    page[:, 0] = k
    page[:, 1] = v
    return page


def header_of(record: bytes | bytearray) -> dict:
    (hlen,) = struct.unpack_from("<I", record, 0)
    return msgpack.unpackb(bytes(record[4:4 + hlen]), raw=False)


def with_header(record: bytes | bytearray, header: object, packed: bytes | None = None) -> bytes:
    """``record`` with its header replaced (the payload kept)."""
    (hlen,) = struct.unpack_from("<I", record, 0)
    payload = bytes(record[4 + hlen:])
    blob = packed if packed is not None else msgpack.packb(header)
    return struct.pack("<I", len(blob)) + blob + payload


def good_record(geom: Geometry = GEOM, fill: int | None = None) -> tuple[bytearray, np.ndarray, int]:
    page = make_page(geom)
    fill = geom.page_size if fill is None else fill
    csum = page_checksum(page, fill, UID, SEED)
    return encode_record(geom, UID, fill, csum, page), page, csum


# -- round trip ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("fill", [0, 1, 3, 4])
def test_codec_record_round_trip(dtype: str, fill: int) -> None:
    geom = Geometry(2, 2, 4, 4, dtype)
    page = make_page(geom)
    csum = page_checksum(page, fill, UID, SEED)
    record = encode_record(geom, UID, fill, csum, page)
    header, out = decode_record(geom, bytes(record), UID)
    assert out.shape == geom.page_shape and out.dtype == geom.np_dtype
    assert out.tobytes() == page.tobytes()
    assert header["uid"] == UID and header["fill"] == fill and header["csum"] == csum
    assert header["v"] == RECORD_VERSION and header["codec"] == "raw"
    assert header["dtype"] == dtype and header["shape"] == list(geom.page_shape)
    assert header["nbytes"] == geom.page_nbytes == len(out.tobytes())
    assert len(record) == 4 + struct.unpack_from("<I", record)[0] + geom.page_nbytes
    # the checksum recomputed over the decoded payload matches
    assert page_checksum(out, fill, UID, SEED) == csum


def test_codec_decode_accepts_memoryview() -> None:
    record, page, _ = good_record()
    _, out = decode_record(GEOM, memoryview(bytes(record)), UID)
    assert out.tobytes() == page.tobytes()


# -- every header field wrong -------------------------------------------------------

BAD_FIELDS = [
    ("v", RECORD_VERSION + 1), ("v", 0), ("v", "1"), ("v", True), ("v", 1.0), ("v", None),
    ("uid", UID + 1), ("uid", -UID), ("uid", str(UID)), ("uid", float(UID)),
    ("dtype", "float16"), ("dtype", "float64"), ("dtype", b"float32"), ("dtype", 4), ("dtype", None),
    ("shape", [2, 2, 4, 2]), ("shape", [2, 2, 4, 2, 4, 1]), ("shape", [2, 2, 4, 2, 8]),
    ("shape", [2, 2, 4, 2, -4]), ("shape", [2, 2, 4, 2, 0]), ("shape", [2, 2, 4, 2, 4.0]),
    ("shape", [2, 2, 4, 2, True]), ("shape", "2,2,4,2,4"), ("shape", None), ("shape", {"a": 1}),
    ("shape", [4, 2, 4, 2, 2]),
    ("fill", -1), ("fill", GEOM.page_size + 1), ("fill", 1 << 40), ("fill", "4"), ("fill", 4.0),
    ("fill", None), ("fill", True),
    ("codec", "zstd"), ("codec", ""), ("codec", None), ("codec", 0), ("codec", ["raw"]),
    ("csum", -1), ("csum", -(1 << 63)), ("csum", "0"), ("csum", 1.5), ("csum", None),
    ("nbytes", GEOM.page_nbytes - 1), ("nbytes", GEOM.page_nbytes + 1), ("nbytes", 0),
    ("nbytes", -GEOM.page_nbytes), ("nbytes", str(GEOM.page_nbytes)), ("nbytes", None),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_codec_header_field_wrong_raises(field: str, value: object) -> None:
    record, _, _ = good_record()
    header = header_of(record)
    header[field] = value
    with pytest.raises(PageCorrupt) as info:
        decode_record(GEOM, with_header(record, header), UID)
    assert info.value.uid == UID


@pytest.mark.parametrize("field", ["v", "uid", "dtype", "shape", "fill", "codec", "csum", "nbytes"])
def test_codec_header_field_missing_raises(field: str) -> None:
    record, _, _ = good_record()
    header = header_of(record)
    del header[field]
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, with_header(record, header), UID)


def test_codec_header_extra_field_raises() -> None:
    record, _, _ = good_record()
    header = header_of(record)
    header["extra"] = 1
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, with_header(record, header), UID)


@pytest.mark.parametrize("header", [None, 1, "header", [], [1, 2], b"bytes", {}])
def test_codec_header_not_a_map_raises(header: object) -> None:
    record, _, _ = good_record()
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, with_header(record, header), UID)


def test_codec_record_of_another_geometry_raises() -> None:
    other = Geometry(2, 2, 4, 8, "float32")
    record, _, _ = good_record(other)
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, bytes(record), UID)


def test_codec_record_wrong_uid_raises() -> None:
    record, _, _ = good_record()
    with pytest.raises(PageCorrupt, match="belongs to page"):
        decode_record(GEOM, bytes(record), UID + 1)


# -- length prefix and payload length -----------------------------------------------


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 5, 20, -GEOM.page_nbytes, -1])
def test_codec_truncated_record_raises(cut: int) -> None:
    record, _, _ = good_record()
    value = bytes(record[:cut]) if cut >= 0 else bytes(record[:cut])
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, value, UID)


@pytest.mark.parametrize("extra", [1, 7, GEOM.page_nbytes])
def test_codec_extended_record_raises(extra: int) -> None:
    record, _, _ = good_record()
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, bytes(record) + b"\x00" * extra, UID)


@pytest.mark.parametrize("hlen", [0, 1 << 31, (1 << 32) - 1, 1025, 4096])
def test_codec_header_length_out_of_range_raises(hlen: int) -> None:
    record, _, _ = good_record()
    value = struct.pack("<I", hlen) + bytes(record[4:])
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, value, UID)


def test_codec_header_length_off_by_one_raises() -> None:
    record, _, _ = good_record()
    (hlen,) = struct.unpack_from("<I", record)
    for delta in (-1, 1):
        value = struct.pack("<I", hlen + delta) + bytes(record[4:])
        with pytest.raises(PageCorrupt):
            decode_record(GEOM, value, UID)


# -- msgpack bombs -----------------------------------------------------------------

BOMBS = {
    "array32_huge": b"\xdd\xff\xff\xff\xff",
    "map32_huge": b"\xdf\xff\xff\xff\xff",
    "str32_huge": b"\xdb\xff\xff\xff\xff",
    "bin32_huge": b"\xc6\xff\xff\xff\xff",
    "ext32_huge": b"\xc9\xff\xff\xff\xff\x01",
    "map_with_array32_value": b"\x81\xa1v\xdd\xff\xff\xff\xff",
    "deep_arrays": b"\x91" * 1000 + b"\xc0",
    "deep_maps": b"\x81\xa1a" * 300 + b"\xc0",
    "fixext": b"\xd4\x01\x00",
    "ext8": b"\xc7\x02\x05ab",
    "ext_timestamp": b"\xd6\xff\x00\x00\x00\x01",
    "int_key": msgpack.packb({1: 2}),
    "bytes_key": msgpack.packb({b"v": 1}),
    "nil_key": b"\x81\xc0\x01",
    "float_key": b"\x81\xca\x00\x00\x00\x00\x01",
    "array_key": b"\x81\x90\x01",
    "bad_utf8_key": b"\x81\xa2\xff\xfe\x01",
    "bad_utf8_value": b"\x81\xa1v\xa2\xff\xfe",
    "reserved_byte": b"\xc1",
    "truncated_map": b"\x88\xa1v",
    "trailing_bytes": msgpack.packb({"v": 1}) + b"\xc0",
    "many_small_keys": msgpack.packb({f"k{i}": i for i in range(65)}),
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_codec_msgpack_bomb_raises_quickly(name: str) -> None:
    record, _, _ = good_record()
    blob = BOMBS[name]
    if not blob:
        value = struct.pack("<I", 0) + bytes(record[4 + struct.unpack_from("<I", record)[0]:])
    else:
        value = with_header(record, None, packed=blob)
    started = time.perf_counter()
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, value, UID)
    assert time.perf_counter() - started < 0.05


def test_codec_header_bomb_padded_to_limit_raises_quickly() -> None:
    """A 1 KiB header of nothing but nested arrays (the most the length prefix allows)."""
    record, _, _ = good_record()
    blob = b"\x91" * 1023 + b"\xc0"
    started = time.perf_counter()
    with pytest.raises(PageCorrupt):
        decode_record(GEOM, with_header(record, None, packed=blob), UID)
    assert time.perf_counter() - started < 0.05


def test_codec_random_garbage_never_escapes_untyped(seed: int) -> None:
    """Random mutations of a valid record: either an exact decode or PageCorrupt, nothing else."""
    rng = np.random.default_rng(seed)
    record, page, _ = good_record()
    (hlen,) = struct.unpack_from("<I", record)
    base = bytes(record)
    for _ in range(2000):
        value = bytearray(base)
        kind = rng.integers(4)
        if kind == 0:  # flip bits in the length prefix or the header
            for _ in range(rng.integers(1, 4)):
                pos = int(rng.integers(4 + hlen))
                value[pos] ^= 1 << int(rng.integers(8))
        elif kind == 1:  # random header bytes of a random length
            n = int(rng.integers(1, 64))
            value = bytearray(struct.pack("<I", n) + rng.bytes(n) + base[4 + hlen:])
        elif kind == 2:  # truncate
            value = value[: int(rng.integers(len(value)))]
        else:  # extend
            value += rng.bytes(int(rng.integers(1, 64)))
        try:
            header, out = decode_record(GEOM, bytes(value), UID)
        except PageCorrupt:
            continue
        # It decoded: then the schema held; the payload is what the record carried.
        assert header["uid"] == UID and out.shape == GEOM.page_shape
        assert len(value) == 4 + struct.unpack_from("<I", value)[0] + GEOM.page_nbytes


# -- checksums ----------------------------------------------------------------------


def test_codec_checksum_deterministic() -> None:
    page = make_page()
    assert page_checksum(page, 3, UID, SEED) == page_checksum(page.copy(), 3, UID, SEED)
    assert 0 <= page_checksum(page, 3, UID, SEED) < 1 << 64


def test_codec_checksum_depends_on_uid_fill_seed() -> None:
    page = make_page()
    base = page_checksum(page, 4, UID, SEED)
    assert page_checksum(page, 4, UID + 1, SEED) != base
    assert page_checksum(page, 4, UID, SEED + 1) != base
    sums = {page_checksum(page, fill, UID, SEED) for fill in range(GEOM.page_size + 1)}
    assert len(sums) == GEOM.page_size + 1
    # fill 0 still binds uid and seed
    assert page_checksum(page, 0, UID, SEED) != page_checksum(page, 0, UID + 1, SEED)
    assert page_checksum(page, 0, UID, SEED) != page_checksum(page, 0, UID, SEED + 1)


def _covered_mask(geom: Geometry, fill: int) -> np.ndarray:
    """Per byte of a page: whether it belongs to one of its first ``fill`` tokens."""
    mask = np.zeros(geom.page_shape, bool)
    mask[:, :, :fill] = True
    return np.repeat(mask.reshape(-1), geom.itemsize)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fill", [1, 2, 4])
def test_codec_checksum_covers_exactly_fill_tokens(dtype: str, fill: int) -> None:
    geom = Geometry(2, 2, 4, 4, dtype)
    page = make_page(geom)
    base = page_checksum(page, fill, UID, SEED)
    covered = _covered_mask(geom, fill)
    flat = page.view(np.uint8).reshape(-1)
    for index in range(len(flat)):
        flat[index] ^= 0x01
        changed = page_checksum(page, fill, UID, SEED) != base
        flat[index] ^= 0x01
        assert changed == bool(covered[index]), (index, covered[index])
    assert page_checksum(page, fill, UID, SEED) == base


def test_codec_checksum_of_noncontiguous_view_matches_copy() -> None:
    big = np.stack([make_page(salt=1), make_page(salt=2)])
    view = big[1]
    assert page_checksum(view, 3, UID, SEED) == page_checksum(np.ascontiguousarray(view), 3, UID, SEED)


def test_codec_errors_are_pagedkv_errors() -> None:
    assert issubclass(PageCorrupt, PagedKVError)
    err = PageCorrupt("x", 5)
    assert err.uid == 5


# -- encoded payloads (zstd lossless, int8 lossy) -------------------------------------

from pagedkv.storage.codec import encode_spill  # noqa: E402
from pagedkv.storage.codecs import CODECS  # noqa: E402


def test_codec_known_codecs() -> None:
    assert set(CODECS) >= {"raw", "int8", "zstd"}


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("fill", [1, 3, 4])
def test_codec_zstd_round_trip_bit_exact(dtype: str, fill: int) -> None:
    geom = Geometry(2, 2, 4, 4, dtype)
    page = make_page(geom)  # raw random bits: NaNs, infinities, denormals
    record, used, decoded = encode_spill(geom, UID, fill, 0, page, codec="zstd", seed=SEED)
    assert used == "zstd" and decoded is None
    header, out = decode_record(geom, bytes(record), UID, seed=SEED)
    assert header["codec"] == "zstd" and header["fill"] == fill
    assert out[:, :, :fill].tobytes() == page[:, :, :fill].tobytes()
    assert page_checksum(out, fill, UID, SEED) == page_checksum(page, fill, UID, SEED)


def test_codec_int8_within_half_a_step() -> None:
    rng = np.random.default_rng(5)
    geom = Geometry(2, 2, 4, 4, "float32")
    page = (rng.standard_normal(geom.page_shape) * 3).astype(np.float32)
    fill = 3
    record, used, decoded = encode_spill(geom, UID, fill, 0, page, codec="int8", seed=SEED)
    assert used == "int8" and decoded is not None
    _, out = decode_record(geom, bytes(record), UID, seed=SEED)
    assert out.tobytes() == np.ascontiguousarray(decoded).tobytes()  # what the store keeps using
    filled = page[:, :, :fill]
    scale = np.abs(filled).max(axis=(2, 4), keepdims=True) / 127  # per (layer, K/V, head)
    err = np.abs(out[:, :, :fill] - filled)
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-7).all()
    assert len(record) < len(encode_record(geom, UID, fill, 0, page))


def test_codec_int8_falls_back_to_exact_for_nan() -> None:
    geom = Geometry(2, 2, 4, 4, "float32")
    page = np.ones(geom.page_shape, np.float32)
    page[1, 0, 2, 1, 3] = np.nan
    record, used, _ = encode_spill(geom, UID, 4, 0, page, codec="int8", seed=SEED)
    assert used != "int8"
    _, out = decode_record(geom, bytes(record), UID, seed=SEED)
    assert out.tobytes() == page.tobytes()


@pytest.mark.parametrize("codec", ["zstd", "int8"])
def test_codec_encoded_payload_flip_raises(codec: str) -> None:
    geom = Geometry(2, 2, 4, 4, "float32")
    page = np.linspace(-1, 1, int(np.prod(geom.page_shape)), dtype=np.float32).reshape(geom.page_shape)
    record, _, _ = encode_spill(geom, UID, 4, 0, page, codec=codec, seed=SEED)
    (hlen,) = struct.unpack_from("<I", record)
    start = 4 + hlen
    for index in range(start, len(record), max(1, (len(record) - start) // 50)):
        bad = bytearray(record)
        bad[index] ^= 0x20
        with pytest.raises(PageCorrupt):
            decode_record(geom, bytes(bad), UID, seed=SEED)
    with pytest.raises(PageCorrupt):  # and the seed (store) is part of the checksum
        decode_record(geom, bytes(record), UID, seed=SEED + 1)


@pytest.mark.parametrize("codec", ["zstd", "int8"])
def test_codec_encoded_truncated_or_extended_raises(codec: str) -> None:
    geom = Geometry(2, 2, 4, 4, "float32")
    page = np.linspace(-1, 1, int(np.prod(geom.page_shape)), dtype=np.float32).reshape(geom.page_shape)
    record, _, _ = encode_spill(geom, UID, 4, 0, page, codec=codec, seed=SEED)
    for value in (bytes(record[:-1]), bytes(record) + b"\x00", bytes(record[:len(record) // 2])):
        with pytest.raises(PageCorrupt):
            decode_record(geom, value, UID, seed=SEED)


# -- the restore fast path ---------------------------------------------------------------------------


FAST_UID = 77
BIG = Geometry(4, 4, 64, 16, "float16")  # runs of 512 B per token: the run-wise checksum path


def random_page(geom: Geometry, salt: int = 0) -> np.ndarray:
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
    page = random_page(geom)
    pool = np.stack([random_page(geom, 1), page])
    strided = pool.swapaxes(0, 1)[:, 1]  # the same page, not C-contiguous
    for fill in range(geom.page_size + 1):
        want = copied_checksum(page, fill, FAST_UID, SEED)
        assert page_checksum(page, fill, FAST_UID, SEED) == want
        assert page_checksum(strided, fill, FAST_UID, SEED) == want


@pytest.mark.parametrize("fill", [0, 5, 16])
def test_record_fast_path_restores_exact_record(fill: int) -> None:
    page = random_page(BIG)
    csum = page_checksum(page, fill, FAST_UID, SEED)
    record = bytes(encode_record(BIG, FAST_UID, fill, csum, page))
    assert record_layout(BIG).match_raw(memoryview(record), FAST_UID, fill, csum) is not None
    out, nbytes = fetch_record(fake_mgr(BIG), FakeTxn(record), FAST_UID, fill, csum)
    assert nbytes == len(record) and out.tobytes() == page.tobytes()


def test_record_fast_path_declines_other_records() -> None:
    page = random_page(BIG)
    csum = page_checksum(page, 16, FAST_UID, SEED)
    record = bytes(encode_record(BIG, FAST_UID, 16, csum, page))
    layout = record_layout(BIG)
    assert layout.match_raw(record, FAST_UID + 1, 16, csum) is None
    assert layout.match_raw(record, FAST_UID, 15, csum) is None
    assert layout.match_raw(record, FAST_UID, 16, csum ^ 1) is None
    assert layout.match_raw(record, FAST_UID, 17, csum) is None
    assert layout.match_raw(record[:-1], FAST_UID, 16, csum) is None
    assert layout.match_raw(record + b"\0", FAST_UID, 16, csum) is None


def test_record_other_encoding_takes_full_path() -> None:
    """A valid header packed differently (keys reordered) is still restored, by the full checks."""
    page = random_page(BIG)
    csum = page_checksum(page, 16, FAST_UID, SEED)
    header = {"nbytes": BIG.page_nbytes, "csum": csum, "codec": "raw", "fill": 16,
              "shape": list(BIG.page_shape), "dtype": BIG.dtype, "uid": FAST_UID, "v": 1}
    blob = msgpack.packb(header)
    record = struct.pack("<I", len(blob)) + blob + page.tobytes()
    assert record_layout(BIG).match_raw(record, FAST_UID, 16, csum) is None
    out, _ = fetch_record(fake_mgr(BIG), FakeTxn(record), FAST_UID, 16, csum)
    assert out.tobytes() == page.tobytes()


def test_record_fast_path_damage_is_page_corrupt() -> None:
    page = random_page(BIG)
    for fill in (7, 16):
        csum = page_checksum(page, fill, FAST_UID, SEED)
        record = bytearray(encode_record(BIG, FAST_UID, fill, csum, page))
        record[-BIG.page_nbytes] ^= 0x40  # the first payload byte: inside every fill's tokens
        with pytest.raises(PageCorrupt) as err:
            fetch_record(fake_mgr(BIG), FakeTxn(bytes(record)), FAST_UID, fill, csum)
        assert err.value.uid == FAST_UID
    with pytest.raises(PageCorrupt):
        fetch_record(fake_mgr(BIG), FakeTxn(None), FAST_UID, 16, 0)
    csum = page_checksum(page, 16, FAST_UID, SEED)
    record = bytes(encode_record(BIG, FAST_UID, 16, csum, page))
    with pytest.raises(PageCorrupt):  # the directory expects other content
        fetch_record(fake_mgr(BIG), FakeTxn(record), FAST_UID, 16, csum ^ 1)
    with pytest.raises(PageCorrupt):  # a truncated payload
        fetch_record(fake_mgr(BIG), FakeTxn(record[:-2]), FAST_UID, 16, csum)
