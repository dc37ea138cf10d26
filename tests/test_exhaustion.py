"""Real exhaustion (docs/reliability.md T6): a file size limit, a full disk, small and full LMDB maps.

* ``RLIMIT_FSIZE`` in a forked child (SIGXFSZ ignored) during creation, growth and
  eviction, and a full disk (a small tmpfs, where this machine lets us mount one), at many
  seeded limits: whatever creation, eviction or commit raises is ``StoreFull`` naming
  ENOSPC / EFBIG, the handle is poisoned, and a reopen finds the last returned commit (or
  the one being made), every page intact and usable.
* LMDB map growth: a 1 MiB map under 10 MiB of spill grows on its own (or fails typed),
  a refused growth fails atomically, stores created with maps from 4 KiB to 1 MiB grow
  while pages many times the map's size spill, and one value thousands of times the map
  goes in one transaction, creating the named databases included.

Seeds are printed; ``PAGEDKV_SEED=<n>`` replays a run.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import re
import resource
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

import pagedkv
from pagedkv import Geometry, PagedKVError, StoreClosed
from pagedkv.storage.files import disk_usage
from pagedkv.storage.spill import SpillStore, uid_key

from tests.kits.child import describe, in_child
from tests.kits.content import get_seed
from tests.kits.faults import ABSENT, TYPED_IO, disk_state, model_state, poisoned, scales
from tests.kits.model import Model
from tests.kits.store import GEOM



# -- a file size limit during creation, growth and eviction; a full map --------------------------

FSIZE_POOL = 160  # 4 KiB header + 160 x 512 B = 84 KiB: limits from 64 KiB fail creation
FSIZE_SEQS = 6
FSIZE_CHUNK = 37  # tokens per append
FSIZE_ROUNDS = 8


def fsize_workload(path: str, limit: int | None, seed: int) -> dict[str, Any]:
    """Create a store and grow it under a file-size limit; report what was acked and the error."""
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    model = Model(seed)
    acked: Model | None = None
    pending: Model | None = None
    phase = "create"
    store = None
    try:
        pending = copy.deepcopy(model)
        store = pagedkv.open(path, GEOM, FSIZE_POOL)
        acked, pending = pending, None
        phase = "grow"
        for rnd in range(FSIZE_ROUNDS):
            for s in range(FSIZE_SEQS):
                seq = f"s{s}"
                if rnd == 0:
                    model.create(seq)
                    store.create(seq)
                k, v = model.next_kv(seq, FSIZE_CHUNK)
                store.append(seq, k, v)
                if phase == "grow" and store.stats()["evictions"]:
                    phase = "evict"  # the pool is full: pages now spill to LMDB
            if rnd % 3 == 2:  # read back an early sequence: restores evict others
                model.verify(store, "s0")
            pending = copy.deepcopy(model)
            store.commit()
            acked, pending = pending, None
        pending = copy.deepcopy(model)
        store.close()
        acked, pending = pending, None
        return dict(error=None, phase="done", acked=acked, pending=None)
    except PagedKVError as exc:
        return dict(error=describe(exc), type=type(exc).__name__, phase=phase, acked=acked,
                    pending=pending, poisoned=None if store is None else poisoned(store))


def _sizes(path: Path) -> int:
    return max(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_fsize_limit_create_grow_evict(tmp_path: Path, scale: str) -> None:
    seed = get_seed("T6 fsize")
    rng = random.Random(seed)
    ref = in_child(fsize_workload, str(tmp_path / "ref" / "store"), None, seed, timeout=60)
    assert ref.status == "ok" and ref.value["error"] is None, str(ref)
    biggest = _sizes(tmp_path / "ref" / "store")
    count = {"ci": 20, "soak": 500}[scale]
    pool_size = 4096 + FSIZE_POOL * GEOM.page_nbytes
    # A quarter of the limits fall below pool.bin's size (creation fails), the rest during growth.
    limits = sorted({64 << 10, *(rng.randrange(64 << 10, pool_size) for _ in range(count // 4 - 1)),
                     *(rng.randrange(pool_size, biggest + 4096) for _ in range(count - count // 4))})
    problems: list[str] = []
    phases: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for limit in limits:
        root = tmp_path / f"lim{limit}"
        path = root / "store"
        result = in_child(fsize_workload, str(path), limit, seed, timeout=60)
        where = f"limit {limit}"
        if result.status != "ok":
            problems.append(f"{where}: child {result}")
            continue
        out = result.value
        phases[out["phase"]] = phases.get(out["phase"], 0) + 1
        if out["error"] is not None:
            # LMDB reports a short write at the limit as EIO; pagedkv names the real cause.
            if out["type"] != "StoreFull" or not any(code in out["error"] for code in ("EFBIG", "ENOSPC")):
                problems.append(f"{where}: {out['phase']} raised {out['error']}, not StoreFull naming EFBIG")
            kinds[out["type"]] = kinds.get(out["type"], 0) + 1
            if out["poisoned"] is False:
                problems.append(f"{where}: handle not poisoned after {out['type']}")
        leftovers = [n for n in os.listdir(root) if n != "store"]
        if leftovers:
            problems.append(f"{where}: half-created files left beside the store: {leftovers}")
        # Without the limit: the last acked commit (or the one being made), every page intact.
        allowed = [model_state(out["acked"])]
        if out["pending"] is not None:
            allowed.append(model_state(out["pending"]))
        try:
            state = disk_state(path)
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"{where}: reopen without the limit failed: {describe(exc)}")
            continue
        if state not in allowed:
            lost = "absent" if state == ABSENT else "differs from the acked commit"
            problems.append(f"{where}: after {out['error']} the store {lost} (lost committed pages)")
            continue
        if state != ABSENT:
            store = pagedkv.open(path)
            try:
                if store.check():
                    problems.append(f"{where}: check() {store.check()[:3]}")
                store.create("after")  # the disk is fine again: the store works
                store.commit()
            except BaseException as exc:  # noqa: BLE001
                problems.append(f"{where}: writing after the limit was lifted: {describe(exc)}")
            finally:
                store.close()
    print(f"T6 fsize: {len(limits)} limits in 64 KiB..{biggest + 4096}, outcomes by phase {phases}, errors {kinds}")
    assert not problems, "\n".join(problems[:20])
    assert phases.get("create", 0) >= 1, "no limit hit the creation phase"
    assert len(phases) >= 2, f"the limits hit only {phases}"


BIG = Geometry(layers=2, kv_heads=4, head_dim=64, page_size=16, dtype="float32")  # 64 KiB pages


def test_map_full_grows_or_fails_typed(tmp_path: Path) -> None:
    """A 1 MiB map under 10 MiB of spill grows on its own (or fails typed), never a partial commit."""
    seed = get_seed("T6 mapfull")
    path = tmp_path / "store"
    store = pagedkv.open(path, BIG, 16, map_size=1 << 20)
    model = Model(seed, BIG)
    committed = copy.deepcopy(model)
    error = None
    try:
        for i in range(14):
            seq = f"s{i}"
            store.create(seq)
            model.create(seq)
            for _ in range(4):
                k, v = model.next_kv(seq, 56)
                store.append(seq, k, v)
            store.commit()
            committed = copy.deepcopy(model)
        spilled = store.stats()["bytes_spilled"]
        map_size = store._spill.env.info()["map_size"]
        store.close()
    except PagedKVError as exc:
        error = exc
        assert isinstance(exc, TYPED_IO), describe(exc)
        store._abandon()
    print(f"T6 map full: error={error!r}")
    if error is None:
        assert spilled >= 10 << 20, spilled
        assert map_size > 1 << 20, map_size
        print(f"T6 map full: spilled {spilled >> 20} MiB, map grew 1 MiB -> {map_size >> 20} MiB")
    committed.verify_reopened(path)


def test_map_growth_refused_is_typed_and_atomic(tmp_path: Path) -> None:
    """When the map may not grow (set_mapsize fails forever) the eviction fails typed, atomically."""
    path = tmp_path / "store"
    model = Model(3, BIG)
    store = pagedkv.open(path, BIG, 8, map_size=1 << 20)
    store.create("a")
    model.create("a")
    k, v = model.next_kv("a", 16 * 6)
    store.append("a", k, v)
    store.commit()
    committed = copy.deepcopy(model)
    seen: list[str] = []

    def fail_growth(op: str) -> None:
        seen.append(op)
        if op == "set_mapsize":
            raise OSError(errno.ENOSPC, "injected: the map may not grow")

    pagedkv.faults.set_injector(fail_growth)
    try:
        with pytest.raises(PagedKVError) as info:
            for _ in range(40):
                k, v = model.next_kv("a", 16)
                store.append("a", k, v)
    finally:
        pagedkv.faults.set_injector(None)
    assert "set_mapsize" in seen, seen
    assert isinstance(info.value, TYPED_IO), describe(info.value)
    with pytest.raises(StoreClosed):
        store.commit()
    store.close()
    reopened = pagedkv.open(path, readonly=True)
    try:
        committed.verify_all(reopened)
    finally:
        reopened.close()


# -- a file size limit and a full disk at many limits -------------------------------------------

NAMES_CAUSE = re.compile(r"ENOSPC|EFBIG|EDQUOT|disk full|file size limit", re.IGNORECASE)

XGEOM = Geometry(layers=2, kv_heads=2, head_dim=16, page_size=8, dtype="float32")  # 4 KiB pages
X_POOL = 12  # pool.bin: 4 KiB header + 48 KiB of slots
X_SEQS = 5
X_ROUNDS = 10
X_CHUNK = 13  # tokens per append: pages fill unevenly, records of every fill spill
POOL_BYTES = 4096 + X_POOL * XGEOM.page_nbytes


def exhaust(path: str, fsize_limit: int | None, seed: int) -> dict[str, Any]:
    """Create a store and churn it (appends evict, reads restore, commits); report the outcome.

    Runs in a forked child. ``op`` is the call that raised: "open" (creation), "append"
    and "read" (eviction and restore), "commit" or "close".
    """
    if fsize_limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, hard))
    model = Model(seed, XGEOM)
    acked: Model | None = None
    pending: Model | None = copy.deepcopy(model)
    store = None
    op = "open"
    try:
        store = pagedkv.open(path, XGEOM, X_POOL)
        acked, pending = pending, None
        for rnd in range(X_ROUNDS):
            for s in range(X_SEQS):
                seq = f"s{s}"
                if rnd == 0:
                    op = "create"
                    model.create(seq)
                    store.create(seq)
                op = "append"
                store.append(seq, *model.next_kv(seq, X_CHUNK))
            op = "read"
            model.verify(store, f"s{rnd % X_SEQS}")  # restores, evicting others
            op = "commit"
            pending = copy.deepcopy(model)
            store.commit()
            acked, pending = pending, None
        op = "close"
        pending = copy.deepcopy(model)
        store.close()
        acked, pending = pending, None
        return dict(error=None, op="done", acked=acked, pending=None)
    except PagedKVError as exc:
        return dict(error=describe(exc), type=type(exc).__name__, message=str(exc), op=op,
                    acked=acked, pending=pending,
                    poisoned=None if store is None else poisoned(store))


class Outcomes:
    """Problems found, plus outcome counts for the figures a run prints."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.kinds: dict[str, int] = {}
        self.ops: dict[str, int] = {}
        self.unnamed_at_open = 0

    def judge(self, where: str, out: dict[str, Any], path: Path,
              space_back: Callable[[], None] | None = None) -> None:
        """Check one exhausted run: the error's kind and message, poisoning, what is on disk."""
        kind = out.get("type", "none")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.ops[out["op"]] = self.ops.get(out["op"], 0) + 1
        if out["error"] is not None:
            if kind != "StoreFull":
                self.problems.append(f"{where}: {out['op']} raised {out['error']}, not StoreFull")
            elif not NAMES_CAUSE.search(out["message"]):
                if out["op"] == "open":
                    self.unnamed_at_open += 1  # creation errors come from the pool file's layer
                else:
                    self.problems.append(f"{where}: {out['op']} raised {out['error']}: names no cause")
            if out["poisoned"] is False:
                self.problems.append(f"{where}: the handle still writes after {kind}")
        allowed = [model_state(out["acked"])]
        if out["pending"] is not None:
            allowed.append(model_state(out["pending"]))
        try:
            state = disk_state(path, check=True)
        except BaseException as exc:  # noqa: BLE001 - reported
            self.problems.append(f"{where}: read-only reopen after {kind}: {describe(exc)}")
            return
        if state not in allowed:
            self.problems.append(f"{where}: after {out['error']} the store is neither the last "
                                 "returned commit nor the one being made")
            return
        if state == ABSENT:
            return
        if space_back is not None:
            space_back()
        try:
            with pagedkv.open(path) as store:  # room again: the store works
                assert store.check() == [], store.check()
                store.create("after")
                store.commit()
        except BaseException as exc:  # noqa: BLE001 - reported
            self.problems.append(f"{where}: writing once there was room again: {describe(exc)}")

    def check(self, label: str, cases: int) -> None:
        print(f"{label}: {cases} cases, outcomes {self.kinds}, by op {self.ops}, "
              f"creation errors naming no cause {self.unnamed_at_open}")
        assert not self.problems, f"{len(self.problems)} problems:\n" + "\n".join(self.problems[:25])
        churned = sum(n for op, n in self.ops.items() if op not in ("open", "done"))
        assert churned >= cases // 2, f"only {churned} of {cases} cases ran out during the churn: {self.ops}"


