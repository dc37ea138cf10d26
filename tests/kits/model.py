"""The reference model of a store's observable state: what every sequence should hold.

A ``Model`` keeps, per sequence, its length and the (content key, start, n) segments its
tokens came from; the bytes are regenerated from ``kits.content.kv``, never stored. A
sequence's own appends use a content key unique to this incarnation of the id (a dropped
and recreated id gets new bytes); a fork copies its source's segments and continues under
its own key. The model is small and plain (dicts of tuples): it is deep-copied for every
commit of a fault loop and pickled through the pipe of a crash loop's child.

The state machine, the fault, damage and crash tests and the mutation campaign all check
a store against it; ``build_committed`` makes a closed store of known content, ``fill``
fills an open one, ``busy_store`` one whose every figure is non-trivial, and ``hold_writer``
is a child (``kits.child.Child``) that holds one open for writing until told to let go.
``append_or_undo``, ``verify_unless_pinned`` and ``step_one`` are the operations of threaded
workers (``run_workers``) that may find the pool pinned by the others' steps.
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path
from typing import Any, Callable, Hashable

import numpy as np

import pagedkv
from pagedkv import Geometry

from .child import Channel
from .content import assert_same_bits, differing_tokens, kv
from .store import GEOM, engine_write


class Model:
    """Expected content of every sequence as (content key, start, n) segments.

    ``finite`` keeps every value finite (see ``kits.content.kv``); ``content`` is the one
    place bytes come from, so a subclass may change them for some keys.
    """

    def __init__(self, seed: int, geom: Geometry = GEOM, finite: bool = False) -> None:
        self.seed = seed
        self.geom = geom
        self.finite = finite
        self.segs: dict[Any, list[tuple[Any, int, int]]] = {}
        self.lens: dict[Any, int] = {}
        self.keys: dict[Any, Any] = {}
        self._gen = 0

    # -- what the store is told -------------------------------------------------------

    def create(self, seq: Any, key: Hashable | None = None) -> None:
        """A new, empty sequence; its appends use ``key`` (default: unique to this incarnation)."""
        self._gen += 1
        self.segs[seq] = []
        self.lens[seq] = 0
        self.keys[seq] = (seq, self._gen) if key is None else key

    def grow(self, seq: Any, n: int) -> None:
        """Record ``n`` more tokens of ``seq`` under its current key (the engine wrote them)."""
        start, key, segs = self.lens[seq], self.keys[seq], self.segs[seq]
        if segs and segs[-1][0] == key and segs[-1][1] + segs[-1][2] == start:
            segs[-1] = (key, segs[-1][1], segs[-1][2] + n)
        else:
            segs.append((key, start, n))
        self.lens[seq] = start + n

    def upcoming(self, seq: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The K/V the next ``n`` tokens of ``seq`` will hold, without recording them."""
        return self.content(self.keys[seq], self.lens[seq], n)

    def next_kv(self, seq: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The K/V of the next ``n`` tokens of ``seq`` (records them as appended)."""
        out = self.upcoming(seq, n)
        self.grow(seq, n)
        return out

    def undo(self, seq: Any, length: int) -> None:
        """Forget tokens of ``seq`` from ``length`` on (a rolled-back step, a truncation)."""
        self.segs[seq] = [(key, start, min(n, length - start)) for key, start, n in self.segs[seq]
                          if start < length]
        self.lens[seq] = length

    def fork(self, src: Any, dst: Any, key: Hashable | None = None) -> None:
        """``dst`` holds what ``src`` holds and continues under its own key."""
        self.create(dst, key)
        self.segs[dst] = list(self.segs[src])
        self.lens[dst] = self.lens[src]

    def drop(self, seq: Any) -> None:
        """Forget ``seq``."""
        del self.segs[seq], self.lens[seq], self.keys[seq]

    def copy(self) -> Model:
        """An independent copy (what a commit makes durable)."""
        return copy.deepcopy(self)

    def lengths(self) -> dict[Any, int]:
        """``{sequence: length}``: the shape a reopened store is matched against first."""
        return dict(self.lens)

    # -- what the store should answer ---------------------------------------------------

    def content(self, key: Hashable, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of tokens ``[start, start + n)`` of content key ``key``."""
        return kv(self.seed, key, start, n, self.geom, finite=self.finite)

    def expected(self, seq: Any, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K and V of tokens ``[start, stop)`` of ``seq``, segment by segment."""
        stop = self.lens[seq] if stop is None else stop
        ks, vs = [], []
        for key, s0, n in self.segs[seq]:
            a, b = max(start, s0), min(stop, s0 + n)
            if a < b:
                k, v = self.content(key, a, b - a)
                ks.append(k)
                vs.append(v)
        if not ks:
            g = self.geom
            empty = np.empty((g.layers, 0, g.kv_heads, g.head_dim), g.np_dtype)
            return empty, empty.copy()
        return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)

    def wrong_tokens(self, seq: Any, start: int, stop: int, k: np.ndarray, v: np.ndarray) -> int:
        """How many tokens of a ``read(seq, start, stop)`` result differ from the expected bytes."""
        return differing_tokens(k, v, *self.expected(seq, start, stop))

    def verify(self, store: pagedkv.KVStore, seq: Any, start: int = 0, stop: int | None = None) -> None:
        """``store.read(seq, start, stop)`` is bit-exact (AssertionError naming the first byte)."""
        k, v = store.read(seq, start, stop)
        ek, ev = self.expected(seq, start, stop)
        assert_same_bits(k, ek, f"K of {seq!r}[{start}:{stop}]")
        assert_same_bits(v, ev, f"V of {seq!r}[{start}:{stop}]")

    def verify_all(self, store: pagedkv.KVStore) -> None:
        """The store holds exactly the model's sequences, lengths and bytes."""
        assert sorted(map(repr, store.sequences())) == sorted(map(repr, self.segs))
        for seq in self.segs:
            assert store.length(seq) == self.lens[seq], seq
            self.verify(store, seq)

    def verify_reopened(self, path: Path, **open_kwargs: Any) -> None:
        """Open the closed store at ``path``: it holds exactly the model, and ``check()`` is clean."""
        store = pagedkv.open(path, **open_kwargs)
        try:
            self.verify_all(store)
            assert store.check() == []
        finally:
            store.close()


def build_committed(path: Path, seqs: dict[Any, int], seed: int, pool_pages: int,
                    geom: Geometry = GEOM, chunks: int | None = None, **open_kwargs: Any) -> Model:
    """A closed store holding ``seqs`` (id -> tokens) and its model.

    By default every sequence is created, filled and committed in turn; with ``chunks``,
    all are created, then each gets its tokens in ``chunks`` parts, one commit per part.
    """
    model = Model(seed, geom)
    store = pagedkv.open(path, geom, pool_pages, **open_kwargs)
    if chunks is None:
        for seq, tokens in seqs.items():
            store.create(seq)
            model.create(seq)
            store.append(seq, *model.next_kv(seq, tokens))
            store.commit()
    else:
        for seq in seqs:
            store.create(seq)
            model.create(seq)
        for part in range(chunks):
            for seq, tokens in seqs.items():
                n = tokens // chunks + (tokens % chunks if part == chunks - 1 else 0)
                if n:
                    store.append(seq, *model.next_kv(seq, n))
            store.commit()
    store.close()
    return model


def fill(store: pagedkv.KVStore, seed: int, seqs: dict[Any, int]) -> Model:
    """Create ``seqs`` (id -> tokens) in an open store, append their content, commit once; the model."""
    model = Model(seed, store.geometry)
    for seq, tokens in seqs.items():
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, tokens))
    store.commit()
    return model


