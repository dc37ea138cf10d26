"""A store's files: private modes whatever the umask, no symlink followed, nothing written by readers.

The directory is 0700 and every file 0600 (KV caches hold prompt contents), parents
included; a symlinked store file or directory is refused without touching its target; a
read-only open writes no byte; pool.bin is fully allocated and LMDB is configured as
promised; a store on a remote filesystem is refused unless allowed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import PagedKVError
from pagedkv.storage import files

from tests.kits.child import in_child
from tests.kits.files import DATA_MDB, LOCK, LOCK_MDB, POOL, SPILL, copy_store
from tests.kits.model import Model, build_committed, fill
from tests.kits.store import GEOM



SEQS = {"a": 21, "b": 30, "c": 9}  # 17 pages through an 8-slot pool: some spilled


def build(path: Path, seed: int, **kwargs: Any) -> Model:
    """A closed store at ``path`` holding ``SEQS`` (one commit); its model."""
    return build_committed(path, SEQS, seed, 8, chunks=1, **kwargs)


# -- T13: permissions and links --------------------------------------------------------------


def modes_under_umask(root: str, mask: int) -> list[tuple[str, int, bool]]:
    """Under ``mask``: create a store (its parents too), spill most of it, reopen and read it all;
    (path, mode, is a directory) of everything pagedkv made."""
    os.umask(mask)
    path = os.path.join(root, "parent", "child", "store")  # parents are created too
    store = pagedkv.open(path, GEOM, 4, evict_batch=1)
    model = fill(store, 9, SEQS)  # 17 pages through 4 slots: evictions grow LMDB's files
    store.close()
    store = pagedkv.open(path, durability="nosync")
    model.verify_all(store)
    assert store.check() == []
    store.close()
    pagedkv.open(path, readonly=True).close()
    top = os.path.join(root, "parent")  # created by pagedkv too, as the store's ancestor
    out = [("parent", stat.S_IMODE(os.lstat(top).st_mode), True)]
    for base, dirs, names in os.walk(top):
        for name in dirs + names:
            full = os.path.join(base, name)
            info = os.lstat(full)
            out.append((os.path.relpath(full, root), stat.S_IMODE(info.st_mode), stat.S_ISDIR(info.st_mode)))
    return out


@pytest.mark.parametrize("mask", [0o000, 0o022], ids=["umask000", "umask022"])
def test_private_modes_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    result = in_child(modes_under_umask, str(tmp_path), mask, timeout=60)
    assert result.status == "ok", str(result)
    entries = result.value
    names = {name for name, _, _ in entries}
    for needed in ("parent/child/store/" + POOL, "parent/child/store/" + LOCK,
                   "parent/child/store/" + DATA_MDB, "parent/child/store/" + LOCK_MDB):
        assert needed in names, (needed, sorted(names))
    bad = [(name, oct(mode)) for name, mode, is_dir in entries
           if (is_dir and mode != 0o700) or (not is_dir and mode & 0o077)]
    assert not bad, bad
    assert not [name for name in names if ".creating-" in name]


def _link_out(work: Path, name: str, outside: Path) -> Path:
    """Move ``work/name`` outside the store and leave a symlink to it in its place."""
    target = outside / name.replace("/", "_")
    os.rename(work / name, target)
    os.symlink(target, work / name)
    return target


def _snapshot(target: Path) -> Any:
    if target.is_dir():
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(target.iterdir())}
    return target.read_bytes(), target.stat().st_mtime_ns


@pytest.mark.parametrize("name", [POOL, LOCK, DATA_MDB, LOCK_MDB, SPILL])
@pytest.mark.parametrize("readonly", [False, True], ids=["writer", "readonly"])
def test_symlinked_store_files_are_refused(tmp_path: Path, name: str, readonly: bool) -> None:
    source = tmp_path / "source"
    model = build(source, 10)
    work = copy_store(source, tmp_path / "work")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = _link_out(work, name, outside)
    before = _snapshot(target)
    try:
        store = pagedkv.open(work, readonly=readonly)
    except PagedKVError as exc:
        assert "link" in str(exc), str(exc)
    else:
        store.close()
        # Only a reader may ignore a linked LOCK: it never opens it.
        assert readonly and name == LOCK, f"{name} as a symlink was followed ({'ro' if readonly else 'rw'})"
    assert _snapshot(target) == before, "the link target was touched"
    del model


def test_symlinked_store_directory_is_refused(tmp_path: Path) -> None:
    build(tmp_path / "real", 11)
    os.symlink(tmp_path / "real", tmp_path / "link")
    for readonly in (False, True):
        with pytest.raises(PagedKVError, match="link"):
            pagedkv.open(tmp_path / "link", readonly=readonly)


def test_readonly_open_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    model = build(path, 12)
    files_before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}
    store = pagedkv.open(path, readonly=True)
    try:
        model.verify_all(store)
        store.stats()
    finally:
        store.close()
    files_after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}
    assert files_after == files_before
    # And on a copy nobody may write (a real restriction only when not running as root).
    frozen = copy_store(path, tmp_path / "frozen")
    for p in [frozen, *frozen.rglob("*")]:
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~0o222)
    try:
        store = pagedkv.open(frozen, readonly=True)
        try:
            model.verify_all(store)
        finally:
            store.close()
    finally:
        for p in [frozen, *frozen.rglob("*")]:
            p.chmod(stat.S_IMODE(p.stat().st_mode) | 0o200)


def test_files_are_allocated_and_lmdb_configured(tmp_path: Path) -> None:
    """P6: pool.bin fully reserved; LMDB without writemap, with locking and a sized reader table."""
    path = tmp_path / "store"
    build(path, 13)
    info = os.stat(path / POOL)
    assert info.st_blocks * 512 >= info.st_size, "pool.bin is sparse: posix_fallocate was skipped"
    for durability, synced in (("durable", True), ("nosync", False)):
        store = pagedkv.open(path, durability=durability)
        try:
            env = store._spill.env
            flags = env.flags()
            assert flags["writemap"] is False and flags["lock"] is True, flags
            assert flags["sync"] is synced and flags["metasync"] is synced, flags
            assert env.max_readers() >= 126
        finally:
            store.close()


def _mountinfo(path: Path, lines: list[tuple[str, str]]) -> Path:
    """A fake /proc/self/mountinfo: (mount point, fstype) lines, octal-escaped like the kernel's."""
    out = []
    for number, (mount, fstype) in enumerate(lines, 20):
        escaped = mount.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
        out.append(f"{number} 1 0:{number} / {escaped} rw,relatime shared:1 - {fstype} src rw\n")
    table = path / "mountinfo"
    table.write_text("".join(out))
    return table


