"""The pool's least recently used slots, handed out in order: one scan serves many eviction batches.

Choosing a batch of victims by scanning every slot's stamp costs the pool, not
the batch: ~10 ms a batch on a million slots, 150 us an evicted page. Instead
one scan (``_rebuild``) keeps the oldest resident slots, sorted by stamp, with
the stamps they had (enough of them to hold ``_SPAN`` unpinned ones, and every
slot as old as those): every resident slot left out had a newer stamp, and a
stamp only grows (a use stamps the slot with a new tick, a page placed in a slot
takes a new tick too), so while a kept slot's stamp is unchanged nothing outside
is older. A kept slot whose stamp changed, or that holds no page now, is
dropped; one pinned now, or handed out, is held back ahead of the rest until a
later batch finds it unpinned, used or gone. The scan runs again when the kept
slots run out: at least ``_SPAN`` evictions (or a 64th of the resident slots)
after the last.
"""

from __future__ import annotations

import numpy as np

__all__ = ["OldestSlots"]

_SPAN = 1024  # slots kept per scan, at least

_EMPTY = np.zeros(0, np.int64)


class OldestSlots:
    """Resident slots oldest first, as of the last scan, checked against the slots' state at each ``take``."""

    __slots__ = ("_slots", "_stamps", "_at", "_back", "_back_stamps")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the kept slots (the next ``take`` scans): after the stamps were set wholesale."""
        self._slots, self._stamps, self._at = _EMPTY, _EMPTY, 0
        self._back, self._back_stamps = _EMPTY, _EMPTY  # kept slots found pinned: older than the rest

    def take(self, slot_pid: np.ndarray, stamp: np.ndarray, pins: np.ndarray, bg_pins: np.ndarray,
             count: int) -> np.ndarray:
        """Up to ``count`` resident slots that no step or background batch pins, least recently used first.

        Exactly the ``count`` oldest such slots (ties in stamp by slot number);
        fewer only when fewer exist. Slots handed out stay kept: the caller may
        leave some resident (they are then handed out again), and the others no
        longer pass the check.
        """
        if count <= 0:
            return _EMPTY
        picked: list[np.ndarray] = []
        seen: list[np.ndarray] = []  # the kept slots looked at and still valid, in order: held back
        seen_stamps: list[np.ndarray] = []
        tail, tail_stamps = _EMPTY, _EMPTY  # held-back slots not looked at (the picks came first)
        npicked, scanned, first, grow = 0, False, True, 1
        while True:
            need = count - npicked
            # Windows double: a run of pinned slots ahead costs its length, not its square.
            window = min(len(self._slots) - self._at, max(4 * need, 256) * grow)
            grow *= 2
            # The held-back slots come first, and once a call: pins do not change within it.
            head, head_stamps = (self._back, self._back_stamps) if first else (_EMPTY, _EMPTY)
            slots = np.concatenate([head, self._slots[self._at:self._at + window]])
            then = np.concatenate([head_stamps, self._stamps[self._at:self._at + window]])
            valid = (slot_pid[slots] >= 0) & (stamp[slots] == then)
            idle = valid & ((pins[slots] | bg_pins[slots]) == 0)
            picks = np.flatnonzero(idle)[:need]
            # Looked at: everything up to the last pick (all of it when the picks fall short).
            end = int(picks[-1]) + 1 if len(picks) == need else len(slots)
            seen.append(slots[:end][valid[:end]])
            seen_stamps.append(then[:end][valid[:end]])
            if first and end < len(head):
                tail, tail_stamps = head[end:], head_stamps[end:]
            self._at += max(0, end - len(head))
            first = False
            picked.append(slots[picks])
            npicked += len(picks)
            if npicked == count:
                break
            if self._at < len(self._slots):
                continue
            if scanned:  # a scan kept every unpinned slot: there are no more
                break
            # Scan again, keeping at least ``count`` unpinned slots, and start over from it:
            # the slots picked so far are among its oldest.
            self._rebuild(slot_pid, stamp, pins, bg_pins, count)
            picked, seen, seen_stamps, npicked, scanned, first, grow = [], [], [], 0, True, True, 1
        self._back = np.concatenate([*seen, tail])
        self._back_stamps = np.concatenate([*seen_stamps, tail_stamps])
        return np.concatenate(picked)

    def _rebuild(self, slot_pid: np.ndarray, stamp: np.ndarray, pins: np.ndarray, bg_pins: np.ndarray,
                 count: int) -> None:
        """Keep the oldest resident slots: at least ``count`` (and ``_SPAN``) unpinned ones, and every
        resident slot, pinned or not, no newer than the newest of those (ties included)."""
        resident = np.flatnonzero(slot_pid >= 0)
        stamps = stamp[resident]
        idle = stamps[(pins[resident] | bg_pins[resident]) == 0]
        span = max(_SPAN, count, len(resident) // 64)
        if len(idle) > span:
            newest = idle[np.argpartition(idle, span - 1)[span - 1]]
            keep = stamps <= newest  # no slot left out is as old as one kept
            resident, stamps = resident[keep], stamps[keep]
        order = np.argsort(stamps, kind="stable")  # ties by slot number
        self.reset()
        self._slots, self._stamps = resident[order], stamps[order]
