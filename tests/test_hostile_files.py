"""Hostile files in a store directory: every open is typed, never hangs, never writes outside.

A store file may be replaced by a FIFO, a directory, a socket or a device node, be
owned by another user, be a hard link to a file outside the store, or have its name
swapped between pagedkv's check and LMDB's own open of it. Each open runs in a forked
child with a timeout, so a hang is a failure of the test rather than of the suite.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

import lmdb
import pytest

import pagedkv
from pagedkv import PagedKVError, StoreCorrupt
from pagedkv.demo.workload import prepare_path
from pagedkv.storage.pool import PagePool

from tests.kits.child import in_child
from tests.kits.content import kv
from tests.kits.files import DATA_MDB, LOCK, LOCK_MDB, POOL
from tests.kits.model import build_committed
from tests.kits.store import GEOM



NOBODY = 65534
FILES = [POOL, DATA_MDB, LOCK_MDB, LOCK]
MODES = {"writer": False, "readonly": True}
OPEN_TIMEOUT = 20.0  # seconds: a typed refusal takes well under one; a hang never ends


def _build(path: Path) -> Any:
    """A closed store with committed pages, some of them spilled; its model."""
    return build_committed(path, {"a": 40, "b": 9}, seed=5, pool_pages=4)


def _open_outcome(path: str, readonly: bool) -> tuple[str, str, str]:
    """Open in this (child) process: ("typed", error type, message) or ("opened", "", "")."""
    try:
        store = pagedkv.open(path, readonly=readonly)
    except PagedKVError as exc:
        return "typed", type(exc).__name__, str(exc)
    store.close()
    return "opened", "", ""


def _assert_typed_refusal(path: Path, readonly: bool, names: str) -> str:
    """Open in a child: it must end within the timeout with a one-line typed error naming ``names``."""
    result = in_child(_open_outcome, str(path), readonly, timeout=OPEN_TIMEOUT)
    assert result.status == "ok", f"open of {names}: {result}"
    outcome, kind, message = result.value
    assert outcome == "typed", f"{names} was opened as if nothing were wrong"
    assert "\n" not in message and names in message, (kind, message)
    return message


def _digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _data_files(path: Path) -> dict[str, tuple[str, int] | None]:
    """Content and mtime of the files that hold data (LOCK and lock.mdb change on any open)."""
    return {name: _digest(path / name) if (path / name).is_file() else None for name in (POOL, DATA_MDB)}


# -- a FIFO in place of each file ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", FILES)
def test_fifo_in_place_of_a_store_file_is_refused_without_blocking(tmp_path: Path, name: str,
                                                                  mode: str) -> None:
    path = tmp_path / "store"
    _build(path)
    os.unlink(path / name)
    os.mkfifo(path / name, 0o600)
    before = _data_files(path)
    message = _assert_typed_refusal(path, MODES[mode], os.path.basename(name))
    assert "regular file" in message, message
    assert stat.S_ISFIFO(os.lstat(path / name).st_mode), "the FIFO was replaced"
    assert _data_files(path) == before


# -- a directory, a socket or a device node in place of each file -----------------------------


def _make_socket(target: Path) -> None:
    cwd = os.getcwd()
    os.chdir(target.parent)  # sun_path is 108 bytes at most: bind by the short name
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(target.name)
        sock.close()  # the socket file stays behind, with nobody listening
    finally:
        os.chdir(cwd)


def _make_device(target: Path) -> None:
    try:
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


KINDS = {"directory": lambda target: target.mkdir(), "socket": _make_socket, "device": _make_device}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", FILES)
def test_non_regular_file_in_place_of_a_store_file_is_refused(tmp_path: Path, name: str, kind: str,
                                                             mode: str) -> None:
    path = tmp_path / "store"
    _build(path)
    os.unlink(path / name)
    KINDS[kind](path / name)
    before = _data_files(path)
    message = _assert_typed_refusal(path, MODES[mode], os.path.basename(name))
    assert "regular file" in message, message
    assert _data_files(path) == before


# -- files owned by another user ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", [*FILES, "spill", "."])
def test_store_file_owned_by_another_user_is_refused(tmp_path: Path, name: str, mode: str) -> None:
    path = tmp_path / "store"
    _build(path)
    os.chown(path / name, NOBODY, NOBODY, follow_symlinks=False)
    before = _data_files(path)
    message = _assert_typed_refusal(path, MODES[mode], "store" if name == "." else os.path.basename(name))
    assert f"uid {NOBODY}" in message, message
    assert _data_files(path) == before


# -- hard links to files outside the store --------------------------------------------------------


@pytest.mark.parametrize("name", [POOL, DATA_MDB, LOCK])
def test_store_file_hard_linked_from_outside_is_not_written(tmp_path: Path, name: str) -> None:
    """A writer must not write through a name that also belongs to a file outside the store."""
    path = tmp_path / "store"
    model = _build(path)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(path / name, outside / "victim")
    before = _digest(outside / "victim")
    try:
        store = pagedkv.open(path)
    except StoreCorrupt as exc:
        assert "link" in str(exc) and os.path.basename(name) in str(exc), str(exc)
    else:
        store.create("c")
        store.append("c", *kv(9, "c", 0, 40))
        store.commit()
        store.close()
    assert _digest(outside / "victim") == before, "a writer wrote into a file outside the store"
    os.unlink(outside / "victim")
    with pagedkv.open(path, readonly=True) as store:
        model.verify_all(store)


# -- an unreadable store directory --------------------------------------------------------------


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A directory every user may traverse (pytest's own tmp tree is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="pagedkv-hostile-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        for root, dirs, _ in os.walk(base):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(base)


def _as_stranger(fn: Any, *args: Any) -> Any:
    """Run ``fn`` as a user the store's permission bits shut out (nobody, when we are root)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    return fn(*args)


