"""The vLLM connector's parts that need no vLLM engine: prefix view, identity, settings, layouts, stats.

These run in the parallel suite (no ``vllm`` marker); the layout tests need torch
and skip without it, the stats test needs vLLM and skips without it, and the GPU
layout test runs only where CUDA is available.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import pagedkv
from pagedkv.errors import PageCorrupt, PagedKVError
from pagedkv.integrations.vllm.config import ConnectorConfig, KNOWN_KEYS
from pagedkv.integrations.vllm.identity import namespace_tokens, request_namespace
from pagedkv.prefixview import ROOT, PrefixView

from tests.kits.content import get_seed



GEOM = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def _fill(store: pagedkv.KVStore, seq: str, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    k = rng.standard_normal((GEOM.layers, len(tokens), GEOM.kv_heads, GEOM.head_dim)).astype(np.float32)
    store.create(seq)
    store.append(seq, k, k + 1, tokens=tokens)
    return k


def test_prefixview_agrees_with_lookup(tmp_path: Path) -> None:
    seed = get_seed("prefixview")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, 23)
    with pagedkv.open(tmp_path / "kv", GEOM, pool_pages=32, model="m") as store:
        _fill(store, "a", tokens, rng)
        view = PrefixView.of_store(store)
        assert view.model == "m" and len(view) == 5
        for cut in (0, 3, 4, 9, 23):
            assert view.leading(view.chain(tokens[:cut])) * 4 == store.lookup(tokens[:cut])
        other = tokens.copy()
        other[6] += 1
        assert view.leading(view.chain(other)) * 4 == store.lookup(other) == 4
        # Chaining from the middle gives the same hashes as chaining from the start.
        whole = view.chain(tokens)
        assert view.chain(tokens, whole[1], 2) == whole[2:]
        view.discard(whole[2:3])
        assert view.leading(whole) == 2
        view.add(whole[2:3])
        assert view.leading(whole) == 5
        assert view.chain(tokens[:3]) == [] and ROOT == bytes(16)


def test_prefixview_open_beside_a_live_writer(tmp_path: Path) -> None:
    rng = np.random.default_rng(get_seed("prefixview-open"))
    tokens = rng.integers(0, 1000, 16)
    path = tmp_path / "kv"
    with pagedkv.open(path, GEOM, pool_pages=32, model="m") as store:
        _fill(store, "a", tokens, rng)
        store.commit()
        with pytest.raises(pagedkv.StoreLocked):
            PrefixView.open(path)  # this process holds the writer: read through its handle
        code = ("import sys, numpy as np; from pagedkv.prefixview import PrefixView; "
                f"v = PrefixView.open({str(path)!r}); t = np.array({tokens.tolist()}); "
                "print(len(v), v.model, v.leading(v.chain(t)))")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["4", "m", "4"]


def _slot_offset(pool_file: Path, page: np.ndarray) -> int:
    """Where a page's bytes lie in pool.bin (found by content: the test's values are random)."""
    data = pool_file.read_bytes()
    offset = data.find(page.tobytes())
    assert offset > 0
    return offset


def test_a_corrupt_page_is_never_shared_again(tmp_path: Path) -> None:
    rng = np.random.default_rng(get_seed("corrupt-share"))
    tokens = rng.integers(0, 1000, 13)
    path = tmp_path / "kv"
    with pagedkv.open(path, GEOM, pool_pages=32, model="m") as store:
        _fill(store, "a", tokens, rng)
        page1 = store.read_pages("a", 1, 2)[0]
        store.drop("a")
    offset = _slot_offset(path / "pool.bin", page1)
    with open(path / "pool.bin", "r+b") as handle:
        handle.seek(offset + 5)
        byte = handle.read(1)
        handle.seek(offset + 5)
        handle.write(bytes([byte[0] ^ 0x40]))
    with pagedkv.open(path) as store:
        assert store.create("b", tokens=tokens) == 12
        store.read_pages("b", 0, 1)
        with pytest.raises(PageCorrupt):
            store.read_pages("b", 1, 2)
        store.drop("b")
        # The corrupt page is known now: a new request reuses only the page before it,
        # computes the rest, and its pages serve the prefix from then on.
        assert store.create("c", tokens=tokens) == 4
        k = rng.standard_normal((GEOM.layers, 9, GEOM.kv_heads, GEOM.head_dim)).astype(np.float32)
        store.append("c", k, k, tokens=tokens[4:])
        store.drop("c")
        assert store.lookup(tokens) == 12
        assert store.create("d", tokens=tokens) == 12
        np.testing.assert_array_equal(store.read_pages("d", 1, 2)[0, :, 0], k[:, :4].transpose(0, 1, 2, 3))


def test_config_parses_known_keys_and_refuses_others() -> None:
    config = ConnectorConfig.from_extra({"path": "~/kv.store", "pool_pages": 64, "durability": "nosync",
                                         "write_behind": True, "spill_limit_bytes": None})
    assert config.path == os.path.expanduser("~/kv.store")
    assert config.open_kwargs(GEOM) == {"pool_pages": 64, "durability": "nosync", "write_behind": True}
    assert "pool_pages" not in ConnectorConfig.from_extra({"path": "x"}).open_kwargs(GEOM, creating=False)
    assert ConnectorConfig.from_extra({"path": "x"}).open_kwargs(GEOM)["pool_pages"] == (1 << 30) // GEOM.page_nbytes
    with pytest.raises(PagedKVError, match="unknown kv_connector_extra_config key.*pool_page"):
        ConnectorConfig.from_extra({"path": "x", "pool_page": 3})
    with pytest.raises(PagedKVError, match="needs 'path'"):
        ConnectorConfig.from_extra({"pool_pages": 3})
    with pytest.raises(PagedKVError, match="pool_pages.*must be int"):
        ConnectorConfig.from_extra({"path": "x", "pool_pages": True})
    with pytest.raises(PagedKVError, match="weights_fingerprint"):
        ConnectorConfig.from_extra({"path": "x", "weights_fingerprint": "md5"})
    assert {"path", "pool_pages", "spill_limit_bytes", "durability", "spill_codec", "write_behind"} <= KNOWN_KEYS


def test_request_namespaces_separate_salts_adapters_and_images() -> None:
    plain = SimpleNamespace(cache_salt=None, lora_request=None, mm_features=[])
    assert request_namespace(plain) is None
    salted = SimpleNamespace(cache_salt="tenant-1", lora_request=None, mm_features=[])
    lora = SimpleNamespace(cache_salt=None, lora_request=SimpleNamespace(lora_name="a", lora_path="/x"),
                           mm_features=[])
    image = SimpleNamespace(cache_salt=None, lora_request=None,
                            mm_features=[SimpleNamespace(identifier="img-hash", modality="image",
                                                         mm_position=SimpleNamespace(offset=3, length=9))])
    names = {request_namespace(r) for r in (salted, lora, image)}
    assert len(names) == 3 and None not in names
    pages = [namespace_tokens(name, 32) for name in names]
    for page in pages:
        assert page.dtype == np.uint32 and len(page) == 32 and int(page.min()) >= 1 << 31
    assert not np.array_equal(pages[0], pages[1])
    assert np.array_equal(namespace_tokens("tenant", 32), namespace_tokens("tenant", 32))


def _layout_cases(torch, device: str):  # type: ignore[no-untyped-def]
    """(name, caches, K-of(block, token, head) reader) for every layout, on ``device``."""
    blocks, heads, page, dim = 6, 2, 4, 8
    cases = []
    cpu = [torch.randn(blocks, heads, page, 2 * dim, device=device) for _ in range(2)]
    cases.append(("cpu", cpu, lambda c, b, t, h, kv: c.view(blocks, heads, 2 * page, dim)[b, h, kv * page + t]))
    std = [torch.randn(blocks, heads, page, 2 * dim, device=device) for _ in range(2)]
    cases.append(("standard", std, lambda c, b, t, h, kv: c[b, h, t, kv * dim:(kv + 1) * dim]))
    nhd = [torch.randn(blocks, page, heads, 2 * dim, device=device).permute(0, 2, 1, 3) for _ in range(2)]
    cases.append(("standard", nhd, lambda c, b, t, h, kv: c[b, h, t, kv * dim:(kv + 1) * dim]))
    first = [torch.randn(2, blocks, page, heads, dim, device=device) for _ in range(2)]
    cases.append(("kv_first", first, lambda c, b, t, h, kv: c[kv, b, t, h]))
    split = [torch.randn(2 * blocks, heads, page // 2, 2 * dim, device=device) for _ in range(2)]
    cases.append(("cpu", split, lambda c, b, t, h, kv: c.view(2 * blocks, heads, page, dim)
                  [2 * b + t // 2, h, kv * (page // 2) + t % 2]))
    return cases


def _check_layouts(device: str) -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.integrations.vllm.layouts import LayerCaches

    geom = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    rng = np.random.default_rng(get_seed("layouts"))
    for name, caches, read in _layout_cases(torch, device):
        lc = LayerCaches(caches, geom, 6, name)
        pages = rng.standard_normal((2, *geom.page_shape)).astype(np.float32)
        lc.scatter([4, 1], pages)
        for n, block in enumerate([4, 1]):
            for layer in range(2):
                for t in range(4):
                    for h in range(2):
                        for kv in range(2):
                            got = read(caches[layer], block, t, h, kv).cpu().numpy()
                            np.testing.assert_array_equal(got, pages[n, layer, kv, t, h], err_msg=name)
        k = np.empty((2, 2, 4, 2, 8), np.float32)
        v = np.empty_like(k)
        lc.gather([4, 1], k, v)
        np.testing.assert_array_equal(k, pages[:, :, 0].transpose(1, 0, 2, 3, 4), err_msg=name)
        np.testing.assert_array_equal(v, pages[:, :, 1].transpose(1, 0, 2, 3, 4), err_msg=name)


def test_layouts_round_trip_on_cpu() -> None:
    _check_layouts("cpu")


def test_layouts_round_trip_on_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_layouts("cuda")


def test_layouts_refuse_a_cache_of_another_shape() -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.integrations.vllm.layouts import LayerCaches

    geom = pagedkv.Geometry(layers=1, kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    with pytest.raises(PagedKVError):
        LayerCaches([torch.zeros(6, 3, 4, 16)], geom, 6, "cpu")
    with pytest.raises(PagedKVError, match="float16"):
        LayerCaches([torch.zeros(6, 2, 4, 16, dtype=torch.float16)], geom, 6, "cpu")


@pytest.mark.slow
def test_stats_sum_and_reduce() -> None:
    pytest.importorskip("vllm")
    from pagedkv.integrations.vllm.meta import PagedKVStats

    a, b = PagedKVStats(), PagedKVStats()
    assert a.is_empty()
    a.add("lookup_tokens", 100)
    a.add("hit_tokens", 64)
    b.add("load_us", 1500)
    b.add("pages_loaded", 2)
    total = a.aggregate(b)
    reduced = total.reduce()
    assert reduced["hit_rate"] == 0.64 and reduced["load_ms"] == 1.5 and reduced["pages_loaded"] == 2
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_each_page_lends_the_pages_read_pages_copies(tmp_path: Path) -> None:
    rng = np.random.default_rng(get_seed("each-page"))
    tokens = rng.integers(0, 1000, 14)
    with pagedkv.open(tmp_path / "kv", GEOM, pool_pages=32) as store:
        _fill(store, "a", tokens, rng)
        seen: dict[int, np.ndarray] = {}

        def keep(index: int, page: np.ndarray) -> None:
            assert not page.flags.writeable
            with pytest.raises(ValueError):
                page[0, 0, 0, 0, 0] = 1.0
            seen[index] = page.copy()

        assert store.each_page("a", keep) == 4
        copies = store.read_pages("a")
        for index in range(3):
            np.testing.assert_array_equal(seen[index], copies[index])
        np.testing.assert_array_equal(seen[3][:, :, :2], copies[3][:, :, :2])  # past the tokens: leftovers
        seen.clear()
        assert store.each_page("a", keep, 1, 3) == 2 and sorted(seen) == [1, 2]
        with pytest.raises(PagedKVError):
            store.each_page("a", keep, 2, 5)
        assert store.check() == []


def _request(req_id: str, tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    """The fields of a vLLM Request the scheduler side reads."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens),
                           num_prompt_tokens=len(tokens), num_computed_tokens=0, cache_salt=salt,
                           lora_request=None, mm_features=[], prompt_embeds=None)


