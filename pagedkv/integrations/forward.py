"""One model forward pass over one sequence, layer by layer, with the K/V held in the store.

A decoder reports its new tokens' K and V one layer at a time and needs, right then,
that layer's K and V of the whole sequence for attention. pagedkv keeps a token's K/V
for all layers in one page, so a forward pass is a small transaction over the layers:
opened at layer 0, finished at the last layer, abandoned (leaving no trace) if the
pass never gets there. Two ways to run it, numerically identical:

* ``StepForward`` (the engine's way): one ``store.step`` per pass. Each layer's new K/V
  is written straight into ``store.pool`` through the step's ``slot_mapping``, and the
  layer's K/V for attention is gathered from the pool through its block table. Every
  page of the sequence is resident and pinned for the pass, so the sequence must fit
  in the pool.
* ``StreamForward``: for a sequence longer than the pool. The past is ``read()``
  (pages stream through the pool, spilling and coming back), the new K/V is
  buffered per layer and ``append()``-ed once the last layer has reported.

Arrays here are numpy in the store's dtype, ``(tokens, kv_heads, head_dim)`` per layer;
no torch, so any integration can use this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PagedKVError

if TYPE_CHECKING:
    from ..store import KVStore

MODES = ("auto", "step", "stream")


class ForwardPass:
    """The K/V side of one forward pass of ``count`` new tokens; see the module docstring."""

    def __init__(self, store: KVStore, seq_id: Any, count: int, token_ids: np.ndarray | None) -> None:
        self.store, self.seq_id, self.count, self.token_ids = store, seq_id, count, token_ids
        self.geom = store.geometry
        self.done = False

    def layer(self, index: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Take layer ``index``'s new K/V ``(count, kv_heads, head_dim)``; return its K/V of
        the whole sequence, ``(length, kv_heads, head_dim)``, past tokens first."""
        raise NotImplementedError

    def finish(self) -> None:
        """Every layer has reported: make the new tokens part of the sequence."""
        raise NotImplementedError

    def abort(self) -> None:
        """Leave no trace of this pass (the sequence keeps its earlier tokens only)."""
        raise NotImplementedError


class StepForward(ForwardPass):
    """A pass inside one ``store.step``: write through ``slot_mapping``, gather via the block table."""

    def __init__(self, store: KVStore, seq_id: Any, count: int, token_ids: np.ndarray | None) -> None:
        super().__init__(store, seq_id, count, token_ids)
        tokens = None if token_ids is None else {seq_id: token_ids}
        self.step = store.step({seq_id: count}, tokens=tokens)
        self.step.__enter__()
        page_size = self.geom.page_size
        self.slots, self.offsets = np.divmod(self.step.slot_mapping, page_size)
        self.length = int(self.step.seq_lens[0])
        self.table = self.step.block_tables[0, :-(-self.length // page_size)].astype(np.intp)

    def layer(self, index: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pool = self.store.pool
        pool[self.slots, index, 0, self.offsets] = k
        pool[self.slots, index, 1, self.offsets] = v
        pages = np.asarray(pool[self.table, index])  # (pages, 2, page_size, kv_heads, head_dim)
        keys = pages[:, 0].reshape(-1, *self.geom.token_shape)[:self.length]
        values = pages[:, 1].reshape(-1, *self.geom.token_shape)[:self.length]
        return keys, values

    def finish(self) -> None:
        self.done = True
        self.step.__exit__(None, None, None)

    def abort(self) -> None:
        if not self.done:
            self.done = True
            # The step rolls its new tokens back when its block "raised".
            self.step.__exit__(PagedKVError, PagedKVError("forward pass abandoned"), None)


class StreamForward(ForwardPass):
    """A pass over a sequence that need not fit in the pool: ``read()`` the past, ``append()`` the new."""

    def __init__(self, store: KVStore, seq_id: Any, count: int, token_ids: np.ndarray | None) -> None:
        super().__init__(store, seq_id, count, token_ids)
        self.past: tuple[np.ndarray, np.ndarray] | None = \
            store.read(seq_id) if store.length(seq_id) else None
        shape = (self.geom.layers, count, *self.geom.token_shape)
        self.new_k = np.empty(shape, self.geom.np_dtype)
        self.new_v = np.empty(shape, self.geom.np_dtype)

    def layer(self, index: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.new_k[index], self.new_v[index] = k, v
        if self.past is None:
            return self.new_k[index], self.new_v[index]
        return (np.concatenate([self.past[0][index], self.new_k[index]]),
                np.concatenate([self.past[1][index], self.new_v[index]]))

    def finish(self) -> None:
        self.done = True
        self.past = None
        self.store.append(self.seq_id, self.new_k, self.new_v, tokens=self.token_ids)

    def abort(self) -> None:
        self.done = True
        self.past = None  # nothing was written


def begin_forward(store: KVStore, seq_id: Any, count: int, token_ids: np.ndarray | None,
                  mode: str = "auto") -> ForwardPass:
    """Open a forward pass of ``count`` new tokens of ``seq_id`` (``token_ids``: their ids or None).

    ``mode``: "step", "stream", or "auto" (a step when the sequence and its new pages
    fit in the pool at once, else streaming).
    """
    if mode not in MODES:
        raise PagedKVError(f"mode must be one of {MODES}, got {mode!r}")
    if count < 1:
        raise PagedKVError("a forward pass needs at least one new token")
    if mode == "step" or (mode == "auto" and store.can_step({seq_id: count})):
        return StepForward(store, seq_id, count, token_ids)
    return StreamForward(store, seq_id, count, token_ids)
