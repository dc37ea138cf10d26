"""Helpers shared by the pagedkv tests (imported by conftest.py and the test modules).

* ``GEOM``: a tiny geometry (2 layers, 2 heads, head_dim 4, 4 tokens a page, float32),
  so a page is 512 bytes and page boundaries are crossed constantly.
* ``kv(seed, seq, start, n)``: deterministic K/V content for tokens ``[start, start+n)``
  of content key ``seq``; the expected bytes are regenerated, never stored.
* ``Model``: what every sequence should hold, as (content key, start, n) segments.
* ``get_seed()`` / ``seed`` fixture: ``PAGEDKV_SEED`` if set, else a fresh seed; printed
  either way so a failure can be replayed with ``PAGEDKV_SEED=<n> pytest ...``.
"""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path
from typing import Any, Hashable

import numpy as np
import pagedkv
from pagedkv import Geometry

GEOM = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=4, dtype="float32")

# -- the repository's tools ---------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str) -> Any:
    """Import ``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# -- seeds ------------------------------------------------------------------------


def get_seed(label: str = "") -> int:
    """The seed of a randomised test: ``PAGEDKV_SEED`` if set, else a fresh one; printed."""
    env = os.environ.get("PAGEDKV_SEED", "").strip()
    seed = int(env, 0) if env else random.SystemRandom().randrange(1 << 32)
    where = f" ({label})" if label else ""
    print(f"PAGEDKV_SEED={seed}{where}")
    return seed


# -- deterministic content -----------------------------------------------------------

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLD
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _key_hash(seq: Hashable) -> int:
    return zlib.crc32(repr(seq).encode()) | (zlib.adler32(repr(seq).encode()) << 32)


def kv(seed: int, seq: Hashable, start: int, n: int, geom: Geometry = GEOM) -> tuple[np.ndarray, np.ndarray]:
    """K and V, each ``(layers, n, kv_heads, head_dim)`` in ``geom``'s dtype, for tokens
    ``[start, start + n)`` of content key ``seq``.

    Every element is raw random bits (NaN and denormal patterns included), so a
    comparison of the bytes is the only sound one. Token ``t`` of ``seq`` is the
    same whatever range it is generated in.
    """
    per_token = 2 * geom.layers * geom.kv_heads * geom.head_dim
    base = _mix(np.array([(seed & (2**64 - 1)) ^ _key_hash(seq)], np.uint64))[0]
    with np.errstate(over="ignore"):
        idx = np.arange(start * per_token, (start + n) * per_token, dtype=np.uint64) + base
    bits = _mix(idx)
    itemsize = geom.itemsize
    if itemsize == 4:
        raw = bits.astype(np.uint32)
    else:
        raw = bits.astype(np.uint16)
    # (n, layers, 2, heads, dim) -> k, v of (layers, n, heads, dim)
    arr = raw.view(geom.np_dtype).reshape(n, geom.layers, 2, geom.kv_heads, geom.head_dim)
    k = np.ascontiguousarray(arr[:, :, 0].transpose(1, 0, 2, 3))
    v = np.ascontiguousarray(arr[:, :, 1].transpose(1, 0, 2, 3))
    return k, v


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality: dtype, shape and every byte."""
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == \
        np.ascontiguousarray(b).tobytes()


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not same_bits(actual, expected):
        a = np.ascontiguousarray(actual).view(np.uint8)
        e = np.ascontiguousarray(expected).view(np.uint8)
        bad = np.argwhere(a != e)
        raise AssertionError(f"{what}: {len(bad)} bytes differ, first at index {bad[0].tolist()}")


# -- the model of what a store holds -------------------------------------------------