def _prepare_outcome(path: str) -> tuple[str, str, str]:
    try:
        return "prepared", prepare_path(path), ""
    except PagedKVError as exc:
        return "typed", type(exc).__name__, str(exc)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_unreadable_store_directory_is_a_typed_error(open_base: Path, mode: str) -> None:
    path = open_base / "store"
    _build(path)
    os.chmod(path, 0o700 if os.geteuid() == 0 else 0o000)  # root: shut out the child's nobody
    before = _data_files(path) if os.geteuid() == 0 else None
    for fn, args in ((_open_outcome, (str(path), MODES[mode])), (_prepare_outcome, (str(path),))):
        result = in_child(_as_stranger, fn, *args, timeout=OPEN_TIMEOUT)
        assert result.status == "ok", f"{fn.__name__}: {result}"
        outcome, kind, message = result.value
        assert outcome == "typed", (fn.__name__, result.value)
        assert str(path) in message and "\n" not in message, message
    os.chmod(path, 0o700)
    if before is not None:
        assert _data_files(path) == before


@pytest.mark.parametrize("mode", sorted(MODES))
def test_store_below_an_untraversable_directory_is_a_typed_error(open_base: Path, mode: str) -> None:
    secret = open_base / "secret"
    _build(secret / "store")
    os.chmod(secret, 0o700 if os.geteuid() == 0 else 0o000)
    result = in_child(_as_stranger, _open_outcome, str(secret / "store"), MODES[mode], timeout=OPEN_TIMEOUT)
    os.chmod(secret, 0o700)
    assert result.status == "ok", str(result)
    outcome, kind, message = result.value
    assert outcome == "typed" and "secret" in message and "\n" not in message, result.value
    assert "ermission denied" in message, message


# -- a name swapped between the check and LMDB's open -------------------------------------------


