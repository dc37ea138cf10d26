"""vLLM in the tests: a tiny random-weight Llama on disk, and vLLM engines in child processes.

Each engine is ``python -m tests.kits.vllm_child SPEC OUT`` (see that module).

The model is written with transformers (``LlamaForCausalLM(config).save_pretrained``)
with weights of std 0.2, so that its greedy tokens depend on the KV it attends
to (vLLM's dummy weights are so small that outputs ignore the context). Prompts
are token ids; there is no tokenizer and no hub.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = [sys.executable, "-m", "tests.kits.vllm_child"]  # a module: no kit shadows a library by name
PAGE = 32  # vLLM's CPU block size (a multiple of 32) and so the store's page size


def transfer_metrics(log: str) -> dict[str, float]:
    """The connector counters of every "KV Transfer metrics" line of an engine's log, summed."""
    total: dict[str, float] = {}
    for line in log.splitlines():
        if "KV Transfer metrics:" in line:
            for key, value in re.findall(r"(\w+)=([0-9.]+)", line.split("KV Transfer metrics:", 1)[1]):
                total[key] = total.get(key, 0) + float(value)
    return total


def make_model(path: str, seed: int = 0, layers: int = 2, hidden: int = 128, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 32, vocab: int = 512, intermediate: int = 256) -> str:
    """Write a random-weight Llama (float32 safetensors + config.json) into ``path``; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=4096, initializer_range=0.2,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompts(rng: random.Random, lengths: list[int], vocab: int = 512, prefix: list[int] | None = None) -> list[list[int]]:
    """Random prompts of the given lengths (after ``prefix``), token ids in [3, vocab)."""
    head = list(prefix or [])
    return [head + [rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def child_env() -> dict[str, str]:
    """The environment of a vLLM child: offline, 1 GiB of KV, this checkout importable."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def spec_file(tmp: str, name: str, spec: dict[str, Any]) -> tuple[str, str]:
    """Write a child's SPEC; return (spec path, result path)."""
    path = os.path.join(tmp, f"{name}.spec.json")
    with open(path, "w") as handle:
        json.dump(spec, handle)
    return path, os.path.join(tmp, f"{name}.out.json")


def run_child(tmp: str, name: str, spec: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Run one vLLM engine to completion; return its results and its log (``log``)."""
    spec_path, out_path = spec_file(tmp, name, spec)
    proc = subprocess.run([*ENGINE, spec_path, out_path], env=child_env(), cwd=tmp,
                          capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not os.path.exists(out_path):
        raise AssertionError(f"vLLM child {name} failed (exit {proc.returncode}):\n{log[-6000:]}")
    with open(out_path) as handle:
        result = json.load(handle)
    result["log"] = log
    return result


def start_child(tmp: str, name: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    """Start a vLLM engine in its own session (a test can kill its whole process group).

    Its output is a pipe the test reads (``wait_for_line``), merged with its errors.
    """
    spec_path, out_path = spec_file(tmp, name, spec)
    return subprocess.Popen([*ENGINE, spec_path, out_path], env=child_env(), cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_line(proc: subprocess.Popen[str], marker: str) -> list[str]:
    """Read the child's output until a line holding ``marker``; AssertionError if it ends first."""
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"child ended (exit {proc.wait()}) before {marker!r}:\n{''.join(seen)[-6000:]}")


def drain(proc: subprocess.Popen[str], log_path: str) -> threading.Thread:
    """Keep copying the child's output to ``log_path`` in a thread, so a full pipe never blocks it."""
    assert proc.stdout is not None
    source = proc.stdout

    def copy() -> None:
        with open(log_path, "a") as log:
            for line in source:
                log.write(line)
                log.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def wait_serving(proc: subprocess.Popen[str], port: int, limit_s: float = 120.0) -> None:
    """Until the child accepts connections on ``port`` (AssertionError if it exits or ``limit_s`` passes).

    uvicorn logs "Application startup complete" just before it starts listening,
    and logs nothing after; the only sign of a listening socket is a connection
    that succeeds. Between attempts the wait is on the process, so a child that
    dies ends the wait at once.
    """
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            raise AssertionError(f"server exited ({code}) before listening on port {port}")
    raise AssertionError(f"server not listening on port {port} after {limit_s} s")


def full_pages_hit(prompt: list[int]) -> int:
    """Prompt tokens a full hit serves: every full page, leaving at least one token to compute."""
    return (len(prompt) - 1) // PAGE * PAGE
