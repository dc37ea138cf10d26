"""Field-by-field checks of the committed state and superblock records (untrusted input).

A record that passes its checksum can still be wrong (written by a buggy or
hostile program), and a field of the wrong type would otherwise escape later as
a bare ``TypeError`` or ``OverflowError`` from ``commit`` or ``close``. Each
function returns the problems found, one line each, so a reader can list them.
"""

from __future__ import annotations

import math
from typing import Any

MAX_UID = (1 << 63) - 1  # uids and counters stay well inside int64 and uint64 columns
MAX_TICK = 1 << 62  # LRU stamps: int64, with room to count up for centuries
DURABILITY = ("durable", "nosync", "volatile")
COUNTER_KEYS = ("prefix_queries", "prefix_query_tokens", "prefix_hit_tokens", "prefix_hit_pages",
                "evictions", "restores", "cache_drops")


def _int_in(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def state_problems(state: Any) -> list[str]:
    """What is wrong with a decoded ``state`` record ([] when every field is sound)."""
    if not isinstance(state, dict):
        return ["state record is not a map"]
    problems = []
    for key, value in state.items():
        if not isinstance(key, str):
            problems.append(f"state record has a key of type {type(key).__name__}")
        elif key == "next_uid" and not _int_in(value, 1, MAX_UID):
            problems.append(f"state next_uid {value!r} is not an int in [1, 2**63)")
        elif key in ("tick", "commits") and not _int_in(value, 0, MAX_TICK):
            problems.append(f"state {key} {value!r} is not an int in [0, 2**62]")
        elif key in COUNTER_KEYS and not _int_in(value, 0, MAX_UID):
            problems.append(f"state counter {key} {value!r} is not an int >= 0")
        elif key == "time" and not (type(value) in (int, float) and math.isfinite(value) and value >= 0):
            problems.append(f"state time {value!r} is not a finite number >= 0")
        elif key == "lru_log" and not (type(value) is list and len(value) == 2
                                       and all(_int_in(end, 0, MAX_UID) for end in value) and value[0] <= value[1]):
            problems.append(f"state lru_log {value!r} is not a pair of ints 0 <= first <= next < 2**63")
        elif key == "durability" and value not in DURABILITY:
            problems.append(f"state durability {value!r} is not one of {DURABILITY}")
    return problems


def superblock_problems(sb: dict[str, Any]) -> list[str]:
    """What is wrong with the optional fields of a decoded superblock."""
    problems = []
    if "salt" in sb and not (isinstance(sb["salt"], bytes) and len(sb["salt"]) <= 64):
        problems.append("superblock salt is not a byte string of at most 64 bytes")
    if "model" in sb and sb["model"] is not None and not isinstance(sb["model"], str):
        problems.append(f"superblock model is a {type(sb['model']).__name__}, not a str")
    created = sb.get("created", 0)
    if not (type(created) in (int, float) and math.isfinite(created) and created >= 0):
        problems.append("superblock creation time is not a finite number >= 0")
    if not _int_in(sb.get("pool_pages"), 1, (1 << 31) - 1):
        problems.append("superblock pool_pages is not an int in [1, 2**31)")
    return problems
