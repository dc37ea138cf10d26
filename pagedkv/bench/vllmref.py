"""vLLM v1's own KV-cache manager driven like its scheduler drives it: B2's token-id peer.

Imported only when the suite measures against it, so the suite runs without
vLLM. ``VllmDecode`` builds a ``KVCacheManager`` (prefix caching on, one
full-attention group of 16-token blocks) and one real ``vllm.v1.request.Request``
per sequence carrying vLLM's request block hasher with the hash function vLLM
uses by default (``CacheConfig.prefix_caching_hash_algo``). A decode step does
what the scheduler's update and its next ``schedule()`` do for each running
request: append the sampled token (which hashes a block that fills), then
``allocate_slots(request, 1)``, then count the token as computed.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any, Hashable, Mapping, Sequence

import numpy as np


def unavailable() -> str | None:
    """Why vLLM's KV-cache manager cannot be imported here, or None when it can."""
    try:
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception as exc:  # a missing package or a broken install (CUDA wheels on a CPU box)
        return f"{type(exc).__name__}: {exc}"
    return None


class VllmDecode:
    """A ``KVCacheManager`` with ``num_blocks`` usable blocks of ``block_size`` tokens and its requests."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        import torch
        from vllm.config.cache import CacheConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        # The engine core's choice when prefix caching is on (vllm/v1/engine/core.py).
        self.hash_algo = str(next(f.default for f in fields(CacheConfig)
                                  if f.name == "prefix_caching_hash_algo"))
        hash_fn = get_hash_fn_by_name(self.hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        # The manager keeps block ids only: one group, no tensors, a 2-byte "model".
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
        config = KVCacheConfig(num_blocks=num_blocks + 1,  # block 0 is vLLM's null block
                               kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])
        self.manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=True)
        self._request_cls = Request
        self._params = SamplingParams(max_tokens=max_model_len, ignore_eos=True)
        self.block_size = block_size
        self.requests: dict[Hashable, Any] = {}

    def add(self, seq: Hashable, prompt: Sequence[int]) -> None:
        """Admit a request for ``prompt`` as the scheduler does: prefix lookup, then its prefill's slots."""
        request = self._request_cls(str(seq), list(prompt), self._params, None, block_hasher=self._hasher)
        blocks, computed, _ = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, request.num_tokens - computed, computed, blocks) is None:
            raise RuntimeError("vLLM's KV-cache manager ran out of blocks for a prompt")
        request.num_computed_tokens = request.num_tokens
        self.requests[seq] = request

    def step(self, tokens: Mapping[Any, int]) -> None:
        """One decode step: each request gets its sampled token (hashed there) and one slot for it."""
        allocate = self.manager.allocate_slots
        requests = self.requests
        for seq, token in tokens.items():
            request = requests[seq]
            request.append_output_token_ids(token)
            if allocate(request, 1) is None:
                raise RuntimeError("vLLM's KV-cache manager ran out of blocks")
            request.num_computed_tokens += 1

    def outputs(self, seqs: Sequence[Hashable]) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
        """The block-table shape, sequence lengths and last tokens' slots of ``seqs``, in that order."""
        size = self.block_size
        tables = [self.manager.get_block_ids(str(seq))[0] for seq in seqs]
        lens = np.array([self.requests[seq].num_computed_tokens for seq in seqs], np.int32)
        slots = np.array([table[(n - 1) // size] * size + (n - 1) % size for table, n in zip(tables, lens)],
                         np.int64)
        return (len(tables), max(len(table) for table in tables)), lens, slots

    def hashed_blocks(self) -> int:
        """How many blocks hold a cached full-block hash (the prefix cache's entries)."""
        return sum(block.block_hash is not None for block in self.manager.block_pool.blocks)
