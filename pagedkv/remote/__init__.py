"""pagedkv's shared remote tier on Redis: stores on several hosts reuse each other's prompt pages.

``pagedkv.open(path, ..., model=..., remote="redis://host:6379/0")``; see
``RemoteConfig`` for every setting and the README's "Remote tier" for the guarantees.
redis-py (the ``redis`` extra) is imported only when a store opens with a tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import RemoteConfig
from .url import RemoteURL, parse_url

if TYPE_CHECKING:
    from ..store import KVStore
    from .tier import RemoteTier

__all__ = ["RemoteConfig", "RemoteURL", "attach", "parse_url"]


def attach(store: KVStore, remote: Any) -> RemoteTier:
    """The remote tier of an open ``store`` (``remote``: a URL or a ``RemoteConfig``)."""
    from .tier import attach as attach_tier

    return attach_tier(store, remote)
