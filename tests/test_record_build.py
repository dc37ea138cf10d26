"""Raw spill records built from a page's flat bytes, and the run-wise checksum of those bytes.

``runs_checksum`` is what a restore checks a slot with and what an eviction hashes
its copy of a slot with; ``RecordLayout.raw_record`` builds the record an eviction
writes. Both must give exactly what ``page_checksum`` and ``encode_spill`` define.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from pagedkv import Geometry
from pagedkv.storage.codec import decode_record, encode_spill, page_checksum, record_layout, runs_checksum

SEED = 0x5EED
GEOMS = [Geometry(4, 4, 64, 16, "float16"), Geometry(2, 8, 128, 16, "bfloat16"), Geometry(3, 2, 4, 5, "float32"),
         Geometry(1, 1, 2, 4, "float16")]


def random_page(geom: Geometry, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(geom.page_shape).astype(geom.np_dtype)


def definition(page: np.ndarray, fill: int, uid: int) -> int:
    """The checksum as the format defines it: xxh3 of (uid, fill), then the first ``fill`` tokens copied out."""
    hasher = xxhash.xxh3_64(seed=SEED)
    hasher.update(struct.pack("<QI", uid, fill))
    hasher.update(np.ascontiguousarray(page[:, :, :fill]).view(np.uint8).tobytes())
    return hasher.intdigest()


def flat(page: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(page).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("geom", GEOMS, ids=lambda geom: f"{geom.page_nbytes}B-{geom.dtype}")
def test_runs_checksum_is_the_page_checksum(geom: Geometry) -> None:
    seed = 11
    print(f"seed {seed}")
    page = random_page(geom, seed)
    runs = geom.layers * 2
    for fill in range(geom.page_size + 1):
        want = definition(page, fill, 99)
        assert runs_checksum(flat(page), fill, geom.page_size, runs, 99, SEED) == want, fill
        assert runs_checksum(bytes(flat(page)), fill, geom.page_size, runs, 99, SEED) == want, fill
        assert page_checksum(page, fill, 99, SEED) == want, fill


@pytest.mark.parametrize("geom", GEOMS, ids=lambda geom: f"{geom.page_nbytes}B-{geom.dtype}")
@pytest.mark.parametrize("uid", [0, 200, 1 << 40])
def test_raw_record_is_the_encoded_record(geom: Geometry, uid: int) -> None:
    seed = 12
    print(f"seed {seed}")
    page = random_page(geom, seed)
    layout = record_layout(geom)
    for fill in (0, 1, geom.page_size - 1, geom.page_size):
        want = definition(page, fill, uid)
        encoded = encode_spill(geom, uid, fill, want, page)[0]
        # Unknown checksum: computed from the copy, and the record is the one encode_spill writes with it.
        built, csum = layout.raw_record(uid, fill, flat(page), None, SEED)
        assert csum == want and built == encoded
        # A given checksum is carried as it is, even one that is not the page's.
        other, carried = layout.raw_record(uid, fill, flat(page), 5, SEED)
        assert carried == 5 and other == encode_spill(geom, uid, fill, 5, page)[0]
        header, back = decode_record(geom, built, uid)
        assert header["csum"] == want and header["fill"] == fill and back.tobytes() == page.tobytes()


def test_raw_record_flips_follow_the_fill() -> None:
    geom = GEOMS[0]
    page = random_page(geom, 13)
    layout = record_layout(geom)
    body = bytearray(flat(page))
    base = layout.raw_record(7, 9, memoryview(body), None, SEED)[1]
    stride = geom.page_nbytes // (geom.layers * 2)
    token = stride // geom.page_size
    for offset, covered in ((0, True), (9 * token - 1, True), (9 * token, False), (stride + 3, True)):
        body[offset] ^= 0x40
        changed = layout.raw_record(7, 9, memoryview(body), None, SEED)[1] != base
        body[offset] ^= 0x40
        assert changed == covered, offset
