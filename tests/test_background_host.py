"""The background threads work through their host alone, and the host speaks for the handle.

The prefetch and write-behind threads get a ``BackgroundHost`` (background/host.py)
instead of the store handle: the rule is read from their source, so it holds for
the code written later too. The host's answers are the handle's own: poisoning
through it stops the handle exactly as a failed write-behind batch does.
"""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest

import pagedkv
from pagedkv.errors import StoreClosed
from tests.kits.model import Model

BACKGROUND = Path(__file__).resolve().parent.parent / "pagedkv" / "background"
THREADS = ("prefetch.py", "writebehind.py")


def private_uses(source: str) -> list[str]:
    """Every ``x._name`` in ``source`` whose ``x`` is not ``self`` (dunders aside), as ``line: text``.

    Reads, writes and deletes all count: a thread that sets a private of another
    object (the handle's health, say) is the case this rule exists for.
    """
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue
        found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
    return [text for _, _, text in sorted(found)]


def imported_modules(source: str, package: str = "pagedkv.background") -> set[str]:
    """The absolute names of the modules ``source`` (a module of ``package``) imports from."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            out.add(".".join(base + ([node.module] if node.module else [])))
    return out


def test_the_checker_sees_what_it_must() -> None:
    # A guard for the rule below: another object's private is found, self's is not.
    sample = ("def f(self, store, mgr):\n"
              "    self._x.lock\n"
              "    with store._lock:\n"
              "        mgr._place(1, 2)\n"
              "    store._poisoned = 'why'\n"
              "    type(store).__name__\n")
    assert private_uses(sample) == ["3: store._lock", "4: mgr._place", "5: store._poisoned"]
    assert imported_modules("from ..core import StoreCore\nfrom .host import HostOwner\n") == {
        "pagedkv.core", "pagedkv.background.host"}


@pytest.mark.parametrize("name", sorted(path.name for path in BACKGROUND.glob("*.py")))
def test_background_modules_touch_no_private_but_their_own(name: str) -> None:
    assert private_uses((BACKGROUND / name).read_text()) == []


@pytest.mark.parametrize("name", THREADS)
def test_the_threads_depend_on_the_host_not_the_handle(name: str) -> None:
    imported = imported_modules((BACKGROUND / name).read_text())
    assert "pagedkv.background.host" in imported
    assert not imported & {"pagedkv.core", "pagedkv.store"}


def _filled(stores, model: Model, **kwargs) -> pagedkv.KVStore:
    store = stores.open(pool_pages=4, **kwargs)
    for seq in range(3):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, 9))
    store.commit()
    return store


def test_poison_through_the_host_stops_writes_like_a_failed_write_behind_batch(stores) -> None:
    model = Model(91)
    store = _filled(stores, model)
    host = store.background_host
    assert not host.poisoned
    host.poison("write-behind: injected failure")
    assert host.poisoned
    # The message a failed write-behind batch leaves: the handle's own poisoned error.
    with pytest.raises(StoreClosed, match=r"poisoned this handle \(write-behind: injected failure\)"):
        store.append(0, *model.upcoming(0, 1))
    with pytest.raises(StoreClosed, match="write-behind: injected failure"):
        store.commit()
    model.verify_all(store)  # reads still work
    store.close()  # a poisoned handle does not commit
    store = stores.open(geom=None, pool_pages=None)
    model.verify_all(store)  # the last commit is intact
    assert store.check() == []


def test_poison_of_a_read_only_handle_stops_nothing(stores) -> None:
    model = Model(92)
    stores.reopen(_filled(stores, model)).close()
    reader = stores.open(geom=None, pool_pages=None, readonly=True)
    reader.background_host.poison("write-behind: injected failure")
    assert not reader.background_host.poisoned  # it writes nothing, so nothing is stopped
    model.verify_all(reader)


def test_the_host_answers_from_the_handle(stores) -> None:
    model = Model(93)
    store = _filled(stores, model, write_behind=True)
    host = store.background_host
    assert host.path == store.path and host.lock is store._lock and host.manager is store._mgr
    assert not host.closed and not host.readonly
    tables = host.tables([2, "gone", 0])
    assert [t.tolist() for t in tables] == [store._seqs[2].table.tolist(), store._seqs[0].table.tolist()]
    with host.read_transaction() as txn:
        assert txn.get(b"no such key", db=host.manager.spill.pages) is None
    store.close()
    assert host.closed


def test_a_dropped_handle_is_freed_without_the_cycle_collector(stores) -> None:
    # The host holds its handle weakly: no handle -> host -> handle cycle keeps it alive.
    model = Model(94)
    gc.collect()
    gc.disable()
    try:
        store = _filled(stores, model, write_behind=True)
        assert store.prefetch([0]).wait(60)
        host, ref = store.background_host, weakref.ref(store)
        store.close()
        stores.opened.remove(store)
        del store
        assert ref() is None
    finally:
        gc.enable()
    assert host.closed
    with pytest.raises(StoreClosed):
        host.manager  # noqa: B018
