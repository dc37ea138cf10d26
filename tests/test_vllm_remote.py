"""The vLLM connector over the Redis remote tier: host B's engine restores what host A's computed.

Three engines share one redis-server and one tiny random-weight Llama, each with
its own store directory: ``a`` computes two prompts (its store publishes their
pages after the commit), ``b`` (a fresh directory, vLLM's multi-process mode: the
scheduler asks Redis from its own process) is served them from the tier, and
``c`` (fresh too) runs after every remote value was swapped for another page's:
its scheduler still sees keys, its worker's store refuses every value, and vLLM
recomputes. Greedy outputs must all be the same.
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path
from typing import Any

from types import SimpleNamespace

import numpy as np
import pytest

import pagedkv
from pagedkv.inspection.report import summary
from pagedkv.snapshot import open_snapshot

from tests.kits.content import get_seed
from tests.kits.vllm import PAGE, full_pages_hit, make_model, prompts, run_child, transfer_metrics

pytest_plugins = ("kits.redisserver",)  # its redis_server and redis_clean fixtures

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("redis") is None,
    reason="vllm and redis-py (pip install -e '.[vllm,redis]') are not installed")
NAMES = ["model.layers.0.attn", "model.layers.1.attn"]


def _remote_counters(store: Path) -> dict[str, int]:
    """The remote tier's counters as the store's last commit recorded them."""
    with open_snapshot(str(store)) as snap:
        section = summary(snap)["remote"]
    assert section is not None, f"{store} recorded no remote tier"
    return dict(section["counters"])


def _wait_keys(client: Any, count: int, limit_s: float = 60.0) -> list[bytes]:
    """The tier's keys once there are at least ``count`` (AssertionError after ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while True:
        keys = sorted(client.keys("pagedkv:*"))
        if len(keys) >= count:
            return keys
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(keys)} remote pages after {limit_s} s, expected {count}")
        time.sleep(0.05)  # the poll interval; the condition above ends the wait


def _engine(tmp: Path, name: str, model: str, url: str, batch: list[dict[str, Any]],
            **more: Any) -> dict[str, Any]:
    spec = {"model": model, "store": str(tmp / name), "extra": {"pool_pages": 256, "remote": url},
            "batches": [batch], **more}
    return run_child(str(tmp), name, spec)


