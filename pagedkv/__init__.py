"""pagedkv: a persistent, paged KV-cache store for LLM inference."""

from __future__ import annotations

import logging

from .errors import (FormatVersionError, GeometryMismatch, MissingDependency, ModelMismatch, PageCorrupt,
                     PagedKVError, PoolExhausted, ReadOnlyStore, SequenceBusy, SequenceExists,
                     SequenceNotFound, StoreClosed, StoreCorrupt, StoreFull, StoreIOError, StoreLocked)
from .check import Problem
from .describe import CommitInfo, PageContent, PageInfo, PageNotFound, SequenceInfo, SpillInfo, StoreSummary
from .geometry import PRESETS, Geometry
from .opening import open_store as open
from .background.prefetch import Prefetch
from .remote import RemoteConfig
from .stats import CacheDrop, StoreStats
from .step import Step
from .store import KVStore

__version__ = "0.1.0"

# Silent unless the application configures logging: the library's records go nowhere by default.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "open", "Geometry", "PRESETS", "KVStore", "Step", "PagedKVError", "SequenceNotFound",
    "SequenceExists", "SequenceBusy", "PoolExhausted", "StoreLocked", "StoreCorrupt", "PageCorrupt",
    "GeometryMismatch", "ModelMismatch", "StoreFull", "StoreIOError", "StoreClosed", "ReadOnlyStore",
    "FormatVersionError", "MissingDependency", "Problem", "Prefetch", "StoreStats", "CacheDrop", "RemoteConfig",
    "StoreSummary", "PageInfo", "SequenceInfo", "PageContent", "SpillInfo", "CommitInfo", "PageNotFound",
    "__version__",
]
