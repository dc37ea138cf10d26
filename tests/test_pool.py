"""pool.bin: the checksummed header page, exact sizing, mapping, flushing slot ranges."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import uuid

import numpy as np
import pytest

import pagedkv
from pagedkv import FormatVersionError, Geometry, PagedKVError, StoreCorrupt, faults
from pagedkv.storage import writeback
from pagedkv.storage.codec import FORMAT_VERSION
from pagedkv.storage.pool import HEADER_NBYTES, MAGIC, PagePool, pack_header, unpack_header

from tests.kits.content import kv
from tests.kits.store import GEOM



POOL_PAGES = 16


@pytest.fixture
def pool_path(tmp_path):
    path = str(tmp_path / "pool.bin")
    pool = PagePool.create(path, GEOM, POOL_PAGES, uuid.UUID(int=42).bytes)
    pool.close()
    return path


def test_pool_header_round_trip() -> None:
    store_uuid = uuid.uuid4().bytes
    for geom in (GEOM, Geometry(3, 5, 7, 16, "bfloat16"), pagedkv.PRESETS["llama-3-8b"]):
        raw = pack_header(geom, store_uuid, 1234)
        assert len(raw) == HEADER_NBYTES
        assert raw[:8] == MAGIC
        assert unpack_header(raw, "x") == (geom, store_uuid, 1234)


def test_pool_create_size_and_header(pool_path: str) -> None:
    assert os.path.getsize(pool_path) == HEADER_NBYTES + POOL_PAGES * GEOM.page_nbytes
    with open(pool_path, "rb") as f:
        geom, store_uuid, pages = unpack_header(f.read(HEADER_NBYTES), pool_path)
    assert (geom, store_uuid, pages) == (GEOM, uuid.UUID(int=42).bytes, POOL_PAGES)
    pool = PagePool.open(pool_path, writable=False)
    try:
        assert pool.array.shape == (POOL_PAGES, *GEOM.page_shape)
        assert pool.array.dtype == GEOM.np_dtype
        assert not pool.array.flags.writeable
    finally:
        pool.close()


def test_pool_create_refuses_existing_file(pool_path: str) -> None:
    with open(pool_path, "rb") as f:
        before = f.read()
    with pytest.raises(PagedKVError):
        PagePool.create(pool_path, GEOM, POOL_PAGES)
    with open(pool_path, "rb") as f:
        assert f.read() == before


def test_pool_every_header_byte_flipped_raises_store_corrupt(pool_path: str) -> None:
    """All 4096 header bytes, each xor 0xFF: StoreCorrupt at open, never a mapping."""
    with open(pool_path, "rb") as f:
        good = f.read(HEADER_NBYTES)
    fd = os.open(pool_path, os.O_RDWR)
    try:
        for index in range(HEADER_NBYTES):
            raw = bytearray(good)
            raw[index] ^= 0xFF
            with pytest.raises(StoreCorrupt):
                unpack_header(bytes(raw), pool_path)
            os.pwrite(fd, bytes(raw[index:index + 1]), index)
            with pytest.raises(StoreCorrupt):
                PagePool.open(pool_path, writable=False)
            os.pwrite(fd, good[index:index + 1], index)
    finally:
        os.close(fd)
    PagePool.open(pool_path, writable=True).close()  # restored: opens again


@pytest.mark.parametrize("bit", [0, 3, 7])
def test_pool_single_bit_flips_in_fields_raise(pool_path: str, bit: int) -> None:
    with open(pool_path, "rb") as f:
        good = f.read(HEADER_NBYTES)
    for index in range(64):  # every field byte
        raw = bytearray(good)
        raw[index] ^= 1 << bit
        with pytest.raises(StoreCorrupt):
            unpack_header(bytes(raw), pool_path)


def _resealed(fields: bytes) -> bytes:
    """A header page with valid checksum around arbitrary field bytes."""
    import xxhash

    body = fields.ljust(HEADER_NBYTES - 8, b"\x00")
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


_FIELDS = struct.Struct("<8sI16sIIII16sQQ")


def _fields(**over) -> bytes:
    values = dict(magic=MAGIC, version=1, uuid=b"u" * 16, layers=2, kv_heads=2, head_dim=4,
                  page_size=4, dtype=b"float32", pool_pages=16, page_nbytes=GEOM.page_nbytes)
    values.update(over)
    return _FIELDS.pack(*values.values())


def test_pool_resealed_header_validates_fields() -> None:
    assert unpack_header(_resealed(_fields()), "x")[0] == GEOM
    with pytest.raises(FormatVersionError):
        unpack_header(_resealed(_fields(version=FORMAT_VERSION + 1)), "x")
    for bad in (dict(version=0), dict(layers=0), dict(head_dim=1 << 21), dict(dtype=b"float64"),
                dict(dtype=b"\xff\xfe"), dict(pool_pages=0), dict(page_nbytes=GEOM.page_nbytes + 1)):
        with pytest.raises(StoreCorrupt):
            unpack_header(_resealed(_fields(**bad)), "x")
    # non-zero padding after the fields is damage too
    raw = bytearray(_fields().ljust(HEADER_NBYTES - 8, b"\x00"))
    raw[200] = 1
    with pytest.raises(StoreCorrupt):
        unpack_header(_resealed(bytes(raw)), "x")


@pytest.mark.parametrize("size", [0, 1, 8, HEADER_NBYTES - 1, HEADER_NBYTES,
                                  HEADER_NBYTES + GEOM.page_nbytes,
                                  "minus1", "plus1", "plus_page", "double"])
def test_pool_wrong_file_size_raises_store_corrupt(pool_path: str, size) -> None:
    full = os.path.getsize(pool_path)
    target = {"minus1": full - 1, "plus1": full + 1, "plus_page": full + GEOM.page_nbytes,
              "double": 2 * full}.get(size, size)
    os.truncate(pool_path, target)
    with pytest.raises(StoreCorrupt):
        PagePool.open(pool_path, writable=True)


def test_pool_truncated_header_raises() -> None:
    with pytest.raises(StoreCorrupt):
        unpack_header(b"PAGEDKV\x00", "x")


def test_pool_open_missing_file_is_typed(tmp_path) -> None:
    with pytest.raises(PagedKVError):
        PagePool.open(str(tmp_path / "nope.bin"), writable=False)


def test_pool_symlink_refused(tmp_path, pool_path: str) -> None:
    link = str(tmp_path / "link.bin")
    os.symlink(pool_path, link)
    with pytest.raises(PagedKVError):
        PagePool.open(link, writable=True)


def test_pool_writes_persist_through_reopen(pool_path: str) -> None:
    pool = PagePool.open(pool_path, writable=True)
    k, v = kv(3, "pool", 0, GEOM.page_size)
    pool.array[5, :, 0] = k
    pool.array[5, :, 1] = v
    pool.flush_slots([5])
    pool.close()
    pool = PagePool.open(pool_path, writable=False)
    try:
        assert pool.array[5, :, 0].tobytes() == k.tobytes()
        assert pool.array[5, :, 1].tobytes() == v.tobytes()
        assert not pool.array[4].any() and not pool.array[6].any()
    finally:
        pool.close()
    with open(pool_path, "rb") as f:  # the header page is untouched
        unpack_header(f.read(HEADER_NBYTES), pool_path)


@pytest.mark.parametrize("slots", [[0], [POOL_PAGES - 1], [3, 1, 2], [0, 15, 7, 7, 8],
                                   list(range(POOL_PAGES)), [9, 2]])
def test_pool_flush_slots_covers_every_slot(pool_path: str, slots: list[int]) -> None:
    ranges: list[tuple[int, int]] = []
    pool = PagePool.open(pool_path, writable=True)
    faults.set_flush_recorder(lambda target, start, end: ranges.append((start, end)))
    try:
        pool.array[slots] = 1.0
        pool.flush_slots(np.array(slots))
    finally:
        faults.set_flush_recorder(None)
        pool.close()
    assert ranges
    nbytes = GEOM.page_nbytes
    for start, end in ranges:
        assert start % mmap.PAGESIZE == 0, "msync offsets must be page aligned"
        assert 0 <= start < end <= HEADER_NBYTES + POOL_PAGES * nbytes
    for slot in set(slots):
        lo, hi = HEADER_NBYTES + slot * nbytes, HEADER_NBYTES + (slot + 1) * nbytes
        assert any(s <= lo and hi <= e for s, e in ranges), f"slot {slot} not flushed"
    # adjacent slots coalesce: never more msyncs than distinct slots
    assert len(ranges) <= len(set(slots))
    if sorted(set(slots)) == list(range(POOL_PAGES)):
        assert len(ranges) == 1


def test_pool_flush_slots_empty_is_noop(pool_path: str) -> None:
    ranges = []
    pool = PagePool.open(pool_path, writable=True)
    faults.set_flush_recorder(lambda *a: ranges.append(a))
    try:
        pool.flush_slots([])
        pool.flush_slots(np.empty(0, np.int64))
    finally:
        faults.set_flush_recorder(None)
        pool.close()
    assert ranges == []


def test_pool_flush_failure_is_typed(pool_path: str) -> None:
    def fail(op: str) -> None:
        if op == "flush":
            raise OSError(5, "injected EIO")

    pool = PagePool.open(pool_path, writable=True)
    faults.set_injector(fail)
    try:
        with pytest.raises(PagedKVError):
            pool.flush_slots([1])
    finally:
        faults.set_injector(None)
        pool.close()


def test_pool_close_idempotent(pool_path: str) -> None:
    pool = PagePool.open(pool_path, writable=True)
    view = pool.array  # a caller's view must not make close() raise
    pool.close()
    pool.close()
    assert pool.array is None
    del view


def test_pool_store_header_byte_flipped_refuses_open(stores) -> None:
    """Through the public API: a damaged pool.bin header is StoreCorrupt, and fixing it heals."""
    store = stores.open(pool_pages=4)
    store.create("a")
    k, v = kv(1, "a", 0, 5)
    store.append("a", k, v)
    store.close()
    path = os.path.join(store.path, "pool.bin")
    fd = os.open(path, os.O_RDWR)
    try:
        for index in (0, 9, 20, 40, 60, 1000, HEADER_NBYTES - 1):
            old = os.pread(fd, 1, index)
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), index)
            with pytest.raises(StoreCorrupt):
                pagedkv.open(store.path)
            os.pwrite(fd, old, index)
    finally:
        os.close(fd)
    store = stores.open(geom=None, pool_pages=None)
    assert store.read("a")[0].tobytes() == k.tobytes()
    assert store.check() == []


def test_pool_create_fallocate_failure_is_typed(tmp_path) -> None:
    def fail(op: str) -> None:
        if op == "fallocate":
            raise OSError(28, "injected ENOSPC")

    path = str(tmp_path / "pool.bin")
    faults.set_injector(fail)
    try:
        with pytest.raises(PagedKVError):
            PagePool.create(path, GEOM, POOL_PAGES)
    finally:
        faults.set_injector(None)
    assert not os.path.exists(path)


def test_start_flush_syncs_nothing_until_finish_flush(pool_path: str) -> None:
    """The flush's msyncs (what makes the slots durable) run in ``finish_flush``, over the same
    ranges as ``flush_slots``; a flush begun and not finished is replaced by the next one."""
    ranges: list[tuple[int, int]] = []
    pool = PagePool.open(pool_path, writable=True)
    faults.set_flush_recorder(lambda target, start, end: ranges.append((start, end)))
    try:
        pool.array[[2, 3, 9]] = 1.0
        pool.flush_slots([2, 3, 9])
        whole = list(ranges)
        ranges.clear()
        pool.array[[2, 3, 9]] = 2.0
        pool.start_flush([12])  # abandoned: its caller failed before finishing it
        pool.start_flush([2, 3, 9])
        assert ranges == []
        pool.finish_flush()
        assert ranges == whole
        pool.finish_flush()  # nothing begun: nothing to do
        assert ranges == whole
    finally:
        faults.set_flush_recorder(None)
        pool.close()


def test_finish_flush_failure_is_typed(pool_path: str) -> None:
    def fail(op: str) -> None:
        if op == "flush":
            raise OSError(5, "injected EIO")

    pool = PagePool.open(pool_path, writable=True)
    pool.array[1] = 1.0
    faults.set_injector(fail)
    try:
        pool.start_flush([1])
        with pytest.raises(PagedKVError, match="injected EIO"):
            pool.finish_flush()
    finally:
        faults.set_injector(None)
        pool.close()


@pytest.mark.skipif(not writeback.available(), reason="sync_file_range is Linux's")
def test_writeback_binding_reaches_the_system_call(pool_path: str) -> None:
    """The ctypes binding passes its arguments through: a valid range is accepted, no
    descriptor is refused with EBADF (what a wrong signature would not give)."""
    call = writeback._SYNC_FILE_RANGE
    assert call is not None
    fd = os.open(pool_path, os.O_RDWR)
    try:
        assert call(fd, 0, HEADER_NBYTES, 2) == 0
        writeback.start_writeback(fd, 0, HEADER_NBYTES)
    finally:
        os.close(fd)
    assert call(-1, 0, HEADER_NBYTES, 2) == -1 and ctypes.get_errno() == errno.EBADF
    writeback.start_writeback(-1, 0, HEADER_NBYTES)  # advisory: the sync that follows reports errors
