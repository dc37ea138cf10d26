"""The page pool: ``pool.bin``, a checksummed header page plus fixed-size page slots, memory-mapped."""

from __future__ import annotations

import mmap
import os
import struct
import uuid as uuidlib

import numpy as np
import xxhash

from .. import faults
from .codec import FORMAT_VERSION
from ..errors import FormatVersionError, StoreCorrupt
from .files import create_private_file, fsync_dir, io_error, open_file
from .writeback import start_writeback
from ..geometry import DTYPES, Geometry

HEADER_NBYTES = 4096
MAGIC = b"PAGEDKV\x00"
# magic, version, uuid, layers, kv_heads, head_dim, page_size, dtype, pool_pages, page_nbytes
_HEADER = struct.Struct("<8sI16sIIII16sQQ")
_CSUM_AT = HEADER_NBYTES - 8
_GAP = 256 << 20  # clean bytes one msync may span to save a call


def pack_header(geom: Geometry, store_uuid: bytes, pool_pages: int) -> bytes:
    """The 4 KiB header page: fields, zero padding, then xxh3-64 of everything before it."""
    fields = _HEADER.pack(
        MAGIC, FORMAT_VERSION, store_uuid, geom.layers, geom.kv_heads, geom.head_dim,
        geom.page_size, geom.dtype.encode(), pool_pages, geom.page_nbytes,
    )
    body = fields.ljust(_CSUM_AT, b"\x00")
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def unpack_header(raw: bytes, path: str) -> tuple[Geometry, bytes, int]:
    """Validate a header page; return (geometry, uuid, pool_pages) or raise StoreCorrupt."""
    if len(raw) < HEADER_NBYTES:
        raise StoreCorrupt(f"{path}: header page truncated ({len(raw)} bytes)")
    if raw[:8] != MAGIC:
        raise StoreCorrupt(f"{path}: not a pagedkv pool file (bad magic)")
    body, (stored,) = raw[:_CSUM_AT], struct.unpack_from("<Q", raw, _CSUM_AT)
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise StoreCorrupt(f"{path}: header page checksum mismatch")
    (_, version, store_uuid, layers, kv_heads, head_dim, page_size, dtype_raw,
     pool_pages, page_nbytes) = _HEADER.unpack_from(raw, 0)
    if version > FORMAT_VERSION:
        raise FormatVersionError(f"{path}: format version {version}; this pagedkv reads up to {FORMAT_VERSION}")
    if version < 1 or any(body[_HEADER.size:]):
        raise StoreCorrupt(f"{path}: header page fields are invalid")
    dtype = dtype_raw.rstrip(b"\x00").decode("ascii", "replace")
    if dtype not in DTYPES:
        raise StoreCorrupt(f"{path}: header names unknown dtype {dtype!r}")
    try:
        geom = Geometry(layers, kv_heads, head_dim, page_size, dtype)
    except Exception as exc:
        raise StoreCorrupt(f"{path}: header geometry is invalid ({exc})") from None
    if geom.page_nbytes != page_nbytes or pool_pages < 1:
        raise StoreCorrupt(f"{path}: header sizes are inconsistent")
    return geom, store_uuid, pool_pages


