"""One engine step as a context manager: inside it, the step's pages are resident and pinned.

``stepplan.py`` plans and releases a step (``stepstate.py`` says what a step holds,
``stepgrow.py`` grows its rows); this module makes it an operation of
the store (locked, checked, I/O errors typed) and a ``with`` block.
"""

from __future__ import annotations

import threading
from typing import Any

from . import faults
from .core import StoreCore, _op
from .pages.sequence import PerSequence
from .stepplan import begin, end, pages_needed
from .stepstate import StepState, parse_counts


class Step(StepState):
    """A context manager over one scheduling step.

    Inside the ``with`` block the pages of every sequence in the step are
    resident and pinned. ``block_tables`` (int32, ``(num_seqs, max_pages)``, -1
    padded) index ``store.pool``; ``slot_mapping`` (int64, one entry per new
    token, ``slot * page_size + offset``) says where the engine writes each new
    token's K/V; ``seq_lens`` (int32) include the new tokens. Rows follow the
    order of the mapping given to ``KVStore.step``. If the block raises, the
    step's new tokens are rolled back.
    """

    def __enter__(self) -> Step:
        _enter_step(self._store, self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _exit_step(self._store, self, ok=exc_type is None)


@_op(write=True, keeps_pins=True)
def _enter_step(store: StoreCore, step: Step) -> None:
    """Begin ``step`` on ``store``: an operation of its own (locked, checked, I/O errors typed)."""
    begin(store, step)
    faults.crashpoint("step.after_begin")
    me = threading.get_ident()
    store._active_steps[me] = store._active_steps.get(me, 0) + 1
    store._stats.add("steps")
    store._stats.add("tokens_appended", sum(step.new_tokens))


def _exit_step(store: StoreCore, step: Step, ok: bool) -> None:
    """End ``step``: keep its tokens (``ok``) or roll them back, and wake a waiting commit."""
    with store._lock:
        me = threading.get_ident()
        try:
            end(store, step, ok)
            faults.crashpoint("step.after_end")
        finally:
            store._active_steps[me] -= 1
            if not store._active_steps[me]:
                del store._active_steps[me]
                if store._step_waiters and not store._active_steps:  # what the waiters wait for
                    store._no_steps.notify_all()


def fits(store: StoreCore, new_tokens: PerSequence[int]) -> bool:
    """``KVStore.can_step``: no sequence busy, and room for every page of the step at once."""
    counts = parse_counts(new_tokens)
    seqs = [store._seqs.find(seq_id) for seq_id in new_tokens]
    if any(not frozenset(seqs).isdisjoint(active.members) for active in store._seqs.busy.values()):
        return False
    return store._mgr.has_room(pages_needed(store, seqs, counts))
