"""No store is wiped without being asked: volatile opens and ``pagedkv demo`` refuse to destroy.

A volatile open erases what it opens, and the demo replaces what lies at its path;
both must refuse a store that holds committed data someone else made, leaving every
byte of it, and say how to allow the replacement.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import PagedKVError
from pagedkv import opening
from pagedkv.demo.workload import DEMO_MODEL, prepare_path

from tests.kits.cli import run as run_cli
from tests.kits.content import kv
from tests.kits.model import build_committed
from tests.kits.store import GEOM



SMALL_DEMO = ["--preset", "tiny", "--pool-pages", "24", "--sequences", "12", "--tokens", "16"]
SAFE = re.compile(r"[\x20-\x7e\t\n]*")


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


# -- pagedkv demo ------------------------------------------------------------------------------


def run(*args: Any, code: int = 0) -> Any:
    """``kits.cli.run``, and every byte of output plain ASCII: the demo prints no ids."""
    result = run_cli(*args, code=code)
    assert SAFE.fullmatch(result.stdout) and SAFE.fullmatch(result.stderr)
    return result


def demo(path: Path, *extra: Any) -> dict[str, Any]:
    return json.loads(run("demo", path, "--json", *extra).stdout)


def assert_refused(path: Path, *args: Any, mention: str) -> str:
    """The demo exits 2 with one ``Error:`` line that mentions ``mention``; nothing under ``path`` changes."""
    before = tree_state(path)
    result = run("demo", path, *args, code=2)
    lines = result.stderr.splitlines()
    assert result.stdout == "" and len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert mention in lines[0], lines[0]
    assert tree_state(path) == before, "a refused demo touched the path"
    return lines[0]


@pytest.mark.parametrize("model", [None, "llama-3-8b@sha256:abc"], ids=["no-model", "other-model"])
@pytest.mark.parametrize("workload", [SMALL_DEMO, ["--seed-workload", "--durability", "nosync"]],
                         ids=["serving", "seed"])
def test_demo_refuses_a_store_it_did_not_make(tmp_path: Path, model: str | None, workload: list) -> None:
    path = tmp_path / "mine.kv"
    kept = _committed_store(path, model=model)
    assert_refused(path, *workload, mention="--force")
    _verify(path, kept)


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "forced"])
def test_demo_refuses_a_directory_that_is_not_a_store(tmp_path: Path, force: list) -> None:
    path = tmp_path / "notes"
    path.mkdir()
    (path / "keep.txt").write_text("precious")
    (path / "pool.bin").write_bytes(b"not a pool at all")
    assert_refused(path, *SMALL_DEMO, *force, mention=str(path))
    assert (path / "keep.txt").read_text() == "precious"


def test_demo_force_replaces_a_store_it_did_not_make(tmp_path: Path) -> None:
    path = tmp_path / "mine.kv"
    _committed_store(path)
    with pagedkv.open(path, readonly=True) as store:
        old_uuid = store.uuid
    out = demo(path, *SMALL_DEMO, "--force")
    assert out["store"] == "replaced" and out["verified"] is True
    with pagedkv.open(path, readonly=True) as store:
        assert store.model == DEMO_MODEL
        assert "a" not in store.sequences() and store.uuid != old_uuid
    assert demo(path, *SMALL_DEMO)["store"] == "replaced"  # now it is the demo's own: no --force


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [
    (SMALL_DEMO, SMALL_DEMO),
    (["--seed-workload", "--durability", "nosync"], SMALL_DEMO),
    (SMALL_DEMO, ["--seed-workload", "--durability", "nosync"]),
], ids=["serving-serving", "seed-serving", "serving-seed"])
def test_demo_replaces_a_store_a_demo_made_without_force(tmp_path: Path, first: list, second: list) -> None:
    path = tmp_path / "demo.kv"
    assert demo(path, *first)["store"] == "new"
    with pagedkv.open(path, readonly=True) as store:
        assert store.model == DEMO_MODEL
    assert demo(path, *second)["store"] == "replaced"
    with pagedkv.open(path, readonly=True) as store:
        assert store.model == DEMO_MODEL
        assert store.check() == []


def test_prepare_path_refuses_a_foreign_store_by_default(tmp_path: Path) -> None:
    """Callers of the Python API (the seed workload among them) get the same protection."""
    path = tmp_path / "mine.kv"
    model = _committed_store(path)
    before = tree_state(path)
    with pytest.raises(PagedKVError, match="force"):
        prepare_path(str(path))
    assert tree_state(path) == before
    assert prepare_path(str(path), force=True) == "replaced"
    assert not path.exists()
    del model