class PagePool:
    """Fixed-size page slots in one memory-mapped file.

    ``array`` is an ndarray view ``(pool_pages, layers, 2, page_size, kv_heads,
    head_dim)`` over the file (numpy.memmap's mechanism, with the mmap kept so
    that dirty slot ranges can be flushed individually).
    """

    def __init__(self, path: str, fd: int, geom: Geometry, store_uuid: bytes, pool_pages: int,
                 writable: bool) -> None:
        self.path = path
        self.geom = geom
        self.uuid = store_uuid
        self.pool_pages = pool_pages
        self.writable = writable
        self._fd = fd
        size = HEADER_NBYTES + pool_pages * geom.page_nbytes
        try:
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        except OSError as exc:
            os.close(fd)
            raise io_error(exc, f"cannot map {path}") from None
        # frombuffer holds a buffer export, so closing the mmap while a caller still
        # has a view raises BufferError (handled in close) instead of unmapping it.
        self.array = np.frombuffer(self._mm, dtype=geom.np_dtype, offset=HEADER_NBYTES).reshape(
            (pool_pages, *geom.page_shape))
        # The slots as flat bytes: slot s is slot_bytes[s * page_nbytes:(s + 1) * page_nbytes].
        # A one-page restore copies a record's payload in with one slice assignment,
        # where building an ndarray over the record and indexing the pool cost more
        # than the copy.
        self.slot_bytes: memoryview = memoryview(self._mm)[HEADER_NBYTES:]
        self._flushing: list[tuple[int, int]] = []  # the ranges start_flush began, until finish_flush

    @classmethod
    def create(cls, path: str, geom: Geometry, pool_pages: int, store_uuid: bytes | None = None) -> PagePool:
        """Create ``pool.bin`` with its space reserved and its header durable."""
        store_uuid = store_uuid or uuidlib.uuid4().bytes
        size = HEADER_NBYTES + pool_pages * geom.page_nbytes
        fd = create_private_file(path, size)
        try:
            faults.io("flush")
            os.pwrite(fd, pack_header(geom, store_uuid, pool_pages), 0)
            os.fsync(fd)
            fsync_dir(os.path.dirname(path) or ".")
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise io_error(exc, f"cannot write {path}") from None
        return cls(path, fd, geom, store_uuid, pool_pages, writable=True)

    @classmethod
    def open(cls, path: str, writable: bool) -> PagePool:
        """Open an existing ``pool.bin``, validating its header and exact size before mapping.

        Everything is read from, and the mapping made of, the one descriptor that
        was checked to be a regular file of this user's: a name swapped meanwhile
        changes nothing.
        """
        fd = open_file(path, writable=writable)
        try:
            raw = os.pread(fd, HEADER_NBYTES, 0)
            geom, store_uuid, pool_pages = unpack_header(raw, path)
            expected = HEADER_NBYTES + pool_pages * geom.page_nbytes
            actual = os.fstat(fd).st_size
            if actual != expected:
                raise StoreCorrupt(f"{path}: file is {actual} bytes, its header implies {expected}")
        except OSError as exc:
            os.close(fd)
            raise io_error(exc, f"cannot read {path}") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, geom, store_uuid, pool_pages, writable)

    def flush_slots(self, slots: np.ndarray | list[int]) -> None:
        """msync the byte ranges of ``slots`` to stable storage (``start_flush`` then ``finish_flush``)."""
        self.start_flush(slots)
        self.finish_flush()

    def start_flush(self, slots: np.ndarray | list[int]) -> None:
        """Begin the flush of ``slots``: their ranges' writeback starts now, ``finish_flush`` syncs them.

        Work done in between (a commit builds its records) overlaps the disk
        writes (``writeback.start_writeback``); the slots must not be written
        again before ``finish_flush``. A flush begun and never finished (its
        caller failed) leaves nothing behind but writes the kernel would have made
        anyway, and the next ``start_flush`` replaces it. Runs of slots closer
        than ``_GAP`` bytes share one range: the kernel writes only the dirty
        pages of a range, while every msync waits for its own writeback, so a few
        wide calls beat hundreds of narrow ones.
        """
        self._flushing = ranges = self._runs(slots)
        for start, end in ranges:
            start_writeback(self._fd, start, end - start)

    def finish_flush(self) -> None:
        """msync the ranges ``start_flush`` began (the slots are durable when it returns)."""
        ranges, self._flushing = self._flushing, []
        for start, end in ranges:
            self._msync(start, end)

    def _runs(self, slots: np.ndarray | list[int]) -> list[tuple[int, int]]:
        """The byte ranges [start, end) of the file covering ``slots``, starts page-aligned."""
        if not len(slots):
            return []
        nbytes = self.geom.page_nbytes
        align = mmap.PAGESIZE
        order = np.unique(np.asarray(slots, dtype=np.int64))
        starts = HEADER_NBYTES + order * nbytes
        ends = starts + nbytes
        runs = []
        run_start, run_end = int(starts[0]) // align * align, int(ends[0])
        for start, end in zip(starts[1:].tolist(), ends[1:].tolist()):
            if start - run_end <= _GAP:
                run_end = end
                continue
            runs.append((run_start, run_end))
            run_start, run_end = start // align * align, end
        runs.append((run_start, run_end))
        return runs

    def _msync(self, start: int, end: int) -> None:
        try:
            faults.io("flush")
            self._mm.flush(start, end - start)
        except OSError as exc:
            raise io_error(exc, f"cannot flush {self.path}") from None
        faults.record_flush(self, start, end)

    def close(self) -> None:
        """Unmap and close (idempotent). Views of ``array`` must not be used afterwards."""
        if self._fd is None:
            return
        self.array = None  # type: ignore[assignment]
        self.slot_bytes.release()
        try:
            self._mm.close()
        except BufferError:
            # A caller still holds a view of store.pool; the mapping dies with it.
            pass
        os.close(self._fd)
        self._fd = None  # type: ignore[assignment]
