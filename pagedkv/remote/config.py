"""``RemoteConfig``: how a store reaches its shared remote tier (``pagedkv.open(..., remote=...)``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import PagedKVError
from .url import RemoteURL, parse_url
from ..storage.codecs import CODECS

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{0,64}$")


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """A Redis (or Valkey, or Redis Cluster) tier shared by stores on several hosts.

    Only ``url`` is required; ``pagedkv.open(path, remote="redis://...")`` is this
    with every default. The ``repr`` never shows a password.
    """

    url: str  # redis://, rediss://, unix://, redis+cluster:// (see pagedkv.remote.url)
    cluster: bool = False  # use the cluster client for a redis:// URL of seed nodes
    namespace: str = "default"  # stores share pages only within one namespace
    key_prefix: str = "pagedkv:"  # every key starts with it, so a shared Redis can hold other data
    connect_timeout: float = 0.05  # seconds to open a connection
    op_timeout: float = 0.05  # seconds a fetch waits on one socket read or write
    publish_timeout: float = 0.5  # seconds the publisher thread waits on one socket operation
    ttl: float | None = None  # seconds a published page lives (None: until Redis evicts it)
    queue_bytes: int = 256 << 20  # page bytes waiting to be published; past it pages are skipped
    publish_batch: int = 32  # pages per publish pipeline
    fetch_bytes: int = 64 << 20  # value bytes one fetch round trip may bring at most
    codec: str | None = None  # record codec: raw, int8, zstd (None: the store's spill codec)
    close_timeout: float = 2.0  # seconds close() waits for the queue to drain
    backoff_min: float = 0.1  # seconds before the first reconnect after a failure
    backoff_max: float = 5.0  # seconds between reconnects at most (doubling from backoff_min)
    password_env: str | None = "PAGEDKV_REMOTE_PASSWORD"  # read when the URL has no password
    publish: bool = True  # send this store's newly committed pages
    fetch: bool = True  # consult the tier in create(tokens=...) and lookup()

    def __post_init__(self) -> None:
        self.parsed()  # the URL must parse now, not at the first fetch
        if not _NAME.match(self.namespace) or not self.namespace:
            raise PagedKVError("remote namespace must be 1-64 characters of [A-Za-z0-9_.:-]")
        if not _NAME.match(self.key_prefix):
            raise PagedKVError("remote key_prefix must be at most 64 characters of [A-Za-z0-9_.:-]")
        for name in ("connect_timeout", "op_timeout", "publish_timeout", "close_timeout",
                     "backoff_min", "backoff_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise PagedKVError(f"remote {name} must be a positive number of seconds, got {value!r}")
        if self.backoff_max < self.backoff_min:
            raise PagedKVError("remote backoff_max must be >= backoff_min")
        if self.ttl is not None and (isinstance(self.ttl, bool) or not isinstance(self.ttl, (int, float))
                                     or not 0.001 <= self.ttl < 1e9):
            raise PagedKVError(f"remote ttl must be None or seconds in [0.001, 1e9), got {self.ttl!r}")
        for name in ("queue_bytes", "publish_batch", "fetch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PagedKVError(f"remote {name} must be a positive int, got {value!r}")
        if self.codec is not None and self.codec not in CODECS:
            raise PagedKVError(f"remote codec must be one of {CODECS} or None, got {self.codec!r}")

    def parsed(self) -> RemoteURL:
        """The URL parsed (the password read from ``password_env`` if the URL has none)."""
        return parse_url(self.url, self.password_env, self.cluster)

    @property
    def redacted_url(self) -> str:
        """The URL without its password: what logs, stats and ``inspect`` show."""
        return self.parsed().redacted

    def __repr__(self) -> str:
        return (f"RemoteConfig(url={self.redacted_url!r}, namespace={self.namespace!r}, "
                f"key_prefix={self.key_prefix!r}, op_timeout={self.op_timeout!r})")

    @classmethod
    def of(cls, remote: Any) -> RemoteConfig:
        """``remote`` as given to ``pagedkv.open``: a URL string or a ``RemoteConfig``."""
        if isinstance(remote, RemoteConfig):
            return remote
        if isinstance(remote, str):
            return cls(remote)
        raise PagedKVError(f"remote must be a URL string or a pagedkv.RemoteConfig, "
                           f"not {type(remote).__name__}")
