"""The sequences of one store handle: found by id, what the next commit writes of them, which are busy.

``Sequences`` is the one owner of that state. The store adds, drops and changes
sequences through it (each change bumps ``epoch``, which the step's reused batch
compares); a step registers itself in ``busy`` while it is active, so operations
on its sequences are refused and reads serve their length before the step.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from .errors import SequenceBusy, SequenceNotFound
from .pages.sequence import SeqId, Sequence, seq_key

__all__ = ["ActiveStep", "Sequences"]


class ActiveStep(Protocol):
    """What the store needs of a step while it is active (``pagedkv.Step`` is one)."""

    members: frozenset[Sequence]

    def length_before(self, seq: Sequence) -> int:
        """The length ``seq`` had when the step began (its new tokens are not written yet)."""
        ...


class Sequences(dict[SeqId, Sequence]):
    """Every sequence of a handle by id (a dict, for the hot paths), and their pending changes."""

    def __init__(self, loaded: Iterable[Sequence] = ()) -> None:
        super().__init__((seq.seq_id, seq) for seq in loaded)
        self.dirty: dict[bytes, Sequence] = {}  # block tables the next commit writes
        self.dropped: set[bytes] = set()  # keys of block tables the next commit deletes
        self.epoch = 0  # bumped by every block-table change outside a step
        self.batch: Any = None  # the last step's block table (see step.py)
        self.busy: dict[int, ActiveStep] = {}  # every active step (its sequences are ``members``)

    # -- finding -------------------------------------------------------------
    def find(self, seq_id: SeqId) -> Sequence:
        """The sequence ``seq_id`` names (a str or int subclass names the same one).

        Raises:
            SequenceNotFound; PagedKVError for an id that is not a str or an int.
        """
        seq = self.get(seq_id) if type(seq_id) is str or type(seq_id) is int else None
        if seq is None:
            seq_key(seq_id)  # a typed error for an id of the wrong kind
            if isinstance(seq_id, (str, int)):
                seq = self.get(str(seq_id) if isinstance(seq_id, str) else int(seq_id))
        if seq is None:
            raise SequenceNotFound(f"no sequence {seq_id!r}")
        return seq

    def idle(self, seq_id: SeqId) -> Sequence:
        """``find(seq_id)``, refused with ``SequenceBusy`` while it is part of an active step."""
        seq = self.find(seq_id)
        self.check_idle(frozenset((seq,)))
        return seq

    def check_idle(self, seqs: frozenset[Sequence]) -> None:
        """Raise ``SequenceBusy`` if any of ``seqs`` is part of an active step."""
        for step in self.busy.values():
            if not seqs.isdisjoint(step.members):
                busy = next(seq for seq in seqs if seq in step.members)
                raise SequenceBusy(f"sequence {busy.seq_id!r} is in an active step")

    def written(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V are written: an active step's new tokens count once it ends.

        Inside a step the engine has not necessarily written its tokens yet, and
        the slots it will write hold whatever a recycled page left there.
        """
        for step in self.busy.values():
            if seq in step.members:
                return step.length_before(seq)
        return seq.length

    # -- changing ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new sequence (created or forked); the next commit writes its block table."""
        self[seq.seq_id] = self.dirty[seq.key] = seq
        self.dropped.discard(seq.key)
        self.epoch += 1

    def changed(self, seq: Sequence) -> None:
        """``seq``'s block table or length changed outside a step; the next commit writes it."""
        self.dirty[seq.key] = seq
        self.epoch += 1

    def remove(self, seq: Sequence) -> None:
        """``seq`` is dropped; the next commit deletes its block table."""
        del self[seq.seq_id]
        self.dirty.pop(seq.key, None)
        self.dropped.add(seq.key)
        self.epoch += 1