@pytest.mark.slow
def test_file_size_limit_is_store_full(tmp_path: Path) -> None:
    """RLIMIT_FSIZE at seeded limits from below pool.bin's size to the whole store's."""
    seed = get_seed("RLIMIT_FSIZE")
    rng = random.Random(seed)
    ref = in_child(exhaust, str(tmp_path / "ref" / "store"), None, seed, timeout=120)
    assert ref.status == "ok" and ref.value["error"] is None, str(ref)
    biggest = max(os.path.getsize(os.path.join(root, name))
                  for root, _, names in os.walk(tmp_path / "ref" / "store") for name in names)
    limits = sorted({*(rng.randrange(16 << 10, POOL_BYTES) for _ in range(3)),
                     *(rng.randrange(POOL_BYTES, biggest) for _ in range(27))})
    outcomes = Outcomes()
    for limit in limits:
        path = tmp_path / f"limit{limit}" / "store"
        result = in_child(exhaust, str(path), limit, seed, timeout=120)
        if result.status != "ok":
            outcomes.problems.append(f"limit {limit}: child {result}")
            continue
        outcomes.judge(f"limit {limit}", result.value, path)
    outcomes.check(f"RLIMIT_FSIZE (seed {seed}, limits {limits[0]}..{limits[-1]}, store up to {biggest})",
                   len(limits))


