"""LMDB's errors translated into pagedkv's: a full disk or map, damage, or another I/O failure.

LMDB reports a short write as EIO, so the cause of a write that ended at a file
size limit or a full disk is recovered from the environment's files.
"""

from __future__ import annotations

import errno
import os
import resource
import struct

import lmdb

from ..errors import PagedKVError, StoreCorrupt, StoreFull, StoreIOError

__all__ = ["lmdb_error"]

_FULL = {errno.ENOSPC: "ENOSPC, disk full", errno.EFBIG: "EFBIG, file size limit",
         errno.EDQUOT: "EDQUOT, disk quota exceeded"}
_FULL_SLACK = 16 << 20  # free bytes below which a write that came up short met a full disk


def lmdb_error(exc: lmdb.Error, what: str, path: str | None = None) -> PagedKVError:
    """Translate an LMDB error into pagedkv's tree.

    Params:
        path: the environment's directory, when the error ended a write. LMDB
            turns a short write into EIO, dropping its cause: at RLIMIT_FSIZE
            or a full disk the kernel writes what fits and only the next write
            would fail with EFBIG or ENOSPC. The cause is recovered from
            data.mdb's size against the limit and the filesystem's free space.
    """
    text = str(exc)
    code = getattr(exc, "code", None)
    if code not in _FULL:
        code = next((known for known in _FULL if os.strerror(known) in text), code)
    if isinstance(exc, lmdb.MapFullError):
        return StoreFull(f"{what}: {text}")
    if code in _FULL:
        return StoreFull(f"{what}: {_FULL[code]}: {text}")
    if path is not None and (code == errno.EIO or os.strerror(errno.EIO) in text):
        cause = _short_write_cause(path)
        if cause is not None:
            return StoreFull(f"{what}: {cause} (LMDB reported its short write as {text!r})")
    if isinstance(exc, (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
                        lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadTxnError)):
        return StoreCorrupt(f"{what}: {text}")
    return StoreIOError(f"{what}: {text}")


def _short_write_cause(path: str) -> str | None:
    """Why a write to the LMDB environment at ``path`` came up short, if it was exhaustion."""
    data = os.path.join(path, "data.mdb")
    try:
        fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # store files are never links
        try:
            head = os.pread(fd, 44, 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        fs = os.statvfs(path)
    except OSError:
        return None
    psize = struct.unpack_from("<I", head, 40)[0] if len(head) == 44 else 0
    psize = psize if 512 <= psize <= 65536 else 65536
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    # The kernel cuts a write at the limit, so a file within a page of it cannot take the next.
    if limit != resource.RLIM_INFINITY and size + psize > limit:
        return f"EFBIG, file size limit: data.mdb is {size} bytes and RLIMIT_FSIZE is {limit}"
    # Root may write into the blocks reserved for it; anyone else only into those available.
    free = (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize
    if free < _FULL_SLACK:
        return f"ENOSPC, disk full: {free} bytes free on the filesystem of {path}"
    return None
