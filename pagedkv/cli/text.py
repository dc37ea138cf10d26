"""Text for the command line: escaping, numbers, plurals, tables, and the pool map.

Everything a command prints passes through ``clean``: sequence ids and paths come
from untrusted stores and may hold ESC, CR, NUL or bidirectional overrides, which
must never reach a terminal raw. Printable characters of any script are shown as
they are (``café-🚀``); control, format, separator and unassigned characters are
escaped (``\\x1b``, ``\\u202e``), so printed text holds only printable
characters, tab and newline. Where stdout cannot encode a character (an ASCII
locale), ``fit_encoding`` escapes it too.

The pool map of ``inspect --map`` is drawn here rather than with the other
report layouts (``storetext``, ``demotext``): its colours are the only escape
sequences a command writes on purpose, so they sit beside the escaping that
keeps every other one out.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

MAP_GUTTER = 10  # characters before each row of the pool map (the slot number)


def _escape_char(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _escape(text: str, keep: str) -> str:
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() or char in keep else _escape_char(char) for char in text)


def clean(text: str) -> str:
    """``text`` with every character that is not printable, tab or newline escaped."""
    return "\n".join(_escape(line, "\t") for line in text.split("\n"))


def one_line(text: str) -> str:
    """``clean`` that escapes tab and newline too, for a one-line error message."""
    return _escape(text.strip(), "")


def fit_encoding(text: str, encoding: str | None) -> str:
    """``text`` with the characters ``encoding`` cannot represent written as escapes."""
    if not encoding:
        return text
    try:
        text.encode(encoding)
        return text
    except UnicodeEncodeError:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 page``, ``2 pages``, ``0 pages`` (``many`` when the plural is not ``word + "s"``)."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def show_id(seq_id: Any) -> str:
    """A sequence id for text output: ints bare, strings quoted (so 7 and '7' differ).

    The quoted form is a Python string literal (non-printable characters escaped),
    which ``inspect --seq`` accepts as it is shown.
    """
    return clean(str(seq_id) if isinstance(seq_id, int) else repr(seq_id))


def to_json(value: Any) -> str:
    """Indented JSON; ``ensure_ascii`` escapes every non-ASCII and control character."""
    return json.dumps(value, indent=2, ensure_ascii=True, allow_nan=False)


def nbytes(count: int | None) -> str:
    """Bytes in binary units (``4.0 MiB``)."""
    if count is None:
        return "?"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def num(value: float | None, digits: int = 3) -> str:
    """A float for a table cell (``-`` when there is none)."""
    return "-" if value is None else f"{value:.{digits}g}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces, with a dashed rule under the headers."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [headers, ["-" * w for w in widths], *rows]]
    return "\n".join(lines)


def pairs(items: list[tuple[str, str]]) -> str:
    """``label  value`` lines with the values aligned."""
    width = max(len(label) for label, _ in items)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in items)


def geometry_text(geom: dict[str, Any]) -> str:
    """One line describing a geometry dict."""
    return (f"{plural(geom['layers'], 'layer')} x {plural(geom['kv_heads'], 'kv head')} x "
            f"{geom['head_dim']} head_dim, {plural(geom['page_size'], 'token')}/page, {geom['dtype']}")


def rate_text(done: int, seconds: float, unit: str) -> str | None:
    """A progress bar's rate (``12.5 requests/s``); None before there is one to show."""
    if done <= 0 or seconds <= 0:
        return None
    return f"{done / seconds:,.1f} {unit}/s"


def shell_arg(path: str) -> str:
    """``path`` as one shell argument (quoted, after ``--`` when it starts with ``-``)."""
    quoted = shlex.quote(path)
    return f"-- {quoted}" if path.startswith("-") else quoted


# SGR colours of the map's states: free dim, resident green, shared cyan, pinned bold
# yellow, cached blue, orphan magenta.
_MAP_COLOURS = {".": "2", "#": "32", "S": "36", "P": "1;33", "c": "34", "o": "35"}


def _paint(text: str, color: bool) -> str:
    """A row of map characters, coloured run by run (only characters of the legend pass)."""
    text = "".join(ch if ch in _MAP_COLOURS else "?" for ch in text)
    if not color:
        return text
    out, start = [], 0
    for end in range(1, len(text) + 1):
        if end == len(text) or text[end] != text[start]:
            out.append(f"\x1b[{_MAP_COLOURS[text[start]]}m{text[start:end]}\x1b[0m")
            start = end
    return "".join(out)


def map_text(info: dict[str, Any], color: bool = False) -> str:
    """``pagedkv inspect --map``: the pool grid, its legend with counts, and a summary line.

    ``color`` adds ANSI colours to the grid and legend characters (the only escape
    sequences any command prints, and only on a terminal).
    """
    per_cell, slots, width = info["slots_per_cell"], info["slots"], info["width"]
    unit = "slot" if per_cell == 1 else f"{per_cell:,} slots (the state most of them are in)"
    lines = [clean(f"pool: {plural(slots, 'slot')}, one character = {unit}")]
    if per_cell > 1:
        lines.append(clean(f"too large to draw a slot per character: {len(info['rows'])} rows of {width} "
                           f"characters stand for {slots:,} slots"))
    lines += [f"{i * width * per_cell:>{MAP_GUTTER - 2}}  {_paint(row, color)}" for i, row in enumerate(info["rows"])]
    lines.append("")
    for ch, meaning in info["legend"].items():
        count = info["counts"][meaning.split(" ")[0]]
        share = 100 * count / slots if slots else 0.0
        lines.append(f"  {_paint(ch, color)}  " + clean(f"{meaning}: {count:,} ({share:.1f}%)"))
    counts = info["counts"]
    lines.append(clean("summary: " + ", ".join(f"{counts[name]:,} {name}" for name in counts)
                       + f" of {plural(slots, 'slot')}"))
    return "\n".join(lines)
