"""Rules of the package's code that a test can read off its source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagedkv"


def test_no_ufunc_at_with_a_python_int_on_the_int32_columns() -> None:
    """``np.add.at(column, rows, 1)`` on an int32 column casts the Python 1 to int64 and takes
    numpy's slow path (about 70 ns an element, a step of 64 sequences spent 150 us there);
    the columns' own unit, ``pages.directory.ONE``, keeps the fast path."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "at"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("add", "subtract")
                    and len(node.args) == 3 and isinstance(node.args[2], ast.Constant)
                    and isinstance(node.args[2].value, int)):
                target = node.args[0]
                if isinstance(target, ast.Attribute) and target.attr in ("ref", "c_ref", "pins", "bg_pins"):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "use pages.directory.ONE:\n" + "\n".join(found)
