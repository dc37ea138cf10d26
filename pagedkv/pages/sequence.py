"""A sequence: its id, its length in tokens and its block table of page rows."""

from __future__ import annotations

from typing import Mapping, TypeVar, Union

import msgpack
import numpy as np

from ..errors import PagedKVError

SeqId = Union[str, int]
# What a step is given per sequence. Mapping's key type is invariant, so a caller's
# dict[int, int] or dict[str, int] is not a Mapping[SeqId, int]: each is named.
_V = TypeVar("_V")
PerSequence = Union[Mapping[str, _V], Mapping[int, _V], Mapping[SeqId, _V]]
_MAX_ID_BYTES = 256


def seq_key(seq_id: SeqId) -> bytes:
    """Validate a sequence id and return its LMDB key (msgpack of the id)."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, (str, int)):
        raise PagedKVError(f"sequence id must be a str or an int, got {type(seq_id).__name__}")
    if isinstance(seq_id, int) and not -(1 << 63) <= seq_id < 1 << 63:
        raise PagedKVError("integer sequence id must fit in 64 bits")
    try:
        key: bytes = msgpack.packb(seq_id)
    except UnicodeEncodeError:
        raise PagedKVError("sequence id is not valid unicode") from None
    if len(key) > _MAX_ID_BYTES:
        raise PagedKVError(f"sequence id is longer than {_MAX_ID_BYTES} bytes")
    return key


class Sequence:
    """Block table of one sequence: ``pids[:npages]`` are its pages in logical order."""

    __slots__ = ("seq_id", "key", "pids", "npages", "length")

    def __init__(self, seq_id: SeqId, key: bytes, pids: np.ndarray | None = None, length: int = 0) -> None:
        self.seq_id = seq_id
        self.key = key
        self.pids = np.zeros(8, np.int32) if pids is None else pids
        self.npages = 0 if pids is None else len(pids)
        self.length = length

    @property
    def table(self) -> np.ndarray:
        """The page rows in logical order (a view; copy before keeping it)."""
        return self.pids[: self.npages]

    def push(self, pid: int) -> None:
        """Append one page to the block table."""
        if self.npages == len(self.pids):
            grown = np.zeros(max(8, len(self.pids) + len(self.pids) // 2), np.int32)
            grown[: self.npages] = self.pids[: self.npages]
            self.pids = grown
        self.pids[self.npages] = pid
        self.npages += 1
