"""The committed LRU stamps: a base record and a log of deltas, so a commit writes what it stamped.

Format 3 keeps the slots' stamps (``PageTable.stamp``) in the ``meta`` database as

* ``lru``: the base, every slot's stamp (``<i8`` each, ``8 * pool_pages`` bytes), sealed;
* ``lru+`` followed by ``n`` as a big-endian u64, for ``n`` in ``first .. next-1``: the
  deltas, oldest first. Delta ``n`` holds the slots stamped between the commit before it
  and the commit that wrote it, with their stamps then: ``DELTA_DTYPE`` pairs (``<u8``
  slot, ``<i8`` stamp), slots distinct and ascending; sealed under its own key;
* ``lru_log: [first, next]`` in the ``state`` record (absent: ``[0, 0]``, as in format 2),
  naming exactly the deltas that exist.

The committed stamps are the base with the deltas applied in order. Each commit
writes the stamps written since the last one (``PageTable.stamped``) as one new
delta, unless the log would then hold more than ``MAX_DELTAS`` deltas or as many
bytes as the base (times ``MAX_LOG_SHARE``): then it writes the base again and
deletes every delta. A commit so costs what it stamped, plus the base at most
once per ``MAX_DELTAS`` commits or once the log has outgrown it; and it is still
one transaction with the rest of the commit, so a reopen sees exactly the last
commit's stamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..storage.metarecord import TAG_META, TRAILER, seal, unseal
from ..storage.schema import MAX_TICK

BASE_KEY = b"lru"
DELTA_PREFIX = b"lru+"
MAX_DELTAS = 1024  # deltas the log may hold before the base is rewritten (tests make it small)
MAX_LOG_SHARE = 1.0  # the log's bytes, as a share of the base's, at which the base is rewritten instead
DELTA_DTYPE = np.dtype([("slot", "<u8"), ("stamp", "<i8")])
_KEY_LEN = len(DELTA_PREFIX) + 8


@dataclass
class StampLog:
    """The committed log: deltas ``first .. next-1`` exist, ``nbytes`` their sealed values' bytes."""

    first: int = 0
    next: int = 0
    nbytes: int = 0
    based: bool = False  # whether the base record is committed

    @property
    def span(self) -> list[int]:
        """``[first, next]``, as the state record's ``lru_log`` holds it."""
        return [self.first, self.next]


@dataclass
class StampWrites:
    """What one commit writes of the stamps (``plan``), and the log it leaves once durable."""

    puts: list[tuple[bytes, bytes]] = field(default_factory=list)
    deletes: list[bytes] = field(default_factory=list)
    log: StampLog = field(default_factory=StampLog)


def delta_key(number: int) -> bytes:
    """The meta key of delta ``number``."""
    return DELTA_PREFIX + number.to_bytes(8, "big")


def is_delta_key(key: bytes) -> bool:
    """Whether a meta key belongs to the delta log (well-formed or not: the log's checks judge it)."""
    return key.startswith(DELTA_PREFIX)


def base_bytes(pool_pages: int) -> int:
    """Bytes of the sealed base value of a pool of ``pool_pages`` slots."""
    return 8 * pool_pages + TRAILER


def plan(log: StampLog, slots: np.ndarray, stamps: np.ndarray, seed: int, state: dict[str, Any]) -> StampWrites:
    """The stamp records of the commit being built; records the log it leaves in ``state["lru_log"]``.

    ``log`` is the committed log, ``slots`` the distinct slots stamped since
    (ascending), ``stamps`` every slot's stamp now. Nothing is written when no
    slot was stamped (and the base exists).
    """
    writes = StampWrites(log=StampLog(log.first, log.next, log.nbytes, log.based))
    if len(slots) or not log.based:
        size = DELTA_DTYPE.itemsize * len(slots) + TRAILER
        if not log.based or log.next - log.first + 1 > MAX_DELTAS \
                or log.nbytes + size >= MAX_LOG_SHARE * base_bytes(len(stamps)):
            writes.puts.append((BASE_KEY, seal(TAG_META, BASE_KEY, stamps.astype("<i8").tobytes(), seed)))
            writes.deletes = [delta_key(number) for number in range(log.first, log.next)]
            writes.log = StampLog(log.next, log.next, 0, True)
        else:
            body = np.empty(len(slots), DELTA_DTYPE)
            body["slot"] = slots
            body["stamp"] = stamps[slots]
            key = delta_key(log.next)
            writes.puts.append((key, seal(TAG_META, key, body.tobytes(), seed)))
            writes.log = StampLog(log.first, log.next + 1, log.nbytes + size, True)
    state["lru_log"] = writes.log.span
    return writes