def _swap_during(monkeypatch: pytest.MonkeyPatch, spill: Path, name: str, decoy: Path, how: str) -> list[int]:
    """Make the next ``lmdb.open`` of ``spill`` (in this process) find ``spill/name`` swapped for ``decoy``.

    The real file is put back as soon as LMDB has opened whatever the name led to,
    so a check of the name afterwards finds nothing amiss.
    """
    real_open, me, calls = lmdb.open, os.getpid(), []

    def racing_open(target: str, *args: Any, **kwargs: Any) -> Any:
        if os.getpid() != me or os.path.abspath(target) != str(spill) or calls:
            return real_open(target, *args, **kwargs)
        calls.append(1)
        real, aside = spill / name, spill / f".{name}.aside"
        os.rename(real, aside)
        if how == "symlink":
            os.symlink(decoy, real)
        else:
            os.link(decoy, real)
        try:
            return real_open(target, *args, **kwargs)
        finally:
            os.unlink(real)
            os.rename(aside, real)

    monkeypatch.setattr(lmdb, "open", racing_open)
    return calls


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("decoy_name", ["data.mdb", "elsewhere.bin"])
def test_data_mdb_swapped_while_lmdb_opens_it_gets_no_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          how: str, decoy_name: str) -> None:
    """A writer must never commit into the file a swapped name led LMDB to."""
    path = tmp_path / "store"
    model = _build(path)
    outside = tmp_path / "outside"
    outside.mkdir()
    decoy = outside / decoy_name
    shutil.copyfile(path / DATA_MDB, decoy)  # a valid environment: LMDB would take it gladly
    before, store_before = _digest(decoy), _data_files(path)
    calls = _swap_during(monkeypatch, path / "spill", "data.mdb", decoy, how)
    try:
        store = pagedkv.open(path)
    except StoreCorrupt as exc:
        assert "data.mdb" in str(exc), str(exc)
        assert _data_files(path) == store_before, "a refused open changed the store"
    else:
        # Whatever it opened is verified: a commit must land in the store, not in the decoy.
        store.create("c")
        store.append("c", *kv(9, "c", 0, 40))
        store.commit()
        store.close()
    monkeypatch.undo()
    assert calls, "the swap never happened: the test did not exercise LMDB's open"
    assert _digest(decoy) == before, "a writer committed into a file outside the store"
    with pagedkv.open(path, readonly=True) as store:
        assert store.check() == []
        for seq in ("a", "b"):
            model.verify(store, seq)


def _write_if_it_opens(path: Path, mention: str) -> None:
    """Open ``path`` as the writer and commit new pages, unless the open is refused as
    ``StoreCorrupt`` naming ``mention``."""
    try:
        store = pagedkv.open(path)
    except StoreCorrupt as exc:
        assert mention in str(exc), str(exc)
        return
    store.create("c")
    store.append("c", *kv(9, "c", 0, 40))
    store.commit()
    store.close()


