"""A real model decoding through pagedkv (pagedkv.integrations.hf), against transformers' own cache.

A tiny randomly initialised Llama (3 layers, GQA with 4 query and 2 KV heads) is built
from a config here: nothing is downloaded. Greedy decoding through a ``PagedKVCache``
must give exactly the tokens of the default ``DynamicCache``, with the K/V bit-exact
in the store, through pools small enough that pages spill and come back, across a
close and reopen, and with prefix reuse skipping the cached part of a prompt.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real model on the CPU: seconds per test

import pagedkv  # noqa: E402
from pagedkv import GeometryMismatch, PagedKVError  # noqa: E402
from pagedkv.integrations.hf import PagedKVCache, geometry_for, model_fingerprint  # noqa: E402

PAGE = 4  # tokens a page: prompts end in partial pages, and page boundaries come often


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    # One thread: two pytest workers on two cores with torch's default of one OpenMP
    # thread per core oversubscribe the machine and make each forward ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3,  # sharp attention: tokens depend on every cached K/V
    )
    yield transformers.LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)


def ids(seed: int, count: int) -> Any:
    return torch.randint(0, 256, (1, count), generator=torch.Generator().manual_seed(seed))


def greedy(model: Any, input_ids: Any, count: int, **kwargs: Any) -> Any:
    if "cache" in kwargs:  # past_key_values: the name transformers 5.16 to 5.24 all accept
        kwargs["past_key_values"] = kwargs.pop("cache")
    return model.generate(input_ids, max_new_tokens=count, do_sample=False, **kwargs)


def open_store(path: Path, model: Any, pool_pages: int | None = None) -> pagedkv.KVStore:
    geom = geometry_for(model, page_size=PAGE) if pool_pages else None
    return pagedkv.open(path, geom, pool_pages, model=model_fingerprint(model), durability="nosync")


@contextlib.contextmanager
def counting(model: Any) -> Iterator[list[int]]:
    """The number of tokens of every forward pass of ``model`` inside the block."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(int(kwargs.get("input_ids", args[0] if args else None).shape[1])),
        with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def stats_delta(store: pagedkv.KVStore, before: dict[str, float], *names: str) -> list[float]:
    after = store.stats()
    return [after[name] - before[name] for name in names]


@pytest.mark.parametrize("mode,pool_pages", [("step", 64), ("stream", 3), ("auto", 12)])
def test_greedy_matches_default_cache(tmp_path: Path, model: Any, mode: str, pool_pages: int) -> None:
    prompt = ids(1, 37)
    ref = greedy(model, prompt, 40, return_dict_in_generate=True)
    store = open_store(tmp_path / "s", model, pool_pages)
    cache = PagedKVCache(store, "chat", model=model, mode=mode)
    before = store.stats()
    out = greedy(model, prompt, 40, cache=cache)
    assert torch.equal(out, ref.sequences)
    # The store holds every token the model attended to (the last one sampled is not yet fed
    # back), bit for bit what the default cache held.
    assert store.length("chat") == cache.get_seq_length() == 37 + 39
    keys, values = store.read("chat")
    held_cache = getattr(ref, "cache", None) or ref.past_key_values  # 5.24 / 5.19 name
    for layer, held in enumerate(held_cache.layers):
        assert np.array_equal(keys[layer], held.keys[0].transpose(0, 1).numpy())
        assert np.array_equal(values[layer], held.values[0].transpose(0, 1).numpy())
    evictions, restores = stats_delta(store, before, "evictions", "restores")
    if pool_pages < 20:  # 76 tokens are 19 pages: they spilled and came back while decoding
        assert evictions > 0 and restores > 0
    assert store.check() == []
    store.close()


def test_conversations_spill_and_continue_after_reopen(tmp_path: Path, model: Any) -> None:
    """Two chats share a 24-slot pool (either fits, both don't) in step mode; the store is
    closed and reopened between turns; each turn equals DynamicCache's continuation."""
    prompts = {"a": ids(2, 29), "b": ids(3, 23)}
    user = {"a": ids(4, 5), "b": ids(5, 9)}
    refs: dict[str, list[Any]] = {}
    for seq, prompt in prompts.items():
        dynamic = transformers.DynamicCache(config=model.config)
        first = greedy(model, prompt, 18, cache=dynamic)
        refs[seq] = [first, greedy(model, torch.cat([first, user[seq]], 1), 15, cache=dynamic)]

    store = open_store(tmp_path / "s", model, 24)
    outs: dict[str, Any] = {}
    for seq, prompt in prompts.items():
        outs[seq] = greedy(model, prompt, 18, cache=PagedKVCache(store, seq, model=model, mode="step"))
        assert torch.equal(outs[seq], refs[seq][0])
    store.close()

    store = open_store(tmp_path / "s", model)  # geometry, pool and fingerprint from disk
    before = store.stats()
    for seq in prompts:
        cache = PagedKVCache(store, seq, model=model, mode="step")
        assert cache.reused == cache.get_seq_length() == outs[seq].shape[1] - 1
        turn = torch.cat([outs[seq], user[seq]], 1)
        with counting(model) as seen:
            out = greedy(model, turn, 15, cache=cache)
        assert torch.equal(out, refs[seq][1])
        assert seen[0] == 1 + user[seq].shape[1]  # the unfed last answer token plus the user's
        assert store.length(seq) == out.shape[1] - 1
    evictions, restores = stats_delta(store, before, "evictions", "restores")
    assert evictions > 0 and restores > 0
    assert store.check() == []
    store.close()


