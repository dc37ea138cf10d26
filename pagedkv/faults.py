"""Test seams: named crash points, injectable I/O failures and a flush recorder.

All three cost one global lookup when unused. They exist so that the crash and
fault tests can drive the real code paths rather than mocks.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

_crash_name: str | None = None
_crash_at = 0
_hits: dict[str, int] = {}  # a plain dict: a Counter's += costs twice its get and set
_injector: Callable[[str], None] | None = None
_flush_recorder: Callable[[Any, int, int], None] | None = None


def _load_crashpoint() -> None:
    global _crash_name, _crash_at
    spec = os.environ.get("PAGEDKV_CRASHPOINT", "")
    name, _, count = spec.partition(":")
    _crash_name = name or None
    _crash_at = int(count) if count.isdigit() else 1


_load_crashpoint()


def crashpoint(name: str) -> None:
    """Kill this process with SIGKILL on the k-th hit of ``name`` (``PAGEDKV_CRASHPOINT=name:k``)."""
    count = _hits[name] = _hits.get(name, 0) + 1
    if count == _crash_at and name == _crash_name:
        os.kill(os.getpid(), signal.SIGKILL)


def hits() -> dict[str, int]:
    """How often each crash point has been passed in this process."""
    return dict(_hits)


def io(op: str) -> None:
    """Give an installed injector the chance to fail I/O operation ``op`` (raise OSError)."""
    if _injector is not None:
        _injector(op)


def set_injector(injector: Callable[[str], None] | None) -> None:
    """Install (or remove, with None) a callable that may raise OSError for an op name."""
    global _injector
    _injector = injector


def record_flush(target: Any, start: int, end: int) -> None:
    """Tell an installed recorder that bytes [start, end) of ``target`` are now durable."""
    if _flush_recorder is not None:
        _flush_recorder(target, start, end)


def set_flush_recorder(recorder: Callable[[Any, int, int], None] | None) -> None:
    """Install (or remove) the flush recorder used by simulated power-loss tests."""
    global _flush_recorder
    _flush_recorder = recorder
