"""What KV is bound to: the model fingerprint of the store and the namespace of a request.

The store's ``model=`` fingerprint binds the model: its path or name, revision,
dtype, KV cache dtype, quantization, its config and the identity of its weight
files (sampled bytes by default; ``weights_fingerprint="full"`` hashes them
whole). pagedkv mixes it into every page hash and refuses to reopen a store
under another one, so KV of one model is never served to another.

Within one model, KV also depends on what a request carries besides token ids:
``cache_salt``, a LoRA adapter, multimodal inputs (their placeholder tokens are
the same for every image). Such a request lives in a namespace: its pages chain
after one *namespace page* whose token ids are derived from the namespace and lie
at 2**31 and above, where no vocabulary reaches. A real prompt page can therefore
never equal a namespace page, pagedkv's hit confirmation (token ids and chain
class) separates namespaces even under a hash collision, and requests with
nothing of the kind share pages with plain prompts. A namespace page holds zero
K/V and is never copied into vLLM's blocks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import xxhash

__all__ = ["model_fingerprint", "request_namespace", "namespace_tokens"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model", ".json")
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10  # "sample" mode: 16 runs of 64 KiB per file, ends included


def _file_digest(path: str, mode: str) -> str:
    """xxh3 of a weight file: its size and sampled runs, or every byte in ``full`` mode."""
    hasher = xxhash.xxh3_128()
    size = os.path.getsize(path)
    hasher.update(f"{size}".encode())
    with open(path, "rb") as handle:
        if mode == "full" or size <= _SAMPLES * _SAMPLE_BYTES:
            for chunk in iter(lambda: handle.read(8 << 20), b""):
                hasher.update(chunk)
        else:
            step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            for index in range(_SAMPLES):
                handle.seek(index * step)
                hasher.update(handle.read(_SAMPLE_BYTES))
    return hasher.hexdigest()


def _weights_identity(model_dir: str | None, mode: str) -> str:
    """A digest of the weight (and config) files in ``model_dir``; '' when unknown or off."""
    if mode == "none" or not model_dir or not os.path.isdir(model_dir):
        return ""
    hasher = xxhash.xxh3_128()
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.endswith(_WEIGHT_SUFFIXES):
                path = os.path.join(root, name)
                hasher.update(f"{os.path.relpath(path, model_dir)}={_file_digest(path, mode)};".encode())
    return hasher.hexdigest()


def _local_model_dir(model: str, revision: str | None) -> str | None:
    """The folder holding ``model``'s files: the path itself, or its snapshot in the hub cache."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        folder: str = snapshot_download(model, revision=revision, local_files_only=True)
        return folder
    except Exception:  # not cached, no hub library, or an id of another kind: identity by name only
        return None


def model_fingerprint(vllm_config: Any, weights_mode: str = "sample") -> str:
    """The ``model=`` fingerprint of the store for this vLLM engine's model."""
    mc = vllm_config.model_config
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    hf_config = getattr(mc, "hf_config", None)
    try:
        config_json = hf_config.to_json_string(use_diff=False) if hf_config is not None else ""
    except Exception:  # a config class without a JSON form: its repr still names its fields
        config_json = repr(hf_config)
    model_dir = _local_model_dir(str(mc.model), getattr(mc, "revision", None))
    parts = [
        f"model={mc.model}",
        f"revision={getattr(mc, 'revision', None) or ''}",
        f"dtype={str(mc.dtype).replace('torch.', '')}",
        f"kv_dtype={cache_dtype}",
        f"quantization={getattr(mc, 'quantization', None) or ''}",
        f"config={xxhash.xxh3_64_hexdigest(config_json.encode())}",
        f"weights={_weights_identity(model_dir, weights_mode) or 'unknown'}",
    ]
    return "vllm:" + "|".join(parts)


def request_namespace(request: Any) -> str | None:
    """The namespace of a vLLM request: its cache salt, LoRA adapter and multimodal inputs.

    None for a plain text request. Multimodal inputs enter with their content
    hash and their place in the prompt, so the same image at the same position
    shares pages and anything else does not.
    """
    parts: list[str] = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}@{getattr(lora, 'lora_path', '') or ''}")
    for feature in getattr(request, "mm_features", None) or []:
        pos = getattr(feature, "mm_position", None)
        where = f"{getattr(pos, 'offset', '')}+{getattr(pos, 'length', '')}"
        parts.append(f"mm={getattr(feature, 'modality', '')}:{feature.identifier}@{where}")
    return "\x1f".join(parts) if parts else None


def namespace_tokens(namespace: str, page_size: int) -> np.ndarray:
    """The token ids of a namespace's page: ``page_size`` ids in [2**31, 2**32), from its hash."""
    seed = xxhash.xxh3_64_intdigest(namespace.encode("utf-8"))
    words = [xxhash.xxh3_64_intdigest(index.to_bytes(4, "little"), seed=seed) for index in range(page_size)]
    return (np.asarray(words, np.uint64) & 0x7FFFFFFF | 0x80000000).astype(np.uint32)
