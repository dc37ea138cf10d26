"""The Redis connection of a remote tier: bounded waits, failures classified, logged once, backed off.

Two redis-py clients share the URL: one for fetches (the caller's thread, short
timeouts) and one for the publisher thread (longer ones), so a slow publish never
holds a connection a fetch waits on. Every operation either returns its result or
returns None after counting the failure; nothing of redis-py escapes. After a
failure the role (fetch or publish) stays off for a backoff that doubles from
``backoff_min`` to ``backoff_max`` and resets on the next success; refusals of a
write (``OOM``, ``READONLY``) only stop publishing. The first failure of an outage
is logged once, with the URL and without its password; the recovery is logged too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from ..errors import MissingDependency
from .config import RemoteConfig
from .counters import Counters
from .url import redact

log = logging.getLogger("pagedkv.remote")
T = TypeVar("T")
FETCH, PUBLISH = "fetch", "publish"


def import_redis() -> Any:
    """The ``redis`` module, or ``MissingDependency`` naming the extra."""
    try:
        import redis
    except ImportError:
        raise MissingDependency("the remote tier needs redis-py: pip install 'pagedkv[redis]'") from None
    return redis


def classify(exc: BaseException) -> str:
    """A failure's kind: timeout, refused (the server said no), unreachable, or error."""
    redis = import_redis()
    errors = redis.exceptions
    if isinstance(exc, (errors.TimeoutError, TimeoutError)):
        return "timeout"
    refused = (errors.AuthenticationError, errors.AuthorizationError, errors.OutOfMemoryError,
               errors.ReadOnlyError, errors.NoPermissionError)
    if isinstance(exc, refused):
        return "refused"
    text = str(exc)
    if isinstance(exc, errors.ResponseError) and text.split(" ", 1)[0] in ("OOM", "READONLY", "NOAUTH",
                                                                           "WRONGPASS", "NOPERM"):
        return "refused"
    if isinstance(exc, (errors.ConnectionError, OSError, errors.RedisClusterException, errors.ClusterError)):
        return "unreachable"
    return "error"


def write_refusal(exc: BaseException) -> bool:
    """Whether the server refused a write only (full, or a replica): reads may go on."""
    errors = import_redis().exceptions
    if isinstance(exc, (errors.OutOfMemoryError, errors.ReadOnlyError)):
        return True
    return isinstance(exc, errors.ResponseError) and str(exc).split(" ", 1)[0] in ("OOM", "READONLY")


class _Health:
    """When a role may try again, and how long it waits after the next failure."""

    def __init__(self, backoff_min: float) -> None:
        self.down_until = 0.0
        self.backoff = backoff_min
        self.failing = False


class RemoteClient:
    """Pipelined GET / EXISTS / SET NX against one Redis or Redis Cluster, never raising."""

    def __init__(self, config: RemoteConfig, counters: Counters) -> None:
        import_redis()
        self.config = config
        self.url = config.parsed()
        self.counters = counters
        self._clients: dict[str, Any] = {}
        self._health = {FETCH: _Health(config.backoff_min), PUBLISH: _Health(config.backoff_min)}
        self._lock = threading.Lock()  # client creation and health across the two threads
        self._outage = False  # an outage was logged and its recovery not yet

    # -- operations ------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        """The values of ``keys`` in one pipelined round trip (None per absent key), or None on failure."""
        def run(client: Any) -> list[bytes | None]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return list(pipe.execute())

        return self._run(FETCH, run)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key exists, in one pipelined round trip, or None on failure."""
        def run(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(found) for found in pipe.execute()]

        return self._run(PUBLISH, run)

    def set_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool] | None:
        """``SET key value NX [PX ttl]`` for each item in one round trip: which were set, or None on failure."""
        ttl_ms = None if self.config.ttl is None else max(1, int(self.config.ttl * 1000))

        def run(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, nx=True, px=ttl_ms)
            return [bool(done) for done in pipe.execute()]

        return self._run(PUBLISH, run)

    def available(self, role: str) -> bool:
        """Whether ``role`` may try the server now (not inside a backoff)."""
        return time.monotonic() >= self._health[role].down_until

    def close(self) -> None:
        """Close every connection (what is queued is the tier's to drain first)."""
        with self._lock:
            clients, self._clients = self._clients, {}
        for client in clients.values():
            try:
                client.close()
            except Exception:  # closing a broken connection must not fail a store's close
                pass

    # -- machinery -------------------------------------------------------------
    def _run(self, role: str, fn: Callable[[Any], T]) -> T | None:
        health = self._health[role]
        if time.monotonic() < health.down_until:
            return None
        try:
            result = fn(self._client(role))
        except Exception as exc:  # redis-py, sockets, TLS: every failure is a miss, counted
            self._failed(role, exc)
            return None
        if health.failing:
            self._recovered(role)
        return result

    def _client(self, role: str) -> Any:
        with self._lock:
            client = self._clients.get(role)
            if client is None:
                client = self._clients[role] = self._connect(role)
            return client

    def _connect(self, role: str) -> Any:
        redis = import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        url, config = self.url, self.config
        timeout = config.op_timeout if role == FETCH else config.publish_timeout
        common: dict[str, Any] = dict(
            username=url.username, password=url.password, socket_timeout=timeout,
            socket_connect_timeout=config.connect_timeout, retry=Retry(NoBackoff(), 0),
            health_check_interval=0)
        if url.secure:
            common.update(ssl=True, **url.tls)
        if url.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            # A refused or unreachable node must fail this operation, not be retried for seconds.
            nodes = [ClusterNode(host, port) for host, port in url.hosts]  # type: ignore[no-untyped-call]
            return RedisCluster(startup_nodes=nodes,
                                require_full_coverage=False, **common)
        if url.unix_path is not None:
            common.pop("ssl", None)
            return redis.Redis(unix_socket_path=url.unix_path, db=url.db, **common)
        host, port = url.hosts[0]
        return redis.Redis(host=host, port=port, db=url.db, **common)

    def _failed(self, role: str, exc: BaseException) -> None:
        kind = classify(exc)
        counters = self.counters
        counters.add("remote_errors")
        if kind == "timeout":
            counters.add("remote_timeouts")
        elif kind == "refused":
            counters.add("remote_refused")
        roles = [PUBLISH] if write_refusal(exc) else [FETCH, PUBLISH]
        now = time.monotonic()
        with self._lock:
            for name in roles:
                health = self._health[name]
                health.down_until = max(health.down_until, now + health.backoff)
                health.backoff = min(health.backoff * 2, self.config.backoff_max)
                health.failing = True
            # The connection may hold half an answer: the next try starts a new one. A refused
            # write left it clean.
            broken = None if write_refusal(exc) else self._clients.pop(role, None)
            first = not self._outage
            self._outage = True
        if broken is not None:
            try:
                broken.close()
            except Exception:
                pass
        if first:
            message = redact(f"{type(exc).__name__}: {exc}", self.url.password)[:300]
            log.warning("remote tier %s: %s (%s); serving local-only, retrying with backoff "
                        "(%.2fs doubling to %.1fs)", self.url.redacted, kind, message,
                        self.config.backoff_min, self.config.backoff_max)

    def _recovered(self, role: str) -> None:
        with self._lock:
            health = self._health[role]
            health.failing = False
            health.backoff = self.config.backoff_min
            health.down_until = 0.0
            logged = self._outage and not any(h.failing for h in self._health.values())
            if logged:
                self._outage = False
        if logged:
            log.info("remote tier %s: reachable again", self.url.redacted)
