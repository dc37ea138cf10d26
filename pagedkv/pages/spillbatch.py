"""A spill batch: the pages one LMDB transaction spills, and what else a foreground batch writes.

``Spilled`` is one page of a batch as its planner saw it, with what the
transaction wrote for it. Both planners build them: the foreground's
(``evict.py``), under the store lock from plan to commit, and write-behind's
(``background/writebehind.py``), which plans under the lock, writes off it and
lands later. ``evict.apply_spilled`` brings the page table in line with either.

``Plan`` is the rest of a foreground batch: the puts and deletes of its
transaction, the records it removes and the cache pages it drops. The spill cap
(``spillcap.py``) edits a plan before it is written.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Plan", "Spilled"]


class Spilled(NamedTuple):
    """One page a spill transaction wrote, and the page table's facts about it when it was planned.

    The machine-int fields come first: the applier converts a batch of them in one go.
    """

    slot: int  # the slot its bytes were read from
    pid: int  # its row
    gen: int  # its write generation then: a page written since is not the one spilled
    nbytes: int  # the size of the record written for it; -1: its current record was kept
    codec: int  # codec index of that record (for a kept one, the page's codec column)
    entry: bool  # the transaction rewrote its committed directory entry to SPILLED
    uid: int  # its uid then: a row freed and reused since holds another page
    csum: int | None  # checksum of the content spilled, if the page's own may differ; None: it is that
    c_csum: int | None  # its new committed checksum, with the entry (a lossy record's); None: unchanged


class Plan:
    """What one foreground eviction transaction writes, deletes and frees."""

    def __init__(self) -> None:
        self.puts: list[tuple[Any, bytes, bytes | bytearray]] = []  # (database, key, value)
        self.deletes: list[tuple[Any, bytes]] = []  # (database, key)
        self.spilled: list[Spilled] = []  # the victims still in the batch
        self.dropped: list[int] = []  # cache-only pages the transaction forgets
        self.repointed: list[int] = []  # resident pages whose redundant record goes
        self.added = 0  # record bytes the transaction writes
        self.removed = 0  # record bytes it deletes or overwrites
