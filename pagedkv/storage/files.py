"""Store files and directories: private modes whatever the umask, opened by descriptor.

What pagedkv trusts is the store directory and its owner; what lies in it is
checked where it is opened: every store file is opened without following a link
and without blocking (a FIFO would hang an open), and the descriptor, not the
name, must be a regular file owned by this user (with one link, when written).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from typing import Callable, TypeVar

from .. import faults
from ..errors import PagedKVError, StoreCorrupt, StoreFull, StoreIOError

DIR_MODE = 0o700
FILE_MODE = 0o600
T = TypeVar("T")
FileId = tuple[int, int]  # (st_dev, st_ino): which file, whatever its name

# One opening of store files at a time in this process: ``watch_opens`` names the
# files an opener left open by what appeared meanwhile, and a store opening in
# another thread must not be among them.
OPENING = threading.RLock()


def _fresh_opening_lock() -> None:
    # A child forked while another thread held the lock would wait for it forever.
    global OPENING
    OPENING = threading.RLock()


os.register_at_fork(after_in_child=_fresh_opening_lock)

_KINDS = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
_NOT_REGULAR = (errno.ENXIO, errno.EISDIR, errno.ENOTDIR, errno.EOPNOTSUPP)


def io_error(exc: OSError, what: str) -> PagedKVError:
    """Translate an OSError into the typed error a caller should see."""
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        name = errno.errorcode[exc.errno]
        cause = {"ENOSPC": "disk full", "EFBIG": "file size limit", "EDQUOT": "disk quota"}[name]
        return StoreFull(f"{what}: {name}, {cause} ({os.strerror(exc.errno)})")
    return StoreIOError(f"{what}: {exc.strerror or exc}")


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words ("regular file", "FIFO", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "regular file" if stat.S_ISREG(mode) else "special file")


def file_id(st: os.stat_result) -> FileId:
    """The identity of a file: its device and inode."""
    return st.st_dev, st.st_ino


def _target(path: str, dir_fd: int | None, name: str | None) -> str:
    """The name an os call is given: ``name`` when it is looked up in ``dir_fd``, else ``path``."""
    if dir_fd is None:
        return path
    if name is None:
        raise TypeError("a dir_fd needs the name to look up in it")
    return name


def lookup(path: str, dir_fd: int | None = None, name: str | None = None) -> os.stat_result | None:
    """``lstat`` of ``path`` (or of ``name`` in ``dir_fd``), None if it does not exist; errors typed."""
    try:
        return os.stat(_target(path, dir_fd, name), dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise io_error(exc, f"cannot look at {path}") from None


def refuse_untrusted(path: str, st: os.stat_result, writable: bool) -> None:
    """Raise ``StoreCorrupt`` unless ``st`` is a regular file of this user's (with one link if written).

    A second link means another name, perhaps outside the store, for the bytes a
    writer would change.
    """
    if not stat.S_ISREG(st.st_mode):
        what = file_kind(st.st_mode)
        if what == "symbolic link":
            raise StoreCorrupt(f"{path} is a symbolic link; pagedkv refuses linked store files")
        raise StoreCorrupt(f"{path} is a {what}, not a regular file; refused")
    if st.st_uid != os.geteuid():
        raise StoreCorrupt(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); refused")
    if writable and st.st_nlink != 1:
        raise StoreCorrupt(f"{path} has {st.st_nlink} hard links (another name may lie outside the store); "
                           "refused")


def refuse_symlink(path: str) -> None:
    """Raise if ``path`` is a symbolic link: store files are never followed through links."""
    st = lookup(path)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise StoreCorrupt(f"{path} is a symbolic link; pagedkv refuses linked store files")


def open_file(path: str, *, writable: bool, create: bool = False, dir_fd: int | None = None,
              name: str | None = None) -> int:
    """Open a store file and return its descriptor, checked as opened: regular, ours, one link if written.

    ``path`` names the file in messages and is opened unless ``dir_fd`` is given, then
    ``name`` is opened in that directory. No link is followed, the open never blocks
    (O_NONBLOCK, cleared once the descriptor is known to be a regular file), and a
    name already known to be something else is refused before it is opened at all.
    ``create`` makes a missing file (mode 0600).
    """
    target = _target(path, dir_fd, name)
    seen = lookup(path, dir_fd, name)
    if seen is not None:
        refuse_untrusted(path, seen, writable)
    flags = ((os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
             | os.O_CLOEXEC | (os.O_CREAT if create else 0))
    try:
        with OPENING:
            fd = os.open(target, flags, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreCorrupt(f"{path} is a symbolic link; pagedkv refuses linked store files") from None
        if exc.errno in _NOT_REGULAR:
            raise StoreCorrupt(f"{path} is not a regular file; refused") from None
        raise io_error(exc, f"cannot open {path}") from None
    try:
        refuse_untrusted(path, os.fstat(fd), writable)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as exc:
        os.close(fd)
        raise io_error(exc, f"cannot open {path}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(path: str) -> int:
    """Open a store directory without following a link; it must be a directory of this user's."""
    seen = lookup(path)
    if seen is not None and stat.S_ISLNK(seen.st_mode):
        raise PagedKVError(f"{path} is a symbolic link; refused")
    if seen is not None and not stat.S_ISDIR(seen.st_mode):
        raise StoreCorrupt(f"{path} is a {file_kind(seen.st_mode)}, not a directory; refused")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StoreCorrupt(f"{path} is not a directory (or is a link to one); refused") from None
        raise io_error(exc, f"cannot open directory {path}") from None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise io_error(exc, f"cannot open directory {path}") from None
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise StoreCorrupt(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                           "refused")
    return fd