@pytest.mark.slow
def test_both_sides_without_an_engine(tmp_path: Path) -> None:
    """Save blocks, look the prompt up, load it into other blocks; salts and a bad store."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from pagedkv.integrations.vllm.scheduler import SchedulerSide
    from pagedkv.integrations.vllm.worker import WorkerSide

    seed = get_seed("both-sides")
    rng = np.random.default_rng(seed)
    geom = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    config = ConnectorConfig.from_extra({"path": str(tmp_path / "kv"), "pool_pages": 64})
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    caches = {name: torch.from_numpy(rng.standard_normal((20, 2, 4, 16)).astype(np.float32)) for name in names}
    worker = WorkerSide(config, geom, names, "fp", 20)
    worker.register(caches, "cpu")
    scheduler = SchedulerSide(config, "fp", 4)
    assert worker.disabled is None and scheduler.disabled is None
    tokens = rng.integers(0, 1000, 14).tolist()
    salted = _request("s", tokens, salt="tenant")

    # Request "r" computed 3 full pages in blocks 5, 6, 7: the plan saves them.
    first = _request("r", tokens)
    assert scheduler.matched_tokens(first, 0) == 0
    scheduler.after_alloc(first, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)), 0)
    first.num_computed_tokens = 0
    state = SimpleNamespace(get_block_ids=lambda req_id: ([5, 6, 7, 8],))
    plan = scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={"r": 14}, kv_connector_block_state=state))
    assert [(job.first, job.last, job.block_ids) for job in plan.saves] == [(0, 3, [5, 6, 7])]
    worker.save(plan)
    worker.flush()
    assert worker.store is not None and worker.store.lookup(tokens) == 12

    # The request ends with a page its last steps filled but no plan saved yet: its blocks
    # wait (delayed free) until that page is copied out, then vLLM may free them.
    longer = tokens + rng.integers(0, 1000, 6).tolist()
    first.all_token_ids, first.num_computed_tokens = longer, 19
    assert scheduler.finished(first, [5, 6, 7, 8]) is True
    plan = scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None))
    assert [(job.first, job.last, job.block_ids, job.finished) for job in plan.saves] == [(3, 4, [8], True)]
    worker.save(plan)
    assert worker.finished_sending({"r"}) == {"r"}
    worker.flush()
    assert worker.store.lookup(longer) == 16
    assert scheduler.finished(_request("never-scheduled", tokens), [1]) is False

    # A new request of the same prompt: 12 tokens held, loaded into blocks 10, 11, 12.
    second = _request("q", tokens)
    assert scheduler.matched_tokens(second, 0) == 12
    assert scheduler.matched_tokens(second, 4) == 8  # beyond vLLM's own hit of one block
    scheduler.after_alloc(second, SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 8)
    plan = scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None))
    assert [(job.first, job.last, job.block_ids) for job in plan.loads] == [(1, 3, [10, 11])]
    worker.load(plan)
    assert worker.load_errors() == set()
    for name in names:
        assert torch.equal(caches[name][10:12], caches[name][6:8])

    # Another namespace (a cache salt) holds nothing; its own save is found by it alone.
    assert scheduler.matched_tokens(salted, 0) == 0
    scheduler.after_alloc(salted, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    plan = scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={"s": 14}, kv_connector_block_state=SimpleNamespace(
        get_block_ids=lambda req_id: ([1, 2, 3, 4],))))
    worker.save(plan)
    worker.flush()
    assert scheduler.matched_tokens(_request("s2", tokens, salt="tenant"), 0) == 12
    assert scheduler.matched_tokens(_request("s3", tokens, salt="other"), 0) == 0

    # A page the view believes present but the store lacks is a load error, and is forgotten.
    ghost = tokens[:8] + [7, 7, 7, 7, 7, 7]
    ghost_req = _request("g", ghost)
    digests = scheduler.view.chain(np.asarray(ghost)) if scheduler.view is not None else []
    scheduler.view.add(digests)
    assert scheduler.matched_tokens(ghost_req, 0) == 12
    scheduler.after_alloc(ghost_req, SimpleNamespace(get_block_ids=lambda: ([13, 14, 15, 16],)), 12)
    worker.load(scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)))
    assert worker.load_errors() == {15}
    report = worker.report()
    assert report is not None and report.failed_loads == {"g": 2}
    scheduler.worker_output(SimpleNamespace(kv_connector_worker_meta=report))
    assert scheduler.matched_tokens(_request("g2", ghost), 0) == 8
    stats = worker.take_stats()
    assert stats is not None and stats.data["pages_loaded"] == 4 and stats.data["load_errors"] == 1
    assert stats.data["pages_saved"] == 3 + 1 + 3  # r, r at its end, the salted request (its namespace page aside)
    worker.shutdown()


@pytest.mark.slow
def test_a_store_that_cannot_be_opened_disables_both_sides(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from pagedkv.integrations.vllm.meta import PageJob, StepPlan
    from pagedkv.integrations.vllm.scheduler import SchedulerSide
    from pagedkv.integrations.vllm.worker import WorkerSide

    bad = tmp_path / "not-a-store"
    bad.write_text("a file where the store should be")
    config = ConnectorConfig.from_extra({"path": str(bad)})
    geom = pagedkv.Geometry(layers=1, kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    worker = WorkerSide(config, geom, ["l0"], "fp", 8)
    scheduler = SchedulerSide(config, "fp", 4)
    assert worker.disabled and scheduler.disabled
    assert scheduler.matched_tokens(_request("r", list(range(20))), 0) == 0
    job = PageJob("r", 0, 2, [1, 2], list(range(9)), None, [b"x" * 16, b"y" * 16])
    worker.load(StepPlan(loads=[job]))
    assert worker.load_errors() == {1, 2}
    worker.save(StepPlan(saves=[job]))
    worker.shutdown()


@pytest.mark.slow
def test_kv_role_consumer_loads_only_and_producer_saves_only(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from pagedkv.integrations.vllm.scheduler import SchedulerSide

    rng = np.random.default_rng(get_seed("kv-role"))
    tokens = rng.integers(0, 1000, 13)
    path = tmp_path / "kv"
    with pagedkv.open(path, GEOM, pool_pages=32, model="fp") as store:
        _fill(store, "a", tokens, rng)
    config = ConnectorConfig.from_extra({"path": str(path)})
    state = SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3, 4],))
    output = SimpleNamespace(num_scheduled_tokens={"n": 13}, kv_connector_block_state=state)
    producer = SchedulerSide(config, "fp", 4, load=False, save=True)
    consumer = SchedulerSide(config, "fp", 4, load=True, save=False)
    assert producer.matched_tokens(_request("r", tokens.tolist()), 0) == 0
    assert consumer.matched_tokens(_request("r", tokens.tolist()), 0) == 12
    fresh = rng.integers(0, 1000, 13).tolist()
    for side, saves in ((producer, 3), (consumer, 0)):
        request = _request("n", fresh)
        side.matched_tokens(request, 0)
        side.after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
        plan = side.build_plan(output)
        assert sum(job.last - job.first for job in plan.saves) == saves