def read_deltas(txn: Any, db: Any) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of ``db`` whose key has the delta prefix, in key order."""
    cursor = txn.cursor(db=db)
    found: list[tuple[bytes, bytes]] = []
    if cursor.set_range(DELTA_PREFIX):
        for key, value in cursor:
            if not bytes(key).startswith(DELTA_PREFIX):
                break
            found.append((bytes(key), bytes(value)))
    return found


def apply_deltas(stamps: np.ndarray | None, deltas: list[tuple[bytes, bytes]], span: list[int],
                 pool_pages: int, seed: int | None, damage: list[str]) -> tuple[np.ndarray | None, StampLog]:
    """The committed stamps: ``stamps`` (the base, or None) with ``deltas`` applied in order, and the log.

    Every delta is checked (key in ``span``, exactly ``span`` present, seal,
    size, slots in range and ascending, stamps in ``[0, MAX_TICK]``). On any
    damage the base is returned unchanged, each problem a line of ``damage``.
    ``seed`` is the store's, or None when its records carry no seal (format 1).
    """
    first, after = span
    log = StampLog(first, after, 0, stamps is not None)
    problems: list[str] = []
    bodies: list[bytes] = []
    outside = 0
    for key, value in deltas:
        number = int.from_bytes(key[len(DELTA_PREFIX):], "big") if len(key) == _KEY_LEN else -1
        if not first <= number < after:
            outside += 1
            if outside <= 20:
                problems.append(f"lru delta {key[len(DELTA_PREFIX):].hex()} lies outside the committed "
                                f"log [{first}, {after})")
            continue
        body = unseal(TAG_META, key, value, seed) if seed is not None else None
        problem = delta_problem(body, pool_pages)
        if problem is not None:
            problems.append(f"lru delta {number} {problem}")
        elif body is not None:
            bodies.append(body)
        log.nbytes += len(value)
    if len(deltas) - outside != after - first:
        problems.append(f"lru log [{first}, {after}) holds {len(deltas) - outside} of its "
                        f"{after - first} deltas")
    if stamps is None and after > first:
        problems.append("lru log holds deltas but its base record is missing")
    damage += problems
    if problems or stamps is None:
        return stamps, log
    applied = stamps.astype(np.int64)
    for body in bodies:
        pairs = np.frombuffer(body, DELTA_DTYPE)
        applied[pairs["slot"].astype(np.int64)] = pairs["stamp"]
    return applied, log


def delta_problem(body: bytes | None, pool_pages: int) -> str | None:
    """What is wrong with a delta's (unsealed) body, or None."""
    if body is None:
        return "fails its checksum"
    if not body or len(body) % DELTA_DTYPE.itemsize:
        return f"holds {len(body)} bytes, not a positive multiple of {DELTA_DTYPE.itemsize}"
    pairs = np.frombuffer(body, DELTA_DTYPE)
    slots, stamps = pairs["slot"], pairs["stamp"]
    if slots.max() >= pool_pages or (len(slots) > 1 and (slots[1:] <= slots[:-1]).any()):
        return f"names slots outside [0, {pool_pages}) or out of order"
    if stamps.min() < 0 or stamps.max() > MAX_TICK:
        return "holds a stamp outside [0, 2**62]"
    return None