def test_prefix_reuse_runs_only_the_uncached_tokens(tmp_path: Path, model: Any) -> None:
    prompt = ids(6, 61)  # 15 full pages and one token: 60 reusable tokens
    dynamic = transformers.DynamicCache(config=model.config)
    ref = greedy(model, prompt, 12, cache=dynamic)
    store = open_store(tmp_path / "s", model, 64)
    first = PagedKVCache(store, "first", model=model, prompt=prompt)
    assert first.reused == 0
    with counting(model) as seen:
        assert torch.equal(greedy(model, prompt, 12, cache=first), ref)
    assert seen == [61] + [1] * 11
    assert store.lookup(prompt[0].tolist()) == 60

    def again(store: pagedkv.KVStore, seq: str, **kwargs: Any) -> None:
        cache = PagedKVCache(store, seq, model=model, prompt=prompt)
        assert cache.reused == 60
        with counting(model) as seen:
            assert torch.equal(greedy(model, prompt, 12, **{"cache": cache, **kwargs}), ref)
        assert seen == [1] * 12 and cache.tokens_computed == 12

    again(store, "second")
    store.close()
    store = open_store(tmp_path / "s", model)
    again(store, "third")
    # past_key_values= (deprecated in transformers 5.24, the only name in 5.19) reaches the same cache.
    cache = PagedKVCache(store, "fourth", model=model, prompt=prompt)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref) and cache.tokens_computed == 12

    # The next turn of the conversation reuses the answer's pages too (their ids were
    # recorded while decoding): 72 tokens are held by "first", 18 full pages.
    user = ids(7, 6)
    ref_turn = greedy(model, torch.cat([ref, user], 1), 10, cache=dynamic)
    cache = PagedKVCache(store, "turn-2", model=model, prompt=torch.cat([ref, user], 1))
    assert cache.reused == 72
    with counting(model) as seen:
        assert torch.equal(greedy(model, torch.cat([ref, user], 1), 10, cache=cache), ref_turn)
    assert seen[0] == 73 + 6 - 72
    assert store.check() == []
    store.close()


def test_without_model_tokens_are_stored_but_not_reusable(tmp_path: Path, model: Any) -> None:
    prompt = ids(8, 21)
    store = open_store(tmp_path / "s", model, 16)
    cache = PagedKVCache(store, "anon")
    assert torch.equal(greedy(model, prompt, 8, cache=cache), greedy(model, prompt, 8))
    assert store.length("anon") == 28 and store.lookup(prompt[0].tolist()) == 0
    store.close()


def test_bfloat16_model_and_store(tmp_path: Path, model: Any) -> None:
    half = copy.deepcopy(model).to(torch.bfloat16)
    prompt = ids(9, 19)
    store = pagedkv.open(tmp_path / "s", geometry_for(half, page_size=PAGE), 8, durability="nosync")
    assert store.geometry.dtype == "bfloat16"
    out = greedy(half, prompt, 12, cache=PagedKVCache(store, "h", model=half))
    assert torch.equal(out, greedy(half, prompt, 12))
    store.close()


def test_misuse_raises_and_a_failed_forward_leaves_no_trace(tmp_path: Path, model: Any) -> None:
    prompt = ids(10, 13)
    store = open_store(tmp_path / "s", model, 16)
    with pytest.raises(PagedKVError, match="batch size"):
        greedy(model, torch.cat([prompt, prompt]), 2, cache=PagedKVCache(store, "batch", model=model))
    with pytest.raises(PagedKVError, match="batch size"):
        PagedKVCache(store, "batch-prompt", prompt=torch.cat([prompt, prompt]))
    with pytest.raises(PagedKVError):
        PagedKVCache(store, "m", mode="fast")
    with pytest.raises(PagedKVError):
        PagedKVCache("not a store", "x")  # type: ignore[arg-type]
    other = pagedkv.open(tmp_path / "o", pagedkv.Geometry(3, 4, 16, PAGE, "float32"), 8, durability="nosync")
    with pytest.raises(GeometryMismatch):
        PagedKVCache(other, "x", model=model)
    with pytest.raises(GeometryMismatch):
        greedy(model, prompt, 2, cache=PagedKVCache(other, "y"))
    other.close()

    for mode in ("step", "stream"):
        cache = PagedKVCache(store, f"fail-{mode}", model=model, mode=mode)
        first = greedy(model, prompt, 3, cache=cache)
        length = store.length(f"fail-{mode}")
        boom = model.model.layers[2].register_forward_pre_hook(lambda *_: 1 / 0)
        try:
            with pytest.raises(ZeroDivisionError):
                model(prompt[:, :4], past_key_values=cache)
        finally:
            boom.remove()
        assert store.length(f"fail-{mode}") == cache.get_seq_length() == length
        store.commit()  # no step was left open
        assert torch.equal(greedy(model, first, 4, cache=cache), greedy(model, prompt, 7))
    with pytest.raises(PagedKVError):
        cache.crop(-1)
    with pytest.raises(PagedKVError):
        cache.reset()
    cache.crop(0)
    cache.close()
    assert store.check() == []
    store.close()


def test_ttft_benchmark_runs(model: Any) -> None:
    """tools/bench_ttft.py end to end on the tiny model (the real run uses a bigger one)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "bench_ttft.py"
    spec = importlib.util.spec_from_file_location("bench_ttft", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure_ttft(prompt_len=33, pairs=1, page_size=PAGE, model=model)
    assert result["reused_tokens"] == 32 and result["ratio"] > 0
    assert "faster" in bench.format_result(result)
