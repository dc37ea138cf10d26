"""What a step is: its sequences, their new tokens and ids, and, once planned, its outputs and pins."""

from __future__ import annotations

from collections import abc
from typing import Any, Mapping, cast

import numpy as np

from .core import StoreCore
from .errors import PagedKVError
from .pages.prefix import split_ids, step_token_ids
from .pages.sequence import PerSequence, SeqId, Sequence

NONE = np.zeros(0, np.int32)  # an empty slot array
# A step's outputs until it begins: shared, read-only (three allocations a step saved).
_NO_TABLES, _NO_SLOTS, _NO_LENS = np.empty((0, 0), np.int32), np.empty(0, np.int64), np.empty(0, np.int32)
for _empty in (_NO_TABLES, _NO_SLOTS, _NO_LENS):
    _empty.flags.writeable = False


class StepState:
    """What a step is: its sequences, new tokens and ids, and, once planned, its outputs and pins.

    ``Step`` (step.py) is the context manager over it; ``begin`` and ``end`` below
    fill and release it.
    """

    def __init__(self, store: StoreCore, new_tokens: PerSequence[int],
                 tokens: PerSequence[Any] | None = None) -> None:
        counts = parse_counts(new_tokens)
        tokens = tokens or {}
        if tokens and (not isinstance(tokens, abc.Mapping) or not tokens.keys() <= new_tokens.keys()):
            raise PagedKVError("step tokens= must map sequences of the step to their new token ids")
        counts_of = cast("Mapping[SeqId, int]", new_tokens)  # keys were checked against new_tokens just above
        self.seq_ids: list[SeqId] = list(new_tokens)
        self.decode = counts.count(1) == len(counts)  # one new token per sequence
        self._ids: dict[SeqId, np.ndarray] | None = {}
        self._ids_parts: tuple[list[SeqId], list[int], np.ndarray] | None = None
        # Every new token's id in row order, when each sequence of the step has its ids
        # and they come in the step's order (the vectorised path of a decode step).
        self.ordered_ids: np.ndarray | None = None
        self.has_ids = bool(tokens)
        if tokens:
            keys = list(tokens)
            lengths, flat = step_token_ids(tokens, counts_of, self.decode)
            self._ids, self._ids_parts = None, (keys, lengths, flat)
            if self.decode and keys == self.seq_ids:
                self.ordered_ids = flat  # one id per row
        self._store = store
        self.new_tokens = counts
        self.block_tables = _NO_TABLES
        self.slot_mapping = _NO_SLOTS
        self.seq_lens = _NO_LENS
        self._seqs: list[Sequence] = []
        self._undo: tuple[Any, ...] = ()  # lengths, pages, last pages, their fills (arrays or lists)
        self._held = NONE  # the slots of the step's existing pages, pinned (a slot per reference)
        self._extra: list[int] = []  # slots pinned one by one: new pages and copies
        self._keep_for: object | None = None  # the batch whose next step may take the pins over
        self.members: frozenset[Sequence] = frozenset()  # the sequences, while the step is active

    @property
    def token_ids(self) -> dict[SeqId, np.ndarray]:
        """The new tokens' ids per sequence (those the step was given), cut when first asked for."""
        if self._ids is None:
            assert self._ids_parts is not None
            self._ids = split_ids(*self._ids_parts)
        return self._ids

    def length_before(self, seq: Sequence) -> int:
        """The length ``seq`` (a member of this active step) had when the step began."""
        return int(self._undo[0][self._seqs.index(seq)])



def parse_counts(new_tokens: Any) -> list[int]:
    """Validate a step's mapping of sequence id -> new token count; return the counts."""
    # collections.abc, not typing: isinstance against typing's alias costs microseconds a step.
    if not (type(new_tokens) is dict or isinstance(new_tokens, abc.Mapping)) or not new_tokens:
        raise PagedKVError("step() takes a non-empty mapping of sequence id -> new token count")
    counts = list(new_tokens.values())
    if set(map(type, counts)) != {int} or min(counts) < 0:
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
                raise PagedKVError(f"new token counts must be ints >= 0, got {count!r}")
        counts = [int(count) for count in counts]
    return counts
