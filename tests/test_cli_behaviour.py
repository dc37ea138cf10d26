"""The command line behaves like the tools people know: exit codes, JSON (errors included),
bare ``pagedkv``, readable unicode ids, ``--map`` on a terminal, plurals, and the
store-keeping commands ``gc``, ``stats`` and ``compact``; and ``check(detailed=True)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import pagedkv
from pagedkv.kvgen import token_kv

TINY = pagedkv.PRESETS["tiny"]


def kv(origin: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    return token_kv(TINY, 7, origin, np.arange(start, stop))


# -- check(detailed=True) -------------------------------------------------------------


def _damage_resident_page(path: Path) -> int:
    """Flip a byte of a resident page in pool.bin; its uid."""
    with pagedkv.open(path, readonly=True) as store:
        mgr = store._mgr
        pid = next(p for p in np.flatnonzero(mgr.live).tolist() if mgr.slot[p] >= 0)
        uid, slot = int(mgr.uid[pid]), int(mgr.slot[pid])
    offset = 4096 + slot * TINY.page_nbytes + 5
    with open(path / "pool.bin", "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))
    return uid


def test_check_detailed_gives_kinds_pages_and_the_same_messages(tmp_path: Path) -> None:
    path = tmp_path / "s.kv"
    with pagedkv.open(path, TINY, pool_pages=4) as store:
        store.create("a")
        store.append("a", *kv(1, 0, 40))
        assert store.check(detailed=True) == []
    uid = _damage_resident_page(path)
    with pagedkv.open(path, readonly=True) as store:
        detailed = store.check(detailed=True)
        plain = store.check()
    assert plain == [problem.message for problem in detailed] and plain
    assert all(isinstance(problem, pagedkv.Problem) for problem in detailed)
    hit = [problem for problem in detailed if problem.kind == "pool_checksum"]
    assert len(hit) == 1 and hit[0].page == uid and hit[0].sequence is None
    assert hit[0].to_dict() == {"kind": "pool_checksum", "page": uid, "sequence": None,
                                "message": f"page {uid}: pool slot {hit[0].message.split()[4]} fails its checksum"}
    assert str(hit[0]) == hit[0].message