def list_dir(path: str) -> list[str]:
    """The entries of a directory; an unreadable one is a typed error naming it."""
    try:
        return os.listdir(path)
    except OSError as exc:
        raise io_error(exc, f"{path}: cannot list directory") from None


def make_private_dir(path: str) -> None:
    """Create ``path`` (and parents) with mode 0700, or tighten an existing one of this user's."""
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
            _tighten_dir(level)
        _tighten_dir(path)
    except OSError as exc:
        raise io_error(exc, f"cannot create directory {path}") from None


def _tighten_dir(path: str) -> None:
    fd = open_dir(path)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def create_private_file(path: str, nbytes: int) -> int:
    """Create a new 0600 file of ``nbytes`` (space reserved) and return its fd."""
    refuse_symlink(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with OPENING:
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


def tighten_tree(path: str) -> None:
    """Set 0700 on directories and 0600 on regular files under ``path`` (LMDB creates its own).

    Links and other kinds are left alone, and no file is opened: closing any
    descriptor of lock.mdb would drop the POSIX locks LMDB holds on it.
    """
    try:
        for _, _, names, dir_fd in os.fwalk(path, follow_symlinks=False):
            os.fchmod(dir_fd, DIR_MODE)
            for name in names:
                if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    os.chmod(name, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        raise io_error(exc, f"cannot tighten the modes under {path}") from None


def tighten_opened(dir_fd: int, name: str, ident: FileId, opened: dict[int, FileId] | None) -> None:
    """chmod 0600 the file ``name`` in ``dir_fd``, through a descriptor already open on it if any.

    The /proc link of a held descriptor reaches that very file, whatever its name
    leads to now, without opening it (see ``tighten_tree``).
    """
    held = [fd for fd, seen in (opened or {}).items() if seen == ident]
    target = fd_path(held[0]) if held else None
    try:
        if target is not None:
            os.chmod(target, FILE_MODE)
        else:
            os.chmod(name, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        raise io_error(exc, f"cannot set the mode of {name}") from None


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (a new file's name survives power loss)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise io_error(exc, f"cannot sync directory {path}") from None


def fd_path(fd: int) -> str | None:
    """A path that opens exactly the file behind ``fd`` (its /proc link), whatever its name is now."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


def descriptors() -> dict[int, FileId] | None:
    """The regular files this process has open, by descriptor (None where /proc is not mounted)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    out = {}
    for name in names:
        try:
            st = os.stat(f"/proc/self/fd/{name}")  # the file the descriptor holds, not a name
        except OSError:
            continue  # the listing's own descriptor, or one closed meanwhile
        if stat.S_ISREG(st.st_mode):
            out[int(name)] = file_id(st)
    return out


def watch_opens(opener: Callable[[], T]) -> tuple[T, dict[int, FileId] | None]:
    """Run ``opener``; return its result and the regular files it left open (None without /proc).

    Descriptors are compared by number and file, so one closed and reused meanwhile
    counts as opened.
    """
    with OPENING:
        before = descriptors()
        result = opener()
        after = descriptors()
    if before is None or after is None:
        return result, None
    return result, {fd: ident for fd, ident in after.items() if before.get(fd) != ident}


def opened_problem(directory: str, dir_fd: int, checked: dict[str, os.stat_result],
                   opened: dict[int, FileId] | None) -> tuple[str | None, bool]:
    """Whether what an opener (LMDB) opened by name under ``directory`` is what was checked.

    ``checked`` maps each entry the opener had to open to the stat it was checked
    with; ``opened`` is ``watch_opens``'s answer. Returns (None, False) when every
    file the opener left open is a checked one and every name still leads there;
    else (what differs, certain). Certain: a checked file is not among the opened
    ones, or a name or the directory changed: they led the opener elsewhere.
    Uncertain: only other files appeared too, which another thread may have opened.
    """
    held = os.fstat(dir_fd)
    now = lookup(directory)
    if now is None or file_id(now) != file_id(held):
        return f"{directory} was replaced while its files were being opened; refused", True
    for name, st in checked.items():
        now = lookup(os.path.join(directory, name), dir_fd, name)
        if now is None or file_id(now) != file_id(st) or not stat.S_ISREG(now.st_mode):
            return f"{os.path.join(directory, name)} was replaced while it was being opened; refused", True
    if opened is None:
        return None, False
    for name, st in checked.items():
        if file_id(st) not in opened.values():
            return (f"{os.path.join(directory, name)} led LMDB to another file than the one checked "
                    "(its name was swapped); refused"), True
    wanted = {file_id(st) for st in checked.values()}
    extra = sorted(fd for fd, ident in opened.items() if ident not in wanted)
    if extra:
        return (f"opening {directory} left {len(extra)} unexpected files open "
                "(a name swapped while LMDB opened it, or another thread's files); refused"), False
    return None, False


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
    try:
        for root, _, names in os.walk(path):
            for name in names:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    except OSError as exc:
        raise io_error(exc, f"cannot measure {path}") from None
    return total
