"""The old names of the remote-tier tests' helpers, until they import tests.kits themselves.

Re-exports only: the helpers live in ``tests.kits.content`` and ``tests.kits.store``.
"""

from __future__ import annotations

from tests.kits.content import kv, same_bits
from tests.kits.store import GEOM, engine_write

__all__ = ["GEOM", "engine_write", "kv", "same_bits"]