def _mount_tmpfs(where: Path, nbytes: int) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes},mode=0700", "tmpfs", str(where)],
                   check=True, capture_output=True, text=True)


def _remount(where: Path, nbytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={nbytes}", str(where)], check=True,
                   capture_output=True, text=True)


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=True, capture_output=True, text=True)


@pytest.fixture
def tmpfs_allowed(tmp_path: Path) -> None:
    """Skip unless this process may mount a tmpfs (root or CAP_SYS_ADMIN; CI runners often may not)."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount(8) here: a small tmpfs is how disk-full is made real")
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        _mount_tmpfs(probe, 1 << 20)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): "
                    f"{exc.stderr.strip()}")
    _umount(probe)


def _create_only(path: str) -> None:
    pagedkv.open(path, XGEOM, X_POOL).close()


def _disk_full_runs(tmp_path: Path, seed: int, sizes: list[int], outcomes: Outcomes) -> None:
    """``exhaust`` on a tmpfs of each size; each outcome judged, room given back for the reopen."""
    for size in sizes:
        mount = tmp_path / f"fs{size}"
        mount.mkdir()
        _mount_tmpfs(mount, size)
        try:
            path = mount / "store"
            result = in_child(exhaust, str(path), None, seed, timeout=120)
            if result.status != "ok":
                outcomes.problems.append(f"tmpfs of {size}: child {result}")
                continue
            outcomes.judge(f"tmpfs of {size}", result.value, path,
                           space_back=lambda: _remount(mount, 64 << 20))
        finally:
            _umount(mount)


@pytest.mark.slow
def test_disk_full_is_store_full(tmp_path: Path, tmpfs_allowed: None) -> None:
    """A tmpfs of seeded sizes, from just past a new store's size to the whole store's, fills up."""
    seed = get_seed("disk full")
    rng = random.Random(seed)
    ref = in_child(exhaust, str(tmp_path / "ref" / "store"), None, seed, timeout=120)
    assert ref.status == "ok" and ref.value["error"] is None, str(ref)
    total = disk_usage(str(tmp_path / "ref" / "store"))
    assert in_child(_create_only, str(tmp_path / "new" / "store")).status == "ok"
    created = disk_usage(str(tmp_path / "new" / "store")) // 4096 + 2  # pages, with room to open
    sizes = sorted({rng.randrange(created, total // 4096) * 4096 for _ in range(24)})
    outcomes = Outcomes()
    _disk_full_runs(tmp_path, seed, sizes, outcomes)
    outcomes.check(f"disk full (seed {seed}, tmpfs of {sizes[0]}..{sizes[-1]}, store uses {total})",
                   len(sizes))


def test_disk_full_while_creating(tmp_path: Path, tmpfs_allowed: None) -> None:
    """Every tmpfs size from too small for pool.bin to just big enough for a new store."""
    seed = get_seed("disk full at creation")
    assert in_child(_create_only, str(tmp_path / "new" / "store")).status == "ok"
    created = disk_usage(str(tmp_path / "new" / "store")) // 4096 + 2
    sizes = list(range((POOL_BYTES // 4096 - 2) * 4096, created * 4096, 4096))
    outcomes = Outcomes()
    _disk_full_runs(tmp_path, seed, sizes, outcomes)
    print(f"disk full at creation: tmpfs of {sizes[0]}..{sizes[-1]}: {outcomes.kinds}, {outcomes.ops}")
    assert not outcomes.problems, "\n".join(outcomes.problems)


# -- small maps grow ---------------------------------------------------------------------------

MAP_SIZES = [4 << 10, 8 << 10, 16 << 10, 24 << 10, 32 << 10, 40 << 10, 64 << 10, 256 << 10, 1 << 20]
WIDE = Geometry(layers=2, kv_heads=4, head_dim=64, page_size=16, dtype="float32")  # 64 KiB pages


def _churn(store: pagedkv.KVStore, model: Model, rng: random.Random, rounds: int) -> None:
    """Appends that spill, reads that restore, a commit per round; every read checked bit-exact."""
    for _ in range(rounds):
        seq = rng.choice(sorted(model.segs))
        store.append(seq, *model.next_kv(seq, rng.randrange(1, 3 * store.geometry.page_size)))
        model.verify(store, rng.choice(sorted(model.segs)))
        store.commit()


@pytest.mark.parametrize("map_size", [pytest.param(m, id=f"{m >> 10}KiB") for m in MAP_SIZES])
def test_small_map_grows(fast_tmp: Path, map_size: int) -> None:
    """Created with a small map, a store spilling 64 KiB pages grows it; reopened small, again."""
    seed = get_seed(f"map {map_size}")
    rng = random.Random(seed)
    path = fast_tmp / "store"
    model = Model(seed, WIDE)
    with pagedkv.open(path, WIDE, 4, map_size=map_size) as store:
        for s in range(4):
            store.create(f"s{s}")
            model.create(f"s{s}")
        _churn(store, model, rng, 20)
        grown = store._spill.env.info()["map_size"]
        spilled = store.stats()["bytes_spilled"]
    assert spilled > 2 * map_size and grown > map_size, (spilled, grown)
    with pagedkv.open(path, map_size=map_size) as store:  # a reopen asks for the small map again
        model.verify_all(store)
        _churn(store, model, rng, 10)
    with pagedkv.open(path, readonly=True) as store:
        model.verify_all(store)
        assert store.check() == []


def test_one_value_thousands_of_times_the_map(fast_tmp: Path) -> None:
    """One value 4,200 times the map it goes into: the map doubles as often as it takes (13 times)."""
    spill = SpillStore(str(fast_tmp / "spill"), readonly=False, create=True, sync=False, map_size=36 << 10)
    try:
        start = spill.env.info()["map_size"]
        value = bytes(4200 * start)
        spill.write(lambda txn: spill.put(txn, spill.pages, uid_key(1), value), "put")
        grown = spill.env.info()["map_size"]
        with spill.begin_read() as txn:
            assert txn.get(uid_key(1), db=spill.pages) == value
    finally:
        spill.close()
    assert grown >= len(value) > 4096 * start, (start, grown)