def hold_writer(chan: Channel, path: str, seqs: dict[Any, int] | None, seed: int = 0) -> None:
    """A child's body: open ``path`` for writing (creating it with ``seqs`` when given), say
    ``("holding", pid)``, hold the lock until any message comes, close, say ``("closed", pid)``."""
    store = pagedkv.open(path) if seqs is None else pagedkv.open(path, GEOM, 8)
    if seqs is not None:
        fill(store, seed, seqs)
    chan.send(("holding", os.getpid()))
    chan.recv(timeout=120)
    store.close()
    chan.send(("closed", os.getpid()))


def busy_store(stores: Any, seed: int, fork: bool = False, **open_kwargs: Any) -> pagedkv.KVStore:
    """A store (from a ``kits.store.Stores``) that has evicted, restored, hashed and, with ``fork``,
    shared pages, so that every figure of ``stats()`` is non-trivial; committed."""
    store = stores.open(pool_pages=4, evict_batch=1, **open_kwargs)
    geom, page_size = store.geometry, store.geometry.page_size
    model = Model(seed, geom)
    for seq in ("a", "b"):
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, 3 * page_size + 1))
    if fork:
        store.fork("a", "c")
        model.fork("a", "c")
    model.verify_all(store)
    k = np.zeros((geom.layers, page_size, geom.kv_heads, geom.head_dim), geom.np_dtype)
    store.create("p", tokens=list(range(page_size)))
    store.append("p", k, k, tokens=list(range(page_size)))
    store.create("q", tokens=list(range(page_size + 1)))
    store.commit()
    return store


# -- operations of threaded workers, any of which may find the pool pinned by others' steps ----------


def append_or_undo(store: pagedkv.KVStore, model: Model, seq: Any, n: int) -> None:
    """Append ``n`` tokens of ``seq``; if other threads' steps pin the whole pool, forget them."""
    length = model.lens[seq]
    try:
        store.append(seq, *model.next_kv(seq, n))
    except pagedkv.PoolExhausted:
        model.undo(seq, length)


def verify_unless_pinned(store: pagedkv.KVStore, model: Model, seq: Any) -> None:
    """``model.verify`` of ``seq``, unless the pool is pinned and its pages cannot come back now."""
    try:
        model.verify(store, seq)
    except pagedkv.PoolExhausted:
        pass


def step_one(store: pagedkv.KVStore, model: Model, seq: Any) -> None:
    """A one-token step of ``seq`` (the engine writes its K/V), unless the pool is pinned."""
    try:
        with store.step({seq: 1}) as step:
            engine_write(store, step, [model.next_kv(seq, 1)])
    except pagedkv.PoolExhausted:
        pass


def run_workers(worker: Callable[[int], None], count: int, join_s: float) -> None:
    """Run ``worker(n)`` for every n < ``count``, each in a thread; AssertionError if one is still
    running ``join_s`` seconds after the join of it began (a deadlock) or if any raised."""
    errors: list[BaseException] = []

    def guarded(n: int) -> None:
        try:
            worker(n)
        except BaseException as exc:  # noqa: BLE001 - surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_s)
    assert not any(thread.is_alive() for thread in threads), "a worker deadlocked"
    assert not errors, errors
