"""The command line in the tests: one runner, exit codes asserted, every byte of output escaped.

``run(*args, code=0)`` invokes ``pagedkv`` through click's ``CliRunner`` (in this process,
stderr kept apart from stdout), asserts the exit code (unless ``code`` is None), that all
output is printable text (a hostile sequence id never reaches the terminal raw) and that
no traceback escaped. ``run_json`` adds ``--json`` and parses stdout; ``error_of`` checks
the shape of a JSON error; ``assert_one_line_error`` the shape of a text one.
"""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner, Result

from pagedkv.cli.commands import cli


def printable(text: str) -> bool:
    """Whether ``text`` holds printable characters (any script), tab and newline only."""
    return all(char.isprintable() or char in "\t\n" for char in text)


def runner() -> CliRunner:
    """A CliRunner that keeps stderr apart from stdout, whatever click's version."""
    try:  # click < 8.2 mixes stderr into stdout unless told not to
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def run(*args: Any, code: int | None = 0, **invoke_kwargs: Any) -> Result:
    """Invoke the CLI; assert the exit code (unless None) and that all output is escaped text."""
    result = runner().invoke(cli, [str(a) for a in args], catch_exceptions=False, **invoke_kwargs)
    assert code is None or result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert printable(result.stdout), result.stdout
    assert printable(result.stderr), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return result


def run_json(*args: Any, code: int = 0) -> Any:
    """``run`` with ``--json`` last (before a ``--`` that ends the options), stdout parsed."""
    at = args.index("--") if "--" in args else len(args)
    return json.loads(run(*args[:at], "--json", *args[at:], code=code).stdout)


def error_of(*args: Any, code: int) -> dict[str, Any]:
    """The JSON error object of a failing command (``--json`` put last), checked for shape."""
    out = run_json(*args, code=code)
    assert set(out) == {"schema", "error"} and out["schema"] == 1, out
    assert set(out["error"]) == {"kind", "message", "exit_code"} and out["error"]["exit_code"] == code
    return out["error"]


def assert_one_line_error(result: Result) -> None:
    """Nothing on stdout, one ``Error: ...`` line on stderr."""
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
