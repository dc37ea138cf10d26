"""Starting the writeback of a file range early, so that a later sync waits less.

A durable commit makes the pool's written slots durable (msync) before its LMDB
transaction, and it builds that transaction's records in Python first. Started
before the records are built, Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
hands the dirty pages of the range to the disk and returns without waiting;
the msync that follows the building then waits only for what is still in
flight. The msync stays what makes the pages durable: this only moves the start
of the work earlier, and where it is not available nothing changes.

(A thread that msyncs while the caller builds does not do this: CPython's
``mmap.flush`` holds the GIL, and a thread that releases it to call libc's
msync still needs the GIL to start, which a caller busy in Python keeps for up
to the interpreter's switch interval.)
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable

__all__ = ["available", "start_writeback"]

_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    # The running process's own symbols include libc's; ctypes.util.find_library would
    # run ldconfig in a subprocess at every import.
    for name in (None, "libc.so.6"):
        try:
            function = ctypes.CDLL(name, use_errno=True).sync_file_range
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    call: Callable[[int, int, int, int], int] = function
    return call


_SYNC_FILE_RANGE = _libc_sync_file_range()


def available() -> bool:
    """Whether writeback can be started early on this system."""
    return _SYNC_FILE_RANGE is not None


def start_writeback(fd: int, start: int, length: int) -> None:
    """Ask the kernel to begin writing the dirty pages of bytes [start, start + length) of ``fd``.

    Advisory: it returns without waiting, and a failure is not raised here. The
    sync that must follow (msync, fdatasync) reports the error of a write that
    failed, and makes the range durable whether or not this ran.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, start, length, _SYNC_FILE_RANGE_WRITE)
