"""The single-writer lock: ``flock`` on ``<store>/LOCK`` with the holder's pid inside."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time

from ..errors import StoreLocked
from .files import FILE_MODE, file_id, io_error, open_file

log = logging.getLogger(__name__)


PROC_LOCKS = "/proc/locks"


def lock_holder(path: str) -> int | None:
    """Return the pid of a live writer holding ``path`` (a LOCK file), or None; writes nothing.

    The kernel's lock table is read rather than probed with a lock of our own, so
    asking never makes a starting writer fail.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None  # no writer locks anything else: WriterLock refuses it
    try:
        with open(PROC_LOCKS, encoding="ascii", errors="replace") as table:
            for line in table:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (a "->" marks a waiter)
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[2] != "->":
                    device, _, inode = fields[5].rpartition(":")
                    if inode.isdigit() and int(inode) == st.st_ino and _same_device(device, st.st_dev):
                        if fields[3] == "WRITE":
                            return _read_pid_at(path, st) or int(fields[4]) or -1
        return None
    except OSError:
        return _probe(path, st)


def _same_device(text: str, dev: int) -> bool:
    major, _, minor = text.partition(":")
    try:
        return (int(major, 16), int(minor, 16)) == (os.major(dev), os.minor(dev))
    except ValueError:
        return False


def _open_seen(path: str, seen: os.stat_result) -> int | None:
    """A read-only descriptor of ``path`` if it is still the regular file ``seen``, else None.

    Never blocks (a FIFO swapped in meanwhile is opened non-blocking, then refused).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
    except OSError:
        now = None
    if now is None or not stat.S_ISREG(now.st_mode) or file_id(now) != file_id(seen):
        os.close(fd)
        return None
    return fd


def _read_pid_at(path: str, seen: os.stat_result) -> int | None:
    fd = _open_seen(path, seen)
    if fd is None:
        return None
    try:
        return _read_pid(fd)
    finally:
        os.close(fd)


def _probe(path: str, seen: os.stat_result) -> int | None:
    """Fallback without /proc: a brief shared lock on a read-only fd."""
    fd = _open_seen(path, seen)
    if fd is None:
        return None
    try:
        try:
            # A shared probe on a read-only fd neither writes nor changes mtime.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


_ORPHAN_WAIT = 1.0  # seconds to wait for a dead holder's children to let go
_FIRST_POLL, _LAST_POLL = 0.001, 0.05  # seconds between polls of a held lock, doubling


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WriterLock:
    """An exclusive writer lock; released at once if the holder dies.

    LOCK is opened like every store file (``files.open_file``): a link, a FIFO or a
    file with a second name is refused before a byte of it is written.
    """

    def __init__(self, path: str, timeout: float | None = None) -> None:
        """Take the lock on ``path``, waiting up to ``timeout`` seconds for another writer to let go.

        Params:
            timeout: None or 0 fails at once if the lock is held; otherwise the
                lock is polled with a growing interval (1 ms up to 50 ms) until it
                is free or the time is up (``math.inf``: wait as long as it takes).
        Raises:
            StoreLocked (naming the holder's pid), StoreIOError.
        """
        fd = open_file(path, writable=True, create=True)
        try:
            os.fchmod(fd, FILE_MODE)
        except OSError as exc:
            os.close(fd)
            raise io_error(exc, f"cannot open lock file {path}") from None
        started = time.monotonic()
        orphan_deadline = started + _ORPHAN_WAIT
        give_up = started + timeout if timeout else started
        delay, waited = _FIRST_POLL, False
        store = os.path.dirname(path) or "."
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_pid(fd)
                now = time.monotonic()
                # A writer killed while a short-lived child of its own (the open-time
                # probe) still ran leaves the lock with that child for a moment.
                if holder and not _alive(holder) and now < orphan_deadline:
                    time.sleep(0.001)
                    continue
                who = f"pid {holder}" if holder else "another handle"
                if now < give_up:
                    if not waited:
                        log.info("%s: waiting up to %g s for the writer lock held by %s", store,
                                 timeout, who)
                        waited = True
                    # Polling, not a blocking flock: a blocked flock cannot be given a
                    # deadline without signals, which belong to the application.
                    time.sleep(min(delay, give_up - now))
                    delay = min(2 * delay, _LAST_POLL)
                    continue
                os.close(fd)
                after = f" after waiting {timeout:g} s" if timeout else ""
                raise StoreLocked(f"{store} is locked by a writer ({who}){after}") from None
        if waited:
            log.info("%s: took the writer lock after waiting %.3f s", store, time.monotonic() - started)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise io_error(exc, f"cannot write lock file {path}") from None
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the fd releases the flock
