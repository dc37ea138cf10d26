"""``pagedkv.metrics``: the stats in Prometheus' text exposition format, and a prometheus_client collector.

The text is parsed twice: by a strict little parser here (every sample after its family's
HELP and TYPE, counters named ``*_total``, one value per series) and, where it is
installed, by prometheus_client's own parser. Every ``stats()`` figure must come out
with its value.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import typing
from typing import Any

import pytest

import pagedkv
from pagedkv import PagedKVError, metrics

from tests.kits.model import Model, busy_store
from tests.kits.store import GEOM



PS = GEOM.page_size
HAVE_CLIENT = importlib.util.find_spec("prometheus_client") is not None
needs_client = pytest.mark.skipif(not HAVE_CLIENT, reason="prometheus_client is not installed")

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """(family name -> type, (sample name, labels) -> value), checking the format as it goes."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name) and doc, line
            assert name not in helps, f"HELP twice for {name}"
            helps.add(name)
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and name not in types, line
            assert kind in ("counter", "gauge"), line
            types[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, raw_labels, value = match.groups()
            assert name == current and name in types, f"{name} outside its family ({current})"
            if types[name] == "counter":
                assert name.endswith("_total"), name
            labels = []
            if raw_labels:
                pos = 0
                while pos < len(raw_labels):
                    label = _LABEL.match(raw_labels, pos)
                    assert label, f"bad labels in {line!r}"
                    labels.append((label.group(1), label.group(2).replace('\\"', '"').replace("\\n", "\n")
                                   .replace("\\\\", "\\")))
                    pos = label.end()
            key = (name, tuple(sorted(labels)))
            assert key not in samples, f"series twice: {key}"
            samples[key] = float(value)
    assert set(types) == helps
    return types, samples


def expected_series(stats: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Where each stats() figure must appear, and with which value."""
    from pagedkv.storage.codecs import CODECS
    from pagedkv.stats import COUNTERS

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for key in typing.get_type_hints(pagedkv.StoreStats):
        value = float(stats[key])
        codec = next((c for c in CODECS if key.startswith(f"codec_{c}_")), None)
        if key in COUNTERS:
            out[(f"pagedkv_{key}_total", ())] = value
        elif key.startswith("restore_ms_"):
            which = key[len("restore_ms_"):]
            if which == "mean":
                out[("pagedkv_restore_latency_mean_seconds", ())] = value / 1000
            else:
                quantile = {"p50": "0.5", "p99": "0.99"}[which]
                out[("pagedkv_restore_latency_seconds", (("quantile", quantile),))] = value / 1000
        elif codec is not None:
            what = key[len(f"codec_{codec}_"):]
            out[(f"pagedkv_spill_codec_{what}", (("codec", codec),))] = value
        else:
            out[(f"pagedkv_{key}", ())] = value
    return out


def test_text_holds_every_stat_with_help_and_type(stores, seed) -> None:
    store = busy_store(stores, seed, spill_codec="zstd")
    text = metrics.prometheus_text(store)
    stats = store.stats()  # nothing ran in between: the same figures
    types, samples = parse(text)
    want = expected_series(stats)
    assert set(samples) == set(want), (sorted(set(want) - set(samples)), sorted(set(samples) - set(want)))
    for key, value in want.items():
        assert samples[key] == pytest.approx(value, rel=1e-12, abs=0), key
    assert types["pagedkv_evictions_total"] == "counter" and samples[("pagedkv_evictions_total", ())] > 0
    assert types["pagedkv_pool_used"] == "gauge"
    assert types["pagedkv_restore_latency_seconds"] == "gauge"
    assert samples[("pagedkv_spill_codec_ratio", (("codec", "zstd"),))] > 1.0
    assert "\n\n" not in text


def test_text_with_constant_labels_is_escaped(stores, seed) -> None:
    store = busy_store(stores, seed, spill_codec="zstd")
    awkward = 'kv "main"\\\nsecond line'
    _, samples = parse(metrics.prometheus_text(store, labels={"store": awkward, "zone": "a"}))
    assert samples
    for (_, labels), _value in samples.items():
        assert ("store", awkward) in labels and ("zone", "a") in labels
    for bad in ({"1store": "x"}, {"__reserved": "x"}, {"quantile": "x"}, {"codec": "x"}, {"ok": 3}):
        with pytest.raises(PagedKVError, match="label"):
            metrics.prometheus_text(store, labels=bad)  # type: ignore[arg-type]


def test_text_of_a_closed_store_is_store_closed(stores) -> None:
    store = stores.open()
    store.close()
    with pytest.raises(pagedkv.StoreClosed):
        metrics.prometheus_text(store)


@needs_client
def test_prometheus_client_parses_the_text(stores, seed) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    store = busy_store(stores, seed, spill_codec="zstd")
    text = metrics.prometheus_text(store, labels={"store": "s1"})
    stats = store.stats()
    want = expected_series(stats)
    got = {}
    kinds = {}
    for family in text_string_to_metric_families(text):
        kinds[family.name] = family.type
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("store") == "s1"
            got[(sample.name, tuple(sorted(labels.items())))] = sample.value
    assert got == pytest.approx(want)
    assert kinds["pagedkv_evictions"] == "counter" and kinds["pagedkv_pool_used"] == "gauge"


@needs_client
def test_register_scrapes_live_figures(stores, seed) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    store = busy_store(stores, seed, spill_codec="zstd")
    other = stores.open("other")
    registry = CollectorRegistry()
    collector = metrics.register(store, registry, labels={"store": "one"})
    metrics.register(other, registry, labels={"store": "two"})
    first = scrape(registry)
    evictions = first[("pagedkv_evictions_total", (("store", "one"),))]
    assert evictions == store.stats()["evictions"] > 0
    assert first[("pagedkv_sequences", (("store", "two"),))] == 0
    other.create("x")
    store.create("more")
    fresh = Model(seed)
    fresh.create("more")
    store.append("more", *fresh.next_kv("more", 4 * PS))  # evicts more
    second = scrape(registry)
    assert second[("pagedkv_evictions_total", (("store", "one"),))] > evictions
    assert second[("pagedkv_sequences", (("store", "two"),))] == 1
    other.close()  # a closed store drops out of the scrape; the rest still works
    third = scrape(registry)
    assert not [key for key in third if ("store", "two") in key[1]]
    assert third[("pagedkv_sequences", (("store", "one"),))] == 5
    registry.unregister(collector)
    assert not [key for key in scrape(registry) if key[0].startswith("pagedkv_")]


@needs_client
def test_register_on_the_default_registry(stores) -> None:
    import prometheus_client

    store = stores.open()
    collector = metrics.register(store)
    try:
        text = prometheus_client.generate_latest().decode()
        assert "pagedkv_pool_pages 8" in text
    finally:
        prometheus_client.REGISTRY.unregister(collector)


def test_register_without_prometheus_client_says_what_to_install(stores, monkeypatch) -> None:
    store = stores.open()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now fails
    with pytest.raises(ImportError, match=r"pagedkv\[prometheus\]") as info:
        metrics.register(store)
    assert isinstance(info.value, PagedKVError)
    assert isinstance(info.value, pagedkv.MissingDependency)
    text = metrics.prometheus_text(store)  # the text needs no client
    assert "pagedkv_pool_pages 8" in text


def test_values_are_rendered_exactly() -> None:
    render = metrics._value
    assert render(3) == "3" and render(2 ** 60) == str(2 ** 60)
    assert float(render(0.1)) == 0.1 and float(render(1 / 3)) == 1 / 3
    assert render(math.inf) == "+Inf" and render(-math.inf) == "-Inf" and render(math.nan) == "NaN"
