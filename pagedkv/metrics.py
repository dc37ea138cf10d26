"""Prometheus metrics of a store: ``stats()`` in the text exposition format, or as a collector.

``prometheus_text(store)`` needs nothing beyond pagedkv; ``register(store)`` adds a
collector to a ``prometheus_client`` registry (``pip install "pagedkv[prometheus]"``),
which reads ``stats()`` afresh on every scrape. Both come from one table, so the
names are the same either way:

* every counter of ``stats()`` is ``pagedkv_<name>_total`` (a counter, since this handle
  opened: a reopen starts it from zero, which Prometheus' ``rate()`` takes as a reset);
* the rest are gauges ``pagedkv_<name>``, except the restore latency, in seconds as
  Prometheus wants (``pagedkv_restore_latency_seconds{quantile="0.5"|"0.99"}`` and
  ``pagedkv_restore_latency_mean_seconds``), and the per-codec figures
  (``pagedkv_spill_codec_pages|bytes|ratio{codec="raw"|"int8"|"zstd"}``).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Iterator, Mapping, NamedTuple

from .errors import MissingDependency, PagedKVError, StoreClosed
from .remote.counters import HELP as REMOTE_HELP
from .storage.codecs import CODECS
from .stats import COUNTERS, StoreStats

if TYPE_CHECKING:
    from .store import KVStore

__all__ = ["prometheus_text", "register"]

_HELP = {
    "resident_hits": "Pages found resident when an operation needed them.",
    "spill_hits": "Pages served from a spill record.",
    "misses": "Pages that failed their checksum.",
    "evictions": "Pages spilled (or dropped) to free pool slots.",
    "restores": "Pages restored from spill on demand.",
    "bytes_spilled": "Record bytes written by evictions.",
    "bytes_restored": "Record bytes read by restores.",
    "evict_batches": "Eviction transactions.",
    "commits": "Commits.",
    "tokens_appended": "Tokens appended (append and step).",
    "tokens_read": "Tokens read back.",
    "steps": "Steps taken.",
    "pages_allocated": "Pages allocated.",
    "cow_copies": "Copy-on-write copies of shared pages.",
    "cache_drops": "Cache-only pages dropped (spill cap, clear_cache).",
    "prefix_queries": "create(tokens=...) calls.",
    "prefix_query_tokens": "Prompt tokens create(tokens=...) asked about.",
    "prefix_hit_tokens": "Prompt tokens reused from the prefix cache.",
    "prefix_hit_pages": "Pages shared from the prefix cache.",
    "prefetch_restores": "Pages restored ahead of use by prefetch().",
    "background_evictions": "Pages spilled by write-behind.",
    "pool_pages": "Pool slots.",
    "pool_used": "Pool slots holding a page.",
    "pool_free": "Pool slots free now.",
    "pool_pending": "Pool slots freed since the last commit, held for its committed bytes.",
    "pool_pinned": "Pool slots pinned by active steps.",
    "spilled_pages": "Pages in spill only.",
    "pages": "Live pages, resident or spilled.",
    "sequences": "Sequences.",
    "tokens": "Tokens of every sequence.",
    "shared_pages": "Pages referenced more than once.",
    "cached_pages": "Cache-only pages kept for prefix reuse.",
    "cached_bytes": "Bytes of the spill records of cache-only pages.",
    "spill_bytes": "Bytes of every page record in the spill store.",
    "prefix_hit_rate": "Share of queried prompt tokens served from the prefix cache.",
}
_HELP.update(REMOTE_HELP)  # the remote tier's counters and gauges
_CODEC_HELP = {
    "pages": "Pages whose spill record is in this codec.",
    "bytes": "Bytes of the spill records in this codec.",
    "ratio": "Page bytes per record byte in this codec (0 without records).",
}
_QUANTILES = (("p50", "0.5"), ("p99", "0.99"))
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_OWN_LABELS = {"quantile", "codec"}


class _Family(NamedTuple):
    """One metric family: ``name`` as written (a counter's with ``_total``), its samples."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]]  # (labels of its own, value)


def _families(stats: StoreStats) -> list[_Family]:
    """Every ``stats()`` figure, once, in its family (the single table both outputs use)."""
    figures: Mapping[str, Any] = stats
    out = [_Family(f"pagedkv_{name}_total", "counter", _HELP[name], [({}, figures[name])])
           for name in COUNTERS]
    out.append(_Family("pagedkv_restore_latency_seconds", "gauge",
                       "Page restore latency over the last 16,384 restores (0 before any).",
                       [({"quantile": q}, figures[f"restore_ms_{p}"] / 1000) for p, q in _QUANTILES]))
    out.append(_Family("pagedkv_restore_latency_mean_seconds", "gauge",
                       "Mean page restore latency over the last 16,384 restores (0 before any).",
                       [({}, figures["restore_ms_mean"] / 1000)]))
    for name, doc in _HELP.items():
        if name not in COUNTERS:
            out.append(_Family(f"pagedkv_{name}", "gauge", doc, [({}, figures[name])]))
    for what, doc in _CODEC_HELP.items():
        out.append(_Family(f"pagedkv_spill_codec_{what}", "gauge", doc,
                           [({"codec": codec}, figures[f"codec_{codec}_{what}"]) for codec in CODECS]))
    return out


def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    if labels is None:
        return {}
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__") \
                or name in _OWN_LABELS:
            raise PagedKVError(f"invalid metric label name {name!r} (quantile and codec are pagedkv's own)")
        if not isinstance(value, str):
            raise PagedKVError(f"metric label {name!r} must have a str value, got {type(value).__name__}")
    return dict(labels)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(value: float) -> str:
    """A sample value as the text format writes it: ints exactly, floats round-tripping."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def prometheus_text(store: KVStore, labels: Mapping[str, str] | None = None) -> str:
    """The store's ``stats()`` in Prometheus' text exposition format (version 0.0.4).

    Each family has its ``# HELP`` and ``# TYPE`` lines; counters are named
    ``pagedkv_<stat>_total``, gauges ``pagedkv_<stat>`` (see the module's
    docstring for the latency and per-codec families). Serve it as
    ``text/plain; version=0.0.4``.

    Params:
        labels: constant labels added to every sample (say ``{"store": "main"}``,
            to tell several stores apart); names may not be ``quantile`` or ``codec``.
    Returns:
        the exposition text, ending in a newline.
    Raises:
        StoreClosed, PagedKVError (an invalid label).
    """
    extra = _check_labels(labels)
    lines = []
    for family in _families(store.stats()):
        lines.append(f"# HELP {family.name} {family.help}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for own, value in family.samples:
            pairs = {**extra, **own}
            text = ",".join(f'{name}="{_escape(val)}"' for name, val in pairs.items())
            lines.append(f"{family.name}{{{text}}} {_value(value)}" if text else f"{family.name} {_value(value)}")
    return "\n".join(lines) + "\n"


class _Collector:
    """A ``prometheus_client`` collector reading one store's ``stats()`` on every scrape."""

    def __init__(self, store: KVStore, labels: dict[str, str]) -> None:
        self._store = store
        self._labels = labels

    def collect(self) -> Iterator[Any]:
        """The metric families of a scrape; none once the store is closed."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            stats = self._store.stats()
        except StoreClosed:
            return
        for family in _families(stats):
            names = list(self._labels) + (list(family.samples[0][0]) if family.samples else [])
            if family.kind == "counter":
                metric: Any = CounterMetricFamily(family.name[:-len("_total")], family.help, labels=names)
            else:
                metric = GaugeMetricFamily(family.name, family.help, labels=names)
            for own, value in family.samples:
                metric.add_metric([*self._labels.values(), *own.values()], value)
            yield metric


def register(store: KVStore, registry: Any = None, labels: Mapping[str, str] | None = None) -> Any:
    """Register a collector of ``store``'s stats with ``prometheus_client``; return it.

    The collector reads ``stats()`` on every scrape (taking the store's lock for
    that moment) and yields nothing once the store is closed, so a registry that
    outlives a store keeps working. ``registry.unregister(collector)`` removes it.

    Params:
        registry: a ``prometheus_client.CollectorRegistry``; None is the default
            ``prometheus_client.REGISTRY``.
        labels: constant labels on every sample, as in ``prometheus_text``; needed
            to register several stores in one registry.
    Returns:
        the collector.
    Raises:
        MissingDependency (an ``ImportError`` too) if prometheus_client is not
        installed; PagedKVError (an invalid label); ValueError from
        prometheus_client if the registry already holds these series.
    """
    extra = _check_labels(labels)
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependency('pagedkv.metrics.register needs prometheus_client: '
                                'pip install "pagedkv[prometheus]" (or prometheus_client)') from None
    collector = _Collector(store, extra)
    (prometheus_client.REGISTRY if registry is None else registry).register(collector)
    return collector
