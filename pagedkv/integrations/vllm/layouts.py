"""Moving pages between pagedkv's page layout and the layouts of vLLM's per-layer KV caches.

A pagedkv page is ``(layers, 2, page_size, kv_heads, head_dim)``. vLLM hands the
connector one tensor per attention layer; how a block sits in it depends on the
attention backend:

- ``cpu`` (vLLM's CPU attention): ``[blocks, heads, block_size, 2 * head_dim]``,
  contiguous, each block laid out ``[heads, K|V, block_size, head_dim]`` in memory
  (the kernel views it as ``[blocks, heads, 2 * block_size, head_dim]``).
- ``standard`` (the GPU backends of vLLM 0.32: FlashAttention, FlashInfer,
  Triton, ...): the logical view ``[blocks, heads, block_size, 2 * head_dim]``
  whose last axis is K then V of one token, in whatever physical order the
  backend's layout (NHD, HND, ...) gives it through strides.
- ``kv_first`` (older backends): ``[2, blocks, block_size, heads, head_dim]``.

Each is turned into a strided view ``[blocks, 2, split, kernel_tokens, heads,
head_dim]`` (``split`` kernel blocks per vLLM block when the kernel block is
smaller than vLLM's), so one ``index_select`` or ``index_copy_`` per layer moves a
batch of blocks whatever the device; nothing here is CPU-specific.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import PagedKVError
from ...geometry import Geometry

__all__ = ["default_layout", "LayerCaches", "to_torch", "to_numpy"]


def default_layout(device: torch.device) -> str:
    """The layout vLLM uses on ``device``: ``cpu`` on the CPU, ``standard`` elsewhere."""
    return "cpu" if device.type == "cpu" else "standard"


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """A numpy array as a CPU tensor sharing its memory (bfloat16 through its bits)."""
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def to_numpy(tensor: torch.Tensor, like: np.dtype) -> np.ndarray:
    """A CPU tensor as a numpy array of dtype ``like`` sharing its memory."""
    if like.name == "bfloat16":
        return tensor.view(torch.int16).numpy().view(like)
    return tensor.numpy()


def _block_view(cache: torch.Tensor, layout: str, num_blocks: int, geom: Geometry) -> torch.Tensor:
    """``[num_blocks, 2, split, kernel_tokens, heads, head_dim]`` view of one layer's cache."""
    heads, dim = geom.kv_heads, geom.head_dim
    if layout == "kv_first":
        if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (heads, dim):
            raise PagedKVError(f"a kv_first cache is [2, blocks, tokens, {heads}, {dim}], "
                               f"got {tuple(cache.shape)}")
        view = cache.unflatten(1, (num_blocks, -1))  # [2, B, split, Nk, H, D]
        return view.permute(1, 0, 2, 3, 4, 5)
    if cache.dim() != 4 or cache.shape[1] != heads or cache.shape[3] != 2 * dim:
        raise PagedKVError(f"a {layout} cache is [blocks, {heads}, tokens, {2 * dim}], got {tuple(cache.shape)}")
    if cache.shape[0] % num_blocks:
        raise PagedKVError(f"cache of {cache.shape[0]} kernel blocks for {num_blocks} vLLM blocks")
    kernel_tokens = cache.shape[2]
    if layout == "cpu":
        if not cache.is_contiguous():
            raise PagedKVError("the cpu layout needs a contiguous cache")
        view = cache.view(cache.shape[0], heads, 2, kernel_tokens, dim)  # [Bk, H, 2, Nk, D]
        view = view.unflatten(0, (num_blocks, -1))  # [B, split, H, 2, Nk, D]
        return view.permute(0, 3, 1, 4, 2, 5)
    if layout == "standard":
        if cache.stride(3) != 1:
            raise PagedKVError("the standard layout needs K|V of a token contiguous")
        view = cache.unflatten(3, (2, dim)).unflatten(0, (num_blocks, -1))  # [B, split, H, Nk, 2, D]
        return view.permute(0, 4, 1, 3, 2, 5)
    raise PagedKVError(f"unknown KV cache layout {layout!r}")


class LayerCaches:
    """vLLM's per-layer KV caches seen as pages: gather blocks out, scatter pages in.

    Params:
        caches: layer tensors in layer order (as ``register_kv_caches`` gave them).
        geometry: the store's geometry (``page_size`` is vLLM's block size).
        num_blocks: vLLM blocks in each cache.
        layout: "cpu", "standard" or "kv_first" (see the module docstring).
    """

    def __init__(self, caches: list[torch.Tensor], geometry: Geometry, num_blocks: int, layout: str) -> None:
        if len(caches) != geometry.layers:
            raise PagedKVError(f"{len(caches)} KV caches for {geometry.layers} layers")
        self.geometry, self.layout, self.num_blocks = geometry, layout, num_blocks
        self.device = caches[0].device
        self.views = [_block_view(cache, layout, num_blocks, geometry) for cache in caches]
        first = self.views[0]
        self.split, self.kernel_tokens = int(first.shape[2]), int(first.shape[3])
        if self.split * self.kernel_tokens != geometry.page_size:
            raise PagedKVError(f"vLLM blocks of {self.split * self.kernel_tokens} tokens for pages of "
                               f"{geometry.page_size}")
        want = to_torch(np.empty(0, geometry.np_dtype)).dtype
        if any(view.dtype != want for view in self.views):
            raise PagedKVError(f"vLLM's KV caches are {first.dtype}; the store holds {geometry.dtype}")

    def _index(self, block_ids: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(block_ids, np.int64), device=self.device)

    def gather(self, block_ids: Any, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """Copy blocks ``block_ids`` into ``k_out``/``v_out``, each ``(layers, n, page_size, heads, dim)``."""
        index = self._index(block_ids)
        shape = (len(index), self.split, self.kernel_tokens, self.geometry.kv_heads, self.geometry.head_dim)
        for layer, view in enumerate(self.views):
            for which, out in ((0, k_out), (1, v_out)):
                dst = to_torch(out[layer]).view(shape)
                if self.device.type == "cpu":
                    torch.index_select(view[:, which], 0, index, out=dst)
                else:
                    dst.copy_(view[:, which].index_select(0, index))

    def scatter(self, block_ids: Any, pages: np.ndarray) -> None:
        """Copy ``pages`` (``(n, layers, 2, page_size, heads, dim)``, pool layout) into blocks ``block_ids``."""
        index = self._index(block_ids)
        geom = self.geometry
        shape = (len(index), 2, self.split, self.kernel_tokens, geom.kv_heads, geom.head_dim)
        for layer, view in enumerate(self.views):
            src = to_torch(pages[:, layer]).reshape(shape)
            if self.device.type != "cpu":
                src = src.to(self.device)
            view.index_copy_(0, index, src)
