"""What both sides of the connector share in one process: the logger and the live writer handles.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the scheduler and the worker run in one
process, where pagedkv refuses a read-only handle beside the writer (LMDB cannot
open one environment twice in a process); the scheduler then takes its snapshot
from the worker's own handle, found here by the store's real path.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from ...store import KVStore

__all__ = ["log", "register_worker_store", "live_worker_store"]

log: logging.Logger  # vLLM's is a Logger with more methods, none of which this package calls
try:  # under vLLM's logger, so its handler and level (VLLM_LOGGING_LEVEL) apply to these lines too
    from vllm.logger import init_logger

    log = init_logger("vllm.pagedkv")
except Exception:  # pragma: no cover - vLLM is what imports this package
    log = logging.getLogger("pagedkv.integrations.vllm")

_LIVE: dict[str, "weakref.ref[KVStore]"] = {}
_LIVE_LOCK = threading.Lock()


def register_worker_store(path: str, store: KVStore) -> None:
    """Make ``store`` (the worker's writer) the one this process's scheduler side reads."""
    with _LIVE_LOCK:
        _LIVE[os.path.realpath(path)] = weakref.ref(store)


def live_worker_store(path: str) -> Any:
    """The open writer handle of the store at ``path`` in this process, or None."""
    with _LIVE_LOCK:
        ref = _LIVE.get(os.path.realpath(path))
    return ref() if ref is not None else None
