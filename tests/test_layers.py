"""The package's layers, read from its imports: no cycles, and each layer imports only those below it.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``:
a cycle hidden in a function body is still a cycle a newcomer has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "pagedkv"

# The layers, lowest first. A module may import its own layer and those below; the
# modules above the store (opening, snapshots, inspection, the command line, ...) are
# held only to having no cycles.
LEAVES = {"pagedkv.errors", "pagedkv.geometry", "pagedkv.faults", "pagedkv.counters"}
# What works on a StoreCore: the handle's state, the data paths, the background threads
# (whose host interface core.py implements) and the remote tier.
BELOW_STORE = {"pagedkv.core", "pagedkv.sequences", "pagedkv.datapath", "pagedkv.step", "pagedkv.stepplan",
               "pagedkv.stepstate", "pagedkv.stepgrow", "pagedkv.check",
               "pagedkv.options", "pagedkv.stats"}
BELOW_STORE_PACKAGES = ("pagedkv.background.", "pagedkv.remote.")
# KVStore and the read API built on the same StoreCore.
STORE = {"pagedkv.store", "pagedkv.describe"}


def _below_store(module: str) -> bool:
    return module in BELOW_STORE or module.startswith(BELOW_STORE_PACKAGES)


def _storage_or_pages(module: str) -> bool:
    return module in LEAVES or module.startswith(("pagedkv.storage.", "pagedkv.pages."))


LAYERS = [
    ("leaves", lambda m: m in LEAVES),
    ("storage", lambda m: m.startswith("pagedkv.storage.")),
    ("pages", lambda m: m.startswith("pagedkv.pages.")),
    ("below_store", _below_store),
    ("store", lambda m: m in STORE),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The pagedkv modules ``name`` imports anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES]
            # ``from . import faults`` imports the module faults, not the package around it.
            targets = submodules if submodules else [target]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_package_face(name: str) -> bool:
    return MODULES[name].name == "__init__.py" and name != "pagedkv"


def test_no_import_cycles() -> None:
    # Tarjan's strongly connected components over the module graph (package faces
    # other than the top one only hold a docstring or re-export their own modules).
    edges = {name: {t for t in targets if not _is_package_face(t)} for name, targets in GRAPH.items()
             if not _is_package_face(name)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    assert cycles == [], f"import cycles: {cycles}"


@pytest.mark.parametrize("layer", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_layer_imports_only_below(layer: int) -> None:
    name_of, belongs = LAYERS[layer]
    allowed = [test for _, test in LAYERS[:layer + 1]]
    wrong = {module: sorted(t for t in targets if not _is_package_face(t) and not any(ok(t) for ok in allowed))
             for module, targets in GRAPH.items() if belongs(module)}
    wrong = {module: targets for module, targets in wrong.items() if targets}
    assert wrong == {}, f"{name_of} modules importing above their layer: {wrong}"


def test_below_the_store_nothing_imports_the_store() -> None:
    # The data paths, the background threads and the remote tier work on a StoreCore;
    # only modules above the store (opening, inspection, cli, ...) may import KVStore's
    # module or the read API beside it.
    below = [name for name in GRAPH if _below_store(name)]
    wrong = sorted(name for name in below if GRAPH[name] & STORE)
    assert wrong == []


def test_the_background_threads_see_the_store_only_through_their_host() -> None:
    # core.py imports background/host.py to implement it, so nothing under background/
    # may import core.py or anything built on it: only the pages, storage and leaves.
    wrong = {name: sorted(t for t in targets if not _is_package_face(t) and not _storage_or_pages(t)
                          and not t.startswith("pagedkv.background."))
             for name, targets in GRAPH.items() if name.startswith("pagedkv.background.")}
    assert {name: targets for name, targets in wrong.items() if targets} == {}


def test_only_the_entry_points_import_the_command_line() -> None:
    # cli/ is the top of the package: the console script and python -m pagedkv start it.
    importers = sorted(name for name, targets in GRAPH.items() if not name.startswith("pagedkv.cli")
                       and any(t == "pagedkv.cli" or t.startswith("pagedkv.cli.") for t in targets))
    assert importers == ["pagedkv.__main__"]


def test_the_named_modules_exist() -> None:
    # A rule naming a module that was renamed or split away would hold vacuously.
    assert sorted((LEAVES | BELOW_STORE | STORE) - set(MODULES)) == []
    for prefix in BELOW_STORE_PACKAGES:
        assert any(name.startswith(prefix) for name in MODULES), prefix


def test_the_graph_is_read() -> None:
    # A guard for the guards above: the reader sees the imports it must see.
    assert "pagedkv.core" in GRAPH["pagedkv.store"]
    assert "pagedkv.describe" in GRAPH["pagedkv.store"]
    assert "pagedkv.background.host" in GRAPH["pagedkv.core"]
    assert "pagedkv.pages.table" in GRAPH["pagedkv.pages.evict"]
    assert "pagedkv.pages.directory" in GRAPH["pagedkv.pages.prefix"]
    assert "pagedkv.storage.lmdbformat" in GRAPH["pagedkv.storage.lmdbwalk"]
    assert "pagedkv.cli.storecommands" in GRAPH["pagedkv.cli.commands"]
    assert "pagedkv.cli.commands" in GRAPH["pagedkv.__main__"]
