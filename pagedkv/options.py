"""How a store is opened: ``StoreOptions``, and the counters a commit persists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .geometry import Geometry
from .storage.schema import COUNTER_KEYS, DURABILITY

__all__ = ["StoreOptions", "DURABILITY", "PERSISTED_COUNTERS"]
# Counters the commit adds to the persistent state record (cumulative over sessions).
PERSISTED_COUNTERS = COUNTER_KEYS


@dataclass
class StoreOptions:
    """How a store is opened (see ``pagedkv.open`` for each field's meaning)."""

    geometry: Geometry | None = None
    pool_pages: int | None = None
    durability: str = "durable"
    readonly: bool = False
    evict_batch: int = 64
    map_size: int | None = None
    model: str | None = None
    allow_model_change: bool = False
    spill_limit: int | None = None
    spill_codec: str = "raw"
    write_behind: bool = False
    remote: Any = None  # a pagedkv.RemoteConfig, or None: no remote tier
