"""Pins: which pool slots a step, a read or a kept batch is using, so that no eviction takes them.

A slot's pin count is in ``pins`` (one per reference: a batch's shared page is
pinned once per sequence). Every pin goes through ``pin``/``unpin`` (or their
one-slot forms), which also keep ``pin_refs``, the sum of the counts: at least
``pool_pages - pin_refs`` slots are unpinned, so ``has_room`` answers without
counting the pool's slots until the pins held come near its size (a step then
costs that much anyway). The pins a batch's last step left for its next one
are ``kept`` (``keep_pins``); any other operation gives them back first.
"""

from __future__ import annotations

import numpy as np

from .directory import ONE

__all__ = ["SlotPins"]


class SlotPins:
    """The pool's pins (a base of ``PageTable``, which sets them up with ``_init_pins``)."""

    pool_pages: int

    def _init_pins(self, pool_pages: int) -> None:
        self.pins = np.zeros(pool_pages, np.int32)  # active steps and reads using it: not evictable
        self.pin_refs = 0  # every pin held, once per reference: the sum of pins
        # Pins the last step of a batch left in place for its next step (keep_pins): the
        # next operation of any other kind gives them back first (release_kept).
        self.kept = np.zeros(0, np.int32)
        self.kept_for: object | None = None  # the batch they were kept for

    def keep_pins(self, slots: np.ndarray, owner: object) -> None:
        """Leave ``slots`` (each pinned once per entry) pinned after their step, for ``owner``'s next step.

        A batch's next decode step pins the same slots again, and unpinning and
        pinning them all was a tenth of such a step.
        """
        self.release_kept()
        self.kept, self.kept_for = slots, owner

    def release_kept(self) -> None:
        """Unpin what ``keep_pins`` left pinned (nothing if nothing is kept)."""
        if len(self.kept):
            self.unpin(self.kept)
            self.kept = self.kept[:0]
        self.kept_for = None

    def pin(self, slots: np.ndarray | list[int]) -> None:
        """Pin each of ``slots`` once per entry (a slot may repeat: pages shared by a batch)."""
        np.add.at(self.pins, slots, ONE)
        self.pin_refs += len(slots)

    def unpin(self, slots: np.ndarray | list[int]) -> None:
        """Give back pins ``pin`` took (the same entries)."""
        np.subtract.at(self.pins, slots, ONE)
        self.pin_refs -= len(slots)

    def pin_slot(self, slot: int) -> None:
        """``pin`` for one slot."""
        self.pins[slot] += 1
        self.pin_refs += 1

    def unpin_slot(self, slot: int) -> None:
        """``unpin`` for one slot."""
        self.pins[slot] -= 1
        self.pin_refs -= 1

    def available(self) -> int:
        """How many slots are free or could be freed now (not pinned): a scan of every slot's pins."""
        return int(self.pool_pages - np.count_nonzero(self.pins))

    def has_room(self, count: int) -> bool:
        """Whether ``count`` slots are unpinned (``available() >= count``), without a scan where it can.

        ``pin_refs`` counts a slot pinned twice twice, so at least ``pool_pages -
        pin_refs`` slots are unpinned: only when the pins held come near the pool's
        size (a step then costs that much anyway) are the slots counted.
        """
        return count <= self.pool_pages - self.pin_refs or count <= self.available()

    def unpinned_at_least(self) -> int:
        """A count of unpinned slots that is exact or low (``available()`` where the cheap bound is 0)."""
        bound = self.pool_pages - self.pin_refs
        return bound if bound > 0 else self.available()
