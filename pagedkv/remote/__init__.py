"""pagedkv's shared remote tier on Redis: stores on several hosts reuse each other's prompt pages.

``pagedkv.open(path, ..., model=..., remote="redis://host:6379/0")``; see
``RemoteConfig`` for every setting and the README's "Remote tier" for the guarantees.
redis-py (the ``redis`` extra) is imported only when a store opens with a tier.
"""

from __future__ import annotations

from .config import RemoteConfig
from .url import RemoteURL, parse_url

__all__ = ["RemoteConfig", "RemoteURL", "parse_url"]

