"""What a background thread may use of its store: a small, explicit surface.

The prefetch and write-behind threads run beside the foreground operations of
one handle. They need its lock, its block manager, the block tables of some
sequences, the spill store's transactions and a few health checks, and nothing
else; ``BackgroundHost`` names exactly that. The store handle (``StoreCore`` in
core.py) implements it and owns every piece of state behind it, so a thread can
neither keep a second copy of the handle's health nor poison it any other way
than the foreground does. Nothing here imports the store, so the host sits below
it with no import cycle.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Protocol, TypeVar

import numpy as np

from ..pages.manager import BlockManager
from ..pages.sequence import SeqId

__all__ = ["BackgroundHost"]

T = TypeVar("T")


class BackgroundHost(Protocol):
    """The store as a background thread sees it.

    Take ``lock`` to pick work and to land it; everything the manager and the
    tables hold may change whenever the lock is not held. I/O (the spill
    transactions) runs off the lock.
    """

    @property
    def path(self) -> str:
        """The store's directory, for log lines."""
        ...

    @property
    def lock(self) -> threading.RLock:
        """The store lock every foreground operation holds."""
        ...

    @property
    def manager(self) -> BlockManager:
        """The block manager as of now (a read-only handle replaces it on refresh); under the lock."""
        ...

    @property
    def readonly(self) -> bool:
        """Whether the handle was opened read-only (it writes nothing, background work included)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the handle is closed or gone: background work stops and lands nothing."""
        ...

    @property
    def poisoned(self) -> bool:
        """Whether an I/O failure stopped the handle's writes (reads still work)."""
        ...

    def poison(self, reason: str) -> None:
        """Stop the handle's writes after a background I/O failure, as a foreground failure does.

        The next writing operation raises ``StoreClosed`` naming ``reason``; the
        last commit is intact. Takes the store lock (re-entrant).
        """
        ...

    def tables(self, seq_ids: Iterable[SeqId]) -> list[np.ndarray]:
        """The block tables (page rows) of those of ``seq_ids`` that still exist, under the lock.

        Views into the sequences: copy what is kept past the lock.
        """
        ...

    def place(self, pid: int, slot: int) -> None:
        """Record that page ``pid``, restored from spill into ``slot``, now lives there; under the lock."""
        ...

    def read_transaction(self) -> AbstractContextManager[Any]:
        """A spill read transaction safe beside other threads (map growth waits for it to end)."""
        ...

    def write_transaction(self, body: Callable[[Any], T], what: str) -> T:
        """Run ``body`` in one spill write transaction (serialised with every other writer).

        ``body`` may run more than once, after the map grew, so it only issues
        puts and deletes computed beforehand. ``what`` names the work in errors.
        """
        ...
