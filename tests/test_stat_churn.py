"""Write transactions do not churn the interpreter's table of interned strings.

Every write transaction of a writer records LMDB's entry counts
(``persist.record_counts``), read through ``Transaction.stat``, whose dict keys
CPython interns. If nothing else held those names they would be interned and
released again on every call, and the interpreter would rebuild its table of
interned strings (about 1 MB with numpy loaded) every few hundred commits: a
long-running server pays for that again and again, and B8 saw it as
metadata memory.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

import pagedkv
from pagedkv.geometry import Geometry

GEOM = Geometry(layers=1, kv_heads=1, head_dim=1, page_size=4, dtype="float16")
# More stat-key insertions than a 2**16-slot table has room for (43,690), three stats a commit.
COMMITS = 3000


def test_commits_do_not_rebuild_the_interned_table(tmp_path) -> None:
    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=16, durability="nosync")
    kv = np.zeros((1, 1, 1, 1), np.float16)
    try:
        store.create(0)
        store.commit()
        tracemalloc.start(1)
        try:
            for _ in range(COMMITS):
                store.append(0, kv, kv)
                store.commit()
            snapshot = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    finally:
        store.close()
    big = [stat for stat in snapshot.statistics("traceback")
           if stat.size >= 256 << 10 and any(frame.filename.endswith(("persist.py", "spill.py"))
                                              for frame in stat.traceback)]
    assert not big, "a write transaction allocated a large block: " + "; ".join(
        f"{stat.size} B at {stat.traceback.format()[-1].strip()}" for stat in big)


def test_stat_keys_are_the_held_names(tmp_path) -> None:
    """The mechanism itself: the keys Transaction.stat interns are the very names spill.py holds."""
    from pagedkv.storage import spill

    store = pagedkv.open(str(tmp_path / "s"), GEOM, pool_pages=16, durability="nosync")
    try:
        env = store._spill.env
        with env.begin() as txn:
            keys = list(txn.stat(store._spill.dir))
            assert spill.entry_count(txn, store._spill.dir) == 0
    finally:
        store.close()
    assert keys == list(spill._STAT_FIELDS)
    assert all(key is held for key, held in zip(keys, spill._STAT_FIELDS))
