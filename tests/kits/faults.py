"""Faults on purpose and what they leave: the I/O seam, store states, outcome tallies, /proc counters.

* ``Injector``: the I/O fault seam of ``pagedkv.faults`` as a counter that fails op k once
  or forever.
* ``disk_state`` / ``model_state``: what a store (or a model of one) reads back, in a form
  that compares with ``==``; ``ABSENT`` for no store.
* ``poisoned(store)``: whether a handle refuses work after an error (``StoreClosed``).
* ``Tally``: outcome counts plus the first examples of each.
* ``scales()`` / ``soak()``: the ``ci`` and ``soak`` sizes of a scalable test.
* /proc counters of this process: ``fd_count``, ``maps_count``, ``proc_status_kib``,
  ``reset_peak_rss``.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import StoreClosed, faults

from .model import Model

TYPED_IO = (pagedkv.StoreIOError, pagedkv.StoreFull)
ABSENT = "absent"
PROBE = "__poison_probe__"


class Injector:
    """Counts ``faults.io`` ops; fails op ``fail_at`` once, or it and every later op."""

    def __init__(self, fail_at: int | None = None, forever: bool = False, code: int = errno.EIO) -> None:
        self.fail_at = fail_at
        self.forever = forever
        self.code = code
        self.count = 0
        self.names: list[str] = []
        self.fired: tuple[int, str] | None = None

    def __call__(self, op: str) -> None:
        self.count += 1
        self.names.append(op)
        if self.fail_at is None or self.count < self.fail_at:
            return
        if self.count == self.fail_at or self.forever:
            if self.fired is None:
                self.fired = (self.count, op)
            raise OSError(self.code, f"injected {os.strerror(self.code)} at op {self.count} ({op})")

    def __enter__(self) -> Injector:
        faults.set_injector(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        faults.set_injector(None)


# -- states -------------------------------------------------------------------------------------


def disk_state(path: Path, check: bool = False) -> Any:
    """What a read-only open sees: ``{seq: (length, K bytes, V bytes)}``, or ``ABSENT``.

    With ``check``, ``store.check()`` must be clean too.
    """
    if not path.exists():
        return ABSENT
    store = pagedkv.open(path, readonly=True)
    try:
        if check:
            assert store.check() == [], store.check()
        out = {}
        for seq in store.sequences():
            k, v = store.read(seq)
            out[seq] = (store.length(seq), k.tobytes(), v.tobytes())
        return out
    finally:
        store.close()


def model_state(model: Model | None) -> Any:
    """What a store holding ``model`` reads back (``ABSENT`` for None), as ``disk_state`` gives it."""
    if model is None:
        return ABSENT
    out = {}
    for seq in model.segs:
        k, v = model.expected(seq)
        out[seq] = (model.lens[seq], k.tobytes(), v.tobytes())
    return out


def poisoned(store: pagedkv.KVStore) -> bool:
    """Whether the handle refuses work now (``StoreClosed``); abandons it either way."""
    try:
        store.create(PROBE)
        refused = False
    except StoreClosed:
        refused = True
    store._abandon()
    return refused


# -- outcomes and sizes -----------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcome counts plus the first few examples of each outcome."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, outcome: str, example: str = "") -> None:
        """Count one ``outcome`` (keeping ``example`` among the first five)."""
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if example and len(self.examples.setdefault(outcome, [])) < 5:
            self.examples[outcome].append(example)

    def add_result(self, result: Any, what: str, timeout: float) -> None:
        """Count how a forked check (a ``kits.child.ChildResult``) ended: its value when it
        answered, else its signal, its hang or how it failed."""
        if result.status == "ok":
            self.add(result.value, what)
        elif result.status == "signal":
            note = f" [{result.value}]" if result.value else ""
            self.add(f"SIGNAL {signal.Signals(result.signal).name}", what + note)
        elif result.status == "timeout":
            self.add(f"HANG > {timeout:.0f} s", what)
        else:
            self.add(f"child {result.status}", f"{what}: {str(result)[:300]}")

    def __str__(self) -> str:
        lines = [f"{name}: {count}" for name, count in sorted(self.counts.items())]
        for name, examples in sorted(self.examples.items()):
            lines += [f"  e.g. [{name}] {text}" for text in examples]
        return "\n".join(lines)


def soak() -> bool:
    """Whether this is a soak run (``PAGEDKV_SOAK=1``)."""
    return os.environ.get("PAGEDKV_SOAK", "") not in ("", "0")


def scales() -> list[Any]:
    """``ci`` and ``soak`` parameters for a scalable test: the soak variant is marked ``soak``
    and runs only with ``PAGEDKV_SOAK=1`` (``PAGEDKV_SOAK=1 pytest -m soak``), without a timeout."""
    return [
        pytest.param("ci", id="ci"),
        pytest.param("soak", id="soak", marks=[
            pytest.mark.soak, pytest.mark.timeout(0),
            pytest.mark.skipif(not soak(), reason="soak size: PAGEDKV_SOAK=1 pytest -m soak")]),
    ]


# -- /proc counters of this process -------------------------------------------------------------------


def fd_count() -> int:
    """Open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def maps_count(under: str | os.PathLike | None = None) -> int:
    """Mappings of this process; with ``under``, only those of files below that directory."""
    with open("/proc/self/maps", "rb") as fh:
        if under is None:
            return sum(1 for _ in fh)
        prefix = os.fsencode(os.path.realpath(under)) + b"/"
        return sum(1 for line in fh if line.rstrip(b"\n").split(b" ")[-1].startswith(prefix))


def proc_status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``...)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