class Model:
    """Expected content of every sequence as (content key, start, n) segments.

    A sequence's own appends use a content key unique to this incarnation of the
    id (a dropped and recreated id gets new bytes); a fork copies its source's
    segments and continues with its own key.
    """

    def __init__(self, seed: int, geom: Geometry = GEOM) -> None:
        self.seed = seed
        self.geom = geom
        self.segs: dict[Any, list[tuple[Any, int, int]]] = {}
        self.lens: dict[Any, int] = {}
        self.keys: dict[Any, Any] = {}
        self._gen = 0

    def create(self, seq: Any) -> None:
        self._gen += 1
        self.segs[seq] = []
        self.lens[seq] = 0
        self.keys[seq] = (seq, self._gen)

    def next_kv(self, seq: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The K/V of the next ``n`` tokens of ``seq`` (records them as appended)."""
        start = self.lens[seq]
        key = self.keys[seq]
        segs = self.segs[seq]
        if segs and segs[-1][0] == key and segs[-1][1] + segs[-1][2] == start:
            segs[-1] = (key, segs[-1][1], segs[-1][2] + n)
        else:
            segs.append((key, start, n))
        self.lens[seq] = start + n
        return kv(self.seed, key, start, n, self.geom)

    def undo(self, seq: Any, length: int) -> None:
        """Forget tokens of ``seq`` from ``length`` on (a rolled-back step)."""
        out = []
        for key, start, n in self.segs[seq]:
            if start < length:
                out.append((key, start, min(n, length - start)))
        self.segs[seq] = out
        self.lens[seq] = length

    def fork(self, src: Any, dst: Any) -> None:
        self.create(dst)
        self.segs[dst] = list(self.segs[src])
        self.lens[dst] = self.lens[src]

    def drop(self, seq: Any) -> None:
        del self.segs[seq], self.lens[seq], self.keys[seq]

    def expected(self, seq: Any, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        stop = self.lens[seq] if stop is None else stop
        ks, vs = [], []
        for key, s0, n in self.segs[seq]:
            a, b = max(start, s0), min(stop, s0 + n)
            if a < b:
                k, v = kv(self.seed, key, a, b - a, self.geom)
                ks.append(k)
                vs.append(v)
        g = self.geom
        if not ks:
            empty = np.empty((g.layers, 0, g.kv_heads, g.head_dim), g.np_dtype)
            return empty, empty.copy()
        return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)

    def verify(self, store: pagedkv.KVStore, seq: Any, start: int = 0, stop: int | None = None) -> None:
        k, v = store.read(seq, start, stop)
        ek, ev = self.expected(seq, start, stop)
        assert_same_bits(k, ek, f"K of {seq!r}[{start}:{stop}]")
        assert_same_bits(v, ev, f"V of {seq!r}[{start}:{stop}]")

    def verify_all(self, store: pagedkv.KVStore) -> None:
        assert sorted(map(repr, store.sequences())) == sorted(map(repr, self.segs))
        for seq in self.segs:
            assert store.length(seq) == self.lens[seq], seq
            self.verify(store, seq)


def build_committed(path: Path, seqs: dict[Any, int], seed: int, pool_pages: int,
                    **open_kwargs: Any) -> Model:
    """A closed store (GEOM) holding ``seqs`` (id -> tokens), one commit per sequence; its model."""
    model = Model(seed)
    store = pagedkv.open(path, GEOM, pool_pages, **open_kwargs)
    for seq, tokens in seqs.items():
        store.create(seq)
        model.create(seq)
        store.append(seq, *model.next_kv(seq, tokens))
        store.commit()
    store.close()
    return model


# -- the engine side of a step -----------------------------------------------------


def engine_write(store: pagedkv.KVStore, step: pagedkv.Step, kvs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Write each sequence's new K/V into ``store.pool`` through ``step.slot_mapping``.

    ``kvs`` follows the step's row order; the i-th new token of the step goes to
    ``slot_mapping[i]`` = slot * page_size + offset.
    """
    pool = store.pool
    page_size = store.geometry.page_size
    mapping = step.slot_mapping.tolist()
    i = 0
    for k, v in kvs:
        for j in range(k.shape[1]):
            slot, off = divmod(mapping[i], page_size)
            pool[slot, :, 0, off] = k[:, j]
            pool[slot, :, 1, off] = v[:, j]
            i += 1
    assert i == len(mapping), "the engine wrote a different number of tokens than the mapping has"


def check_step_outputs(store: pagedkv.KVStore, step: pagedkv.Step, order: list, before: dict,
                       counts: dict) -> None:
    """The invariants of block_tables / slot_mapping / seq_lens for a step."""
    PS = store.geometry.page_size
    bt, sm, sl = step.block_tables, step.slot_mapping, step.seq_lens
    assert bt.dtype == np.int32 and sm.dtype == np.int64 and sl.dtype == np.int32
    assert bt.ndim == 2 and sm.ndim == 1 and sl.ndim == 1
    assert bt.shape[0] == len(order) == len(sl)
    assert len(sm) == sum(counts[s] for s in order)
    lens = [before[s] + counts[s] for s in order]
    assert sl.tolist() == lens
    npages = [-(-n // PS) for n in lens]
    assert bt.shape[1] == max(npages)
    for row, n in enumerate(npages):
        assert (bt[row, :n] >= 0).all() and (bt[row, :n] < store.pool_pages).all()
        assert (bt[row, n:] == -1).all()
    for row, n in enumerate(npages):
        assert len(set(bt[row, :n].tolist())) == n, "a sequence names one slot twice"
    i = 0
    for row, seq in enumerate(order):
        for pos in range(before[seq], before[seq] + counts[seq]):
            assert sm[i] == int(bt[row, pos // PS]) * PS + pos % PS
            i += 1
    assert len(set(sm.tolist())) == len(sm), "two new tokens map to one pool position"
    # a page receiving new tokens belongs to its sequence alone (copy-on-write happened)
    for row, seq in enumerate(order):
        if counts[seq]:
            written = set(bt[row, before[seq] // PS:npages[row]].tolist())
            others = set(bt[[r for r in range(len(order)) if r != row]].ravel().tolist())
            assert not written & others, f"{seq!r} writes into a page another row reads"


# -- stores -------------------------------------------------------------------------


class Stores:
    """Opens stores under ``tmp_path`` and closes whatever is left open at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.opened: list[pagedkv.KVStore] = []

    def path(self, name: str = "store") -> Path:
        return self.root / name

    def open(self, name: str = "store", geom: Geometry | None = GEOM, pool_pages: int | None = 8,
             **kwargs: Any) -> pagedkv.KVStore:
        store = pagedkv.open(self.root / name, geom, pool_pages, **kwargs)
        self.opened.append(store)
        return store

    def reopen(self, store: pagedkv.KVStore, **kwargs: Any) -> pagedkv.KVStore:
        """Close ``store`` (committing) and open its directory again, geometry from disk."""
        store.close()
        reopened = pagedkv.open(store.path, **kwargs)
        self.opened.append(reopened)
        return reopened

    def close_all(self) -> None:
        for store in self.opened:
            try:
                store._abandon() if store._poisoned else store.close()
            except Exception:
                store._abandon()