def _request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    """The fields of a vLLM Request the scheduler side reads."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens),
                           num_prompt_tokens=len(tokens), num_computed_tokens=0, cache_salt=None,
                           lora_request=None, mm_features=[], prompt_embeds=None)


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def _no_step() -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)


def test_sides_share_pages_through_redis(tmp_path: Path, redis_clean: Any) -> None:
    """Host B's scheduler offers host A's published pages, its worker loads them; a vanished key
    is a load error, reported and not offered again; an unreachable tier is a counted miss."""
    import torch

    from pagedkv.integrations.vllm.config import ConnectorConfig
    from pagedkv.integrations.vllm.scheduler import SchedulerSide
    from pagedkv.integrations.vllm.worker import WorkerSide

    seed = get_seed("vllm remote sides")
    rng = np.random.default_rng(seed)
    geom = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="float32")

    def host(name: str, url: str | None = None) -> tuple[SchedulerSide, WorkerSide, dict[str, Any]]:
        config = ConnectorConfig.from_extra({"path": str(tmp_path / name), "pool_pages": 64,
                                             "remote": url or redis_clean.url})
        caches = {n: torch.from_numpy(rng.standard_normal((20, 2, 4, 16)).astype(np.float32)) for n in NAMES}
        worker = WorkerSide(config, geom, NAMES, "fp", 20)
        worker.register(caches, "cpu")
        scheduler = SchedulerSide(config, "fp", 4, geometry=geom)
        assert worker.disabled is None and scheduler.disabled is None and scheduler.probe is not None
        return scheduler, worker, caches

    tokens = rng.integers(0, 1000, 14).tolist()
    sched_a, worker_a, caches_a = host("a")
    first = _request("r", tokens)
    assert sched_a.matched_tokens(first, 0) == 0  # nothing anywhere yet
    sched_a.after_alloc(first, _blocks([5, 6, 7, 8]), 0)
    state = SimpleNamespace(get_block_ids=lambda req_id: ([5, 6, 7, 8],))
    worker_a.save(sched_a.build_plan(SimpleNamespace(num_scheduled_tokens={"r": 14},
                                                     kv_connector_block_state=state)))
    worker_a.shutdown()  # commits, then drains the publish queue
    assert len(redis_clean.client().keys("pagedkv:*")) == 3

    sched_b, worker_b, caches_b = host("b")
    second = _request("q", tokens)
    assert sched_b.matched_tokens(second, 0) == 12  # every full page but the last token's, from Redis
    sched_b.after_alloc(second, _blocks([9, 10, 11, 12]), 12)
    plan = sched_b.build_plan(_no_step())
    assert [(job.first, job.last, job.block_ids) for job in plan.loads] == [(0, 3, [9, 10, 11])]
    worker_b.load(plan)
    assert worker_b.load_errors() == set()
    for name in NAMES:
        assert torch.equal(caches_b[name][9:12], caches_a[name][5:8])
    assert worker_b.store is not None and worker_b.store.stats()["remote_fetched"] == 3
    assert sched_b.matched_tokens(_request("again", tokens), 0) == 12  # local now

    # Redis evicts between the scheduler's probe and the worker's load.
    sched_c, worker_c, _ = host("c")
    third = _request("e", tokens)
    assert sched_c.matched_tokens(third, 0) == 12
    redis_clean.cli("FLUSHALL")
    sched_c.after_alloc(third, _blocks([1, 2, 3, 4]), 12)
    worker_c.load(sched_c.build_plan(_no_step()))
    assert worker_c.load_errors() == {1, 2, 3}  # vLLM recomputes them
    sched_c.worker_output(SimpleNamespace(kv_connector_worker_meta=worker_c.report()))
    assert sched_c.matched_tokens(third, 0) == 0 and sched_c.matched_tokens(_request("f", tokens), 0) == 0

    # An unreachable tier: a miss, counted, never an error.
    from tests.kits.redisserver import free_port

    down, worker_d, _ = host("d", f"redis://127.0.0.1:{free_port()}/0")
    assert down.matched_tokens(_request("g", tokens), 0) == 0
    assert down.stats.data.get("remote_probe_errors") == 1
    for worker in (worker_b, worker_c, worker_d):
        worker.shutdown()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_host_b_restores_host_a_prompts_and_refuses_swapped_values(tmp_path: Path, redis_clean: Any) -> None:
    seed = get_seed("vllm remote")
    rng = random.Random(seed)
    model = make_model(str(tmp_path / "model"), seed=seed % 1000)
    batch = [{"prompt": p, "max_tokens": 8} for p in prompts(rng, [300, 100])]
    url = redis_clean.url

    a = _engine(tmp_path, "a", model, url, batch)
    published = _remote_counters(tmp_path / "a")
    pages = sum(len(r["prompt"]) // PAGE for r in batch)
    assert published["remote_published"] >= pages and published["remote_errors"] == 0
    client = redis_clean.client()
    keys = _wait_keys(client, pages)

    b = _engine(tmp_path, "b", model, url, batch, multiprocessing=True)
    want = [r["tokens"] for r in a["batches"][0]]
    assert [r["tokens"] for r in b["batches"][0]] == want
    hits = [full_pages_hit(r["prompt"]) for r in batch]
    assert [r["cached"] for r in b["batches"][0]] == hits  # every usable page came from the tier
    metrics = transfer_metrics(b["log"])
    assert metrics.get("hit_tokens") == sum(hits) and metrics.get("load_errors", 0) == 0
    assert metrics.get("pages_loaded") == sum(hits) // PAGE
    fetched = _remote_counters(tmp_path / "b")
    assert fetched["remote_fetched"] == sum(hits) // PAGE and fetched["remote_rejected"] == 0

    # Negative control: every key now holds another page's valid value.
    values = [client.get(key) for key in keys]
    assert len(set(values)) == len(values) > 1
    for key, value in zip(keys, values[1:] + values[:1]):
        client.set(key, value)
    c = _engine(tmp_path, "c", model, url, batch)
    assert [r["tokens"] for r in c["batches"][0]] == want
    metrics = transfer_metrics(c["log"])
    assert metrics.get("hit_tokens") == sum(hits)  # the scheduler saw keys...
    assert metrics.get("load_errors") == sum(hits) // PAGE and metrics.get("pages_loaded", 0) == 0  # ...never used
    refused = _remote_counters(tmp_path / "c")
    assert refused["remote_rejected"] >= len(batch) and refused["remote_fetched"] == 0
