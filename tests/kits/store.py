"""Stores for the tests: the tiny geometry, a factory that cleans up, and the engine side of a step.

* ``GEOM``: 2 layers, 2 heads, head_dim 4, 4 tokens a page, float32, so a page is 512
  bytes and page boundaries are crossed constantly.
* ``Stores``: opens stores under a test's ``tmp_path`` and closes (or abandons) whatever
  is left open at teardown; the ``stores`` and ``store`` fixtures are made of it.
* ``engine_write``: what an inference engine does inside ``store.step()``: write each
  new token's K/V into ``store.pool`` at ``slot_mapping``.
* ``check_step_outputs``: every invariant of a step's block tables, slot mapping and lengths.
* ``tree_state``: the bytes, times and modes of everything under a directory (to show that
  an operation wrote nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import pagedkv
from pagedkv import Geometry

GEOM = Geometry(layers=2, kv_heads=2, head_dim=4, page_size=4, dtype="float32")
ROOT = Path(__file__).resolve().parents[2]  # the repository


class Stores:
    """Opens stores under ``root`` and closes whatever is left open at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.opened: list[pagedkv.KVStore] = []

    def path(self, name: str = "store") -> Path:
        """Where the store ``name`` lives."""
        return self.root / name

    def open(self, name: str = "store", geom: Geometry | None = GEOM, pool_pages: int | None = 8,
             **kwargs: Any) -> pagedkv.KVStore:
        """``pagedkv.open`` under ``root`` (``None`` geometry and pool: read them from disk)."""
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
        """Close every store still open (abandon a poisoned one: closing would raise)."""
        for store in self.opened:
            try:
                store._abandon() if store._poisoned else store.close()
            except Exception:
                store._abandon()


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
    page_size = store.geometry.page_size
    bt, sm, sl = step.block_tables, step.slot_mapping, step.seq_lens
    assert bt.dtype == np.int32 and sm.dtype == np.int64 and sl.dtype == np.int32
    assert bt.ndim == 2 and sm.ndim == 1 and sl.ndim == 1
    assert bt.shape[0] == len(order) == len(sl)
    assert len(sm) == sum(counts[s] for s in order)
    lens = [before[s] + counts[s] for s in order]
    assert sl.tolist() == lens
    npages = [-(-n // page_size) for n in lens]
    assert bt.shape[1] == max(npages)
    for row, n in enumerate(npages):
        assert (bt[row, :n] >= 0).all() and (bt[row, :n] < store.pool_pages).all()
        assert (bt[row, n:] == -1).all()
    for row, n in enumerate(npages):
        assert len(set(bt[row, :n].tolist())) == n, "a sequence names one slot twice"
    i = 0
    for row, seq in enumerate(order):
        for pos in range(before[seq], before[seq] + counts[seq]):
            assert sm[i] == int(bt[row, pos // page_size]) * page_size + pos % page_size
            i += 1
    assert len(set(sm.tolist())) == len(sm), "two new tokens map to one pool position"
    # a page receiving new tokens belongs to its sequence alone (copy-on-write happened)
    for row, seq in enumerate(order):
        if counts[seq]:
            written = set(bt[row, before[seq] // page_size:npages[row]].tolist())
            others = set(bt[[r for r in range(len(order)) if r != row]].ravel().tolist())
            assert not written & others, f"{seq!r} writes into a page another row reads"


def tree_state(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """(bytes, mtime_ns, mode) of every file and directory under ``root``, root included."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        data = path.read_bytes() if path.is_file() else None
        out[str(path.relative_to(root))] = (data, st.st_mtime_ns, st.st_mode)
    return out