def test_remote_filesystem_is_refused_unless_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(os.path.realpath(tmp_path))
    for name in ("plain", "with space"):
        home = base / name
        home.mkdir()
        monkeypatch.setattr(files, "MOUNTINFO", str(_mountinfo(base, [("/", "ext4"), (str(home), "nfs4")])))
        path = home / "store"
        with pytest.raises(PagedKVError, match="nfs4"):
            pagedkv.open(path, GEOM, 8)
        assert not path.exists()
        store = pagedkv.open(path, GEOM, 8, allow_remote=True)
        store.close()
        for readonly in (False, True):  # an existing store is refused as well
            with pytest.raises(PagedKVError, match="nfs4"):
                pagedkv.open(path, readonly=readonly)
        store = pagedkv.open(path, allow_remote=True)
        store.close()
    # A mount point is a path prefix only at a separator: /x/ab is not under /x/a.
    sibling = base / "ab"
    sibling.mkdir()
    monkeypatch.setattr(files, "MOUNTINFO", str(_mountinfo(base, [("/", "ext4"), (str(base / "a"), "cifs")])))
    pagedkv.open(sibling / "store", GEOM, 8).close()
    # Every fstype of the guard's list is refused.
    for fstype in files.REMOTE_FS:
        monkeypatch.setattr(files, "MOUNTINFO", str(_mountinfo(base, [("/", "ext4"), (str(base), fstype)])))
        with pytest.raises(PagedKVError):
            pagedkv.open(base / "plain" / "store")
