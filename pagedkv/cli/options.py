"""What the commands share: their decorator, the ``--json`` flag and PATH argument, printing a
result, byte-size options, and the terminal's progress bars and pool-map style.

``_progress`` and ``_map_style`` keep their underscores: they are the cli package's own,
not an interface, and its tests call them by these names.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from typing import Any, Callable

import click

from . import text as clitext
from ..inspection import report as inspector
from .exits import EXIT_CODES_HELP, JSON_SCHEMA, echo_out


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The shared ``--json`` flag (machine output with stable keys and a ``schema`` version)."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print JSON with stable keys (\"schema\": {JSON_SCHEMA}) instead of text; "
                             "errors too.")(fn)


def path_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The PATH argument of the store commands (a store directory)."""
    # No exists=True: click's own check prints a multi-line usage message, and a bad
    # path must be one line (T14); the commands validate the path themselves.
    return click.argument("path", type=click.Path(path_type=str))(fn)


def emit(as_json: bool, value: Any, text: str) -> None:
    """Print ``value`` as JSON (with the schema version) or ``text`` (already escaped by clitext)."""
    if as_json:
        body = {"schema": JSON_SCHEMA, **value} if isinstance(value, dict) else value
        echo_out(clitext.to_json(body))
    else:
        echo_out(text)


def command(**kwargs: Any) -> Callable[[Callable[..., Any]], click.Command]:
    """``click.command`` with the exit-code table as the help epilog (``commands.py`` adds it to the group)."""
    return click.command(epilog=EXIT_CODES_HELP, **kwargs)


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?b?)\s*", re.IGNORECASE)


class ByteSize(click.ParamType):  # type: ignore[type-arg]  # generic only in newer click
    """A byte count: ``1000000``, ``64MiB``, ``2G`` (units are binary: K = 1024), ``0``."""

    name = "BYTES"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """The number of bytes ``value`` spells; a usage error otherwise."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        match = _SIZE.fullmatch(str(value))
        if match is None:
            self.fail(f"{value!r} is not a byte count (e.g. 1000000, 64MiB, 2G)", param, ctx)
        number, unit = float(match.group(1)), match.group(2).lower()
        return int(number * 1024 ** "_kmgtp".index(unit or "_"))


def _progress(length: int, label: str, unit: str, quiet: bool) -> Any:
    """A progress bar with its rate on stderr when it is a terminal, else a silent stand-in."""
    if quiet or not sys.stderr.isatty():
        return _Silent()
    bar = click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)
    started = time.monotonic()
    bar.item_show_func = lambda _item: clitext.rate_text(bar.pos, time.monotonic() - started, unit)
    return bar


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, steps: int) -> None:
        """Ignore progress."""


def _map_style() -> tuple[int, bool]:
    """(cells per row, colour) for ``--map``: the terminal's width and colour on a terminal.

    Colour follows the NO_COLOR convention (any non-empty value turns it off) and
    is never used for a dumb terminal; off a terminal the grid is 64 wide, plain.
    """
    if not sys.stdout.isatty():
        return inspector.MAP_WIDTH, False
    columns = shutil.get_terminal_size((80, 24)).columns
    width = max(16, min(512, columns - clitext.MAP_GUTTER))
    color = not os.environ.get("NO_COLOR") and os.environ.get("TERM", "") != "dumb"
    return width, color