def test_spill_directory_swapped_while_lmdb_opens_it_gets_no_byte(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store"
    _build(path)
    decoy = tmp_path / "decoy-spill"
    shutil.copytree(path / "spill", decoy)
    before = {name: _digest(decoy / name) for name in ("data.mdb",)}
    real_open, me, calls = lmdb.open, os.getpid(), []
    spill = path / "spill"

    def racing_open(target: str, *args: Any, **kwargs: Any) -> Any:
        if os.getpid() != me or os.path.abspath(target) != str(spill) or calls:
            return real_open(target, *args, **kwargs)
        calls.append(1)
        os.rename(spill, path / ".spill.aside")
        os.symlink(decoy, spill)
        try:
            return real_open(target, *args, **kwargs)
        finally:
            os.unlink(spill)
            os.rename(path / ".spill.aside", spill)

    monkeypatch.setattr(lmdb, "open", racing_open)
    _write_if_it_opens(path, "spill")
    monkeypatch.undo()
    assert calls
    assert {name: _digest(decoy / name) for name in ("data.mdb",)} == before, \
        "a writer committed into a spill directory outside the store"


def test_pool_swapped_for_an_outside_hard_link_before_mapping_is_refused(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.bin is mapped from the descriptor that was checked; a name swapped before that open is refused."""
    path = tmp_path / "store"
    model = _build(path)
    decoy = tmp_path / "decoy.bin"
    shutil.copyfile(path / POOL, decoy)
    before = _digest(decoy)
    real_open, calls = PagePool.open.__func__, []

    def racing_open(cls: Any, target: str, writable: bool) -> Any:
        if not calls and writable:
            calls.append(1)
            os.unlink(target)
            os.link(decoy, target)
        return real_open(cls, target, writable)

    monkeypatch.setattr(PagePool, "open", classmethod(racing_open))
    _write_if_it_opens(path, "pool.bin")
    monkeypatch.undo()
    assert calls
    assert _digest(decoy) == before, "a writer mapped and wrote a file outside the store"
    del model


def _open_beside(monkeypatch: pytest.MonkeyPatch, spill: Path, other: Path, times: int) -> list[int]:
    """The next ``times`` LMDB opens of ``spill`` happen while another file gets opened (and kept)."""
    real_open, me, held = lmdb.open, os.getpid(), []

    def busy_open(target: str, *args: Any, **kwargs: Any) -> Any:
        env = real_open(target, *args, **kwargs)
        if os.getpid() == me and os.path.abspath(target) == str(spill) and len(held) < times:
            held.append(os.open(other, os.O_RDONLY))  # as another thread of the process might
        return env

    monkeypatch.setattr(lmdb, "open", busy_open)
    return held


def test_a_file_another_thread_opens_meanwhile_is_not_mistaken_for_a_swap(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store"
    model = _build(path)
    (tmp_path / "unrelated.log").write_text("x")
    held = _open_beside(monkeypatch, path / "spill", tmp_path / "unrelated.log", times=1)
    try:
        with pagedkv.open(path) as store:
            model.verify_all(store)
    finally:
        for fd in held:
            os.close(fd)
    assert len(held) == 1


def test_unexplained_files_opened_on_every_try_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store"
    _build(path)
    (tmp_path / "unrelated.log").write_text("x")
    held = _open_beside(monkeypatch, path / "spill", tmp_path / "unrelated.log", times=100)
    try:
        with pytest.raises(StoreCorrupt, match="unexpected files"):
            pagedkv.open(path)
    finally:
        for fd in held:
            os.close(fd)
    assert len(held) >= 2, "refused without looking again"


def test_opening_a_store_leaves_no_descriptor_behind(tmp_path: Path) -> None:
    """The descriptors kept for checking are closed; LMDB's own stay only while the store is open."""
    path = tmp_path / "store"
    _build(path)
    pagedkv.open(path).close()  # warm imports and lazily opened files
    before = set(os.listdir("/proc/self/fd"))
    for readonly in (False, True, False):
        pagedkv.open(path, readonly=readonly).close()
    assert set(os.listdir("/proc/self/fd")) <= before


def test_healthy_store_opens_in_every_mode(tmp_path: Path) -> None:
    """The checks refuse only what is wrong: a store made by pagedkv opens as before."""
    path = tmp_path / "store"
    model = _build(path)
    for kwargs in ({}, {"readonly": True}, {"durability": "nosync"}, {"geometry": GEOM, "pool_pages": 4}):
        with pagedkv.open(path, **kwargs) as store:
            model.verify_all(store)


def test_a_child_forked_while_a_store_opens_can_open_stores(tmp_path: Path) -> None:
    """The process-wide opening lock is fresh in a forked child, whichever thread held it at the fork."""
    import threading

    from pagedkv.storage import files

    path = tmp_path / "store"
    model = _build(path)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:  # another thread, in the middle of opening a store
        with files.OPENING:
            held.set()
            done.wait()

    def open_in_child() -> int:
        with pagedkv.open(path, readonly=True) as store:
            return store.length("a")

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        result = in_child(open_in_child, timeout=OPEN_TIMEOUT)
    finally:
        done.set()
        holder.join()
    assert result.status == "ok" and result.value == model.lens["a"], str(result)
