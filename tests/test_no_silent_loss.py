"""No store is wiped without being asked: volatile opens refuse to destroy committed data.

A volatile open erases what it opens; it must refuse a store that holds committed
data, leaving every byte of it, and say how to allow the replacement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import PagedKVError
from pagedkv import opening
from support import GEOM, build_committed, kv


def tree_state(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """(bytes, mtime_ns, mode) of every entry under ``root``, root included: every byte of a store."""
    out = {}
    for entry in [root, *sorted(root.rglob("*"))]:
        st = entry.lstat()
        out[str(entry.relative_to(root))] = (entry.read_bytes() if entry.is_file() else None,
                                             st.st_mtime_ns, st.st_mode)
    return out


def _committed_store(path: Path, **kwargs: Any) -> Any:
    return build_committed(path, {"a": 40, "b": 9}, seed=3, pool_pages=4, **kwargs)


def _verify(path: Path, model: Any) -> None:
    with pagedkv.open(path, readonly=True) as store:
        model.verify_all(store)
        assert store.check() == []


# -- volatile opens -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"geometry": GEOM, "pool_pages": 4}, {"geometry": GEOM}],
                         ids=["from-disk", "geometry-and-pool", "geometry"])
def test_volatile_open_of_a_committed_store_is_refused_and_keeps_every_byte(tmp_path: Path,
                                                                           kwargs: dict) -> None:
    path = tmp_path / "store"
    model = _committed_store(path)
    before = tree_state(path)
    with pytest.raises(PagedKVError) as info:
        pagedkv.open(path, durability="volatile", **kwargs)
    message = str(info.value)
    assert "recreate=True" in message and str(path) in message and "\n" not in message, message
    assert tree_state(path) == before, "a refused volatile open changed the store"
    _verify(path, model)


def test_volatile_open_with_recreate_replaces_the_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _committed_store(path)
    with pagedkv.open(path, durability="volatile", recreate=True) as store:
        assert store.sequences() == []
        assert store.geometry == GEOM and store.pool_pages == 4
        store.create("x")
        store.append("x", *kv(1, "x", 0, 20))
        assert store.check() == []
    with pagedkv.open(path) as store:  # nothing of the volatile session persisted
        assert store.sequences() == []
        assert store.check() == []


def test_volatile_open_of_a_missing_or_empty_path_creates_and_reopens(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (tmp_path / "missing", empty):
        with pagedkv.open(path, GEOM, 4, durability="volatile") as store:
            store.create("a")
            store.append("a", *kv(1, "a", 0, 40))
        # A volatile store never committed anything: opening it volatile again loses nothing.
        with pagedkv.open(path, durability="volatile") as store:
            assert store.sequences() == []


def test_volatile_open_rechecks_under_the_writer_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that commits between the first look and the lock is not wiped either."""
    path = tmp_path / "store"
    pagedkv.open(path, GEOM, 4, durability="volatile").close()  # a store with no commit yet
    real_lock = opening.WriterLock
    raced = []

    def racing_lock(lock_path: str) -> Any:
        if not raced:
            raced.append(1)
            with pagedkv.open(path) as other:  # another writer gets in first and commits
                other.create("late")
                other.append("late", *kv(2, "late", 0, 20))
        return real_lock(lock_path)

    monkeypatch.setattr(opening, "WriterLock", racing_lock)
    with pytest.raises(PagedKVError, match="recreate=True"):
        pagedkv.open(path, durability="volatile")
    monkeypatch.undo()
    assert raced
    with pagedkv.open(path, readonly=True) as store:
        assert store.length("late") == 20


def test_recreate_is_only_for_volatile_opens(tmp_path: Path) -> None:
    path = tmp_path / "store"
    model = _committed_store(path)
    before = tree_state(path)
    for kwargs in ({"recreate": True}, {"recreate": True, "durability": "nosync"},
                   {"recreate": True, "readonly": True}):
        with pytest.raises(PagedKVError, match="recreate"):
            pagedkv.open(path, **kwargs)
    assert tree_state(path) == before
    _verify(path, model)
