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

import warnings
from typing import Any

import numpy as np
import torch

from ...errors import PagedKVError
from ...geometry import Geometry

__all__ = ["default_layout", "LayerCaches", "to_torch", "to_numpy"]

# Pages the store lends (KVStore.each_page) are read-only numpy views; torch warns that it
# cannot protect them. They are only ever read here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


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
        bits: np.ndarray = tensor.view(torch.int16).numpy()
        return bits.view(like)
    arr: np.ndarray = tensor.numpy()
    return arr


def _block_view(cache: torch.Tensor, layout: str, num_blocks: int, geom: Geometry) -> torch.Tensor:
    """``[num_blocks, 2, split, kernel_tokens, heads, head_dim]`` view of one layer's cache."""
    heads, dim = geom.kv_heads, geom.head_dim
    if layout == "kv_first":
        if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (heads, dim):
            raise PagedKVError(f"a kv_first cache is [2, blocks, tokens, {heads}, {dim}], "
                               f"got {tuple(cache.shape)}")
        view: torch.Tensor = cache.unflatten(1, (num_blocks, -1))  # [2, B, split, Nk, H, D]
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
        self._bf16 = geometry.dtype == "bfloat16"
        self._page_shape = (geometry.layers, 2, self.split, self.kernel_tokens, geometry.kv_heads,
                            geometry.head_dim)
        want = to_torch(np.empty(0, geometry.np_dtype)).dtype
        if any(view.dtype != want for view in self.views):
            raise PagedKVError(f"vLLM's KV caches are {first.dtype}; the store holds {geometry.dtype}")

    def _index(self, block_ids: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(block_ids, np.int64), device=self.device)

    def gather(self, block_ids: Any, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """Copy blocks ``block_ids`` into ``k_out``/``v_out``, each ``(layers, n, page_size, heads, dim)``."""
        ids = [int(block) for block in block_ids]
        shape = (self.geometry.layers, len(ids), self.split, self.kernel_tokens, self.geometry.kv_heads,
                 self.geometry.head_dim)
        k_dst, v_dst = to_torch(k_out).view(shape), to_torch(v_out).view(shape)
        if self.device.type == "cpu":
            # One strided copy per block beats one index_select over the permuted view 3:1 on the CPU.
            for layer, view in enumerate(self.views):
                for n, block in enumerate(ids):
                    src = view[block]
                    k_dst[layer, n].copy_(src[0])
                    v_dst[layer, n].copy_(src[1])
            return
        index = self._index(ids)
        for layer, view in enumerate(self.views):
            picked = view.index_select(0, index)
            k_dst[layer].copy_(picked[:, 0])
            v_dst[layer].copy_(picked[:, 1])

    def scatter_page(self, block_id: int, page: np.ndarray) -> None:
        """Copy one page (``(layers, 2, page_size, heads, dim)``, e.g. a view into the store's pool) into a block."""
        src = (torch.from_numpy(page.view(np.int16)).view(torch.bfloat16) if self._bf16
               else torch.from_numpy(page)).view(self._page_shape)
        for layer, view in enumerate(self.views):
            view[block_id].copy_(src[layer])

    def scatter(self, block_ids: Any, pages: np.ndarray) -> None:
        """Copy ``pages`` (``(n, layers, 2, page_size, heads, dim)``, pool layout) into blocks ``block_ids``."""
        ids = [int(block) for block in block_ids]
        if self.device.type == "cpu":
            for n, block in enumerate(ids):  # per block, like gather (3x one index_copy_ here)
                self.scatter_page(block, pages[n])
            return
        index = self._index(ids)
        geom = self.geometry
        shape = (len(ids), 2, self.split, self.kernel_tokens, geom.kv_heads, geom.head_dim)
        for layer, view in enumerate(self.views):
            view.index_copy_(0, index, to_torch(pages[:, layer]).reshape(shape).to(self.device))
