"""Private files and directories: 0700/0600 whatever the umask, no symlinks followed."""

from __future__ import annotations

import errno
import os

from . import faults
from .errors import PagedKVError, StoreFull, StoreIOError

DIR_MODE = 0o700
FILE_MODE = 0o600


def io_error(exc: OSError, what: str) -> PagedKVError:
    """Translate an OSError into the typed error a caller should see."""
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return StoreFull(f"{what}: {os.strerror(exc.errno)}")
    return StoreIOError(f"{what}: {exc.strerror or exc}")


def refuse_symlink(path: str) -> None:
    """Raise if ``path`` is a symbolic link: store files are never followed through links."""
    if os.path.islink(path):
        raise PagedKVError(f"{path} is a symbolic link; pagedkv refuses linked store files")


def make_private_dir(path: str) -> None:
    """Create ``path`` (and parents) with mode 0700, or tighten an existing one."""
    refuse_symlink(path)
    try:
        # os.makedirs applies the mode only to the last level; create each one ourselves.
        missing = []
        level = os.path.abspath(path)
        while not os.path.isdir(level):
            missing.append(level)
            level = os.path.dirname(level)
        for level in reversed(missing):
            try:
                os.mkdir(level, DIR_MODE)
            except FileExistsError:
                pass
            os.chmod(level, DIR_MODE)
        os.chmod(path, DIR_MODE)
    except OSError as exc:
        raise io_error(exc, f"cannot create directory {path}") from None


def create_private_file(path: str, nbytes: int) -> int:
    """Create a new 0600 file of ``nbytes`` (space reserved) and return its fd."""
    refuse_symlink(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        raise io_error(exc, f"cannot create {path}") from None
    try:
        os.fchmod(fd, FILE_MODE)
        if nbytes:
            faults.io("fallocate")
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise io_error(exc, f"cannot reserve {nbytes} bytes for {path}") from None
    return fd


def open_existing(path: str, writable: bool) -> int:
    """Open an existing store file without following a symlink."""
    refuse_symlink(path)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags)
    except OSError as exc:
        raise io_error(exc, f"cannot open {path}") from None


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (a new file's name survives power loss)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tighten_tree(path: str) -> None:
    """Set 0700 on directories and 0600 on files under ``path`` (LMDB creates its own)."""
    for root, dirs, names in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), DIR_MODE, follow_symlinks=False)
        for name in names:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, FILE_MODE)


MOUNTINFO = "/proc/self/mountinfo"  # a module attribute so tests can point it at a fake table
REMOTE_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "afs", "ceph", "glusterfs")


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (longest mount point prefix), if known."""
    target = os.path.realpath(path)
    best, best_type = "", None
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as table:
            for line in table:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].encode().decode("unicode_escape")
                prefix = mount.rstrip("/") + "/"
                if (target == mount or target.startswith(prefix) or mount == "/") and len(mount) >= len(best):
                    best, best_type = mount, right.split()[0]
    except OSError:
        return None
    return best_type


def refuse_remote(path: str, allow_remote: bool) -> None:
    """Refuse a network filesystem: LMDB's locks and mmap coherence do not hold there."""
    if allow_remote:
        return
    fstype = filesystem_type(path)
    if fstype in REMOTE_FS:
        raise PagedKVError(f"{path} is on a {fstype} filesystem; pagedkv needs a local one "
                           "(pass allow_remote=True to override)")


def disk_usage(path: str) -> int:
    """Bytes allocated on disk under ``path``, as ``du`` counts them (sparse files: what they use)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
