"""Error kinds at the edges: real exhaustion, tiny LMDB maps, verify beside a busy writer.

* ``RLIMIT_FSIZE`` (in a forked child, SIGXFSZ ignored) and a full disk (a small tmpfs,
  where this machine lets us mount one) at many seeded limits: whatever eviction or commit
  raises is ``StoreFull`` naming ENOSPC / EFBIG, the handle is poisoned, and a reopen finds
  the last returned commit (or the one being made), every page intact and usable.
* Stores created with LMDB maps from 4 KiB to 1 MiB grow on their own while pages many
  times the map's size spill, and one value thousands of times the map goes in one
  transaction, creating the named databases included.
* ``pagedkv verify --live`` run over and over beside a writer busy committing, evicting and
  restoring reports no damage that is not there, and still reports damage that is.

Seeds are printed; ``PAGEDKV_SEED=<n>`` replays a run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import resource
import select
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from click.testing import CliRunner

import pagedkv
from faultkit import Channel, Peer, describe, fast_tmp, in_child, spill_env  # noqa: F401
from pagedkv import Geometry, PagedKVError, StoreClosed
from pagedkv.cli.commands import cli
from pagedkv.storage.files import disk_usage
from pagedkv.storage.spill import SpillStore, uid_key
from support import Model, get_seed

PROBE = "__poison_probe__"
NAMES_CAUSE = re.compile(r"ENOSPC|EFBIG|EDQUOT|disk full|file size limit", re.IGNORECASE)

# -- real exhaustion ---------------------------------------------------------------------------

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
        poisoned = None
        if store is not None:
            poisoned = True
            try:
                store.create(PROBE)
                poisoned = False
            except StoreClosed:
                pass
            store._abandon()
        return dict(error=describe(exc), type=type(exc).__name__, message=str(exc), op=op,
                    acked=acked, pending=pending, poisoned=poisoned)


def model_state(model: Model | None) -> Any:
    """What a store holding ``model`` reads back: {seq: (length, K bytes, V bytes)}, None if absent."""
    if model is None:
        return None
    out = {}
    for seq in model.segs:
        k, v = model.expected(seq)
        out[seq] = (model.lens[seq], k.tobytes(), v.tobytes())
    return out


def disk_state(path: Path) -> Any:
    """What a read-only open of ``path`` reads back (None when there is no store)."""
    if not path.exists():
        return None
    store = pagedkv.open(path, readonly=True)
    try:
        assert store.check() == [], store.check()
        out = {}
        for seq in store.sequences():
            k, v = store.read(seq)
            out[seq] = (store.length(seq), k.tobytes(), v.tobytes())
        return out
    finally:
        store.close()


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
            state = disk_state(path)
        except BaseException as exc:  # noqa: BLE001 - reported
            self.problems.append(f"{where}: read-only reopen after {kind}: {describe(exc)}")
            return
        if state not in allowed:
            self.problems.append(f"{where}: after {out['error']} the store is neither the last "
                                 "returned commit nor the one being made")
            return
        if state is None:
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


# -- small maps grow -----------------------------------------------------------------------------

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


# -- verify --live beside a busy writer ------------------------------------------------------------

VGEOM = Geometry(layers=2, kv_heads=2, head_dim=64, page_size=8, dtype="float32")  # 16 KiB pages
V_POOL = 8
HOT = [f"hot{i}" for i in range(6)]
HOT_MAX = 64  # tokens: a longer hot sequence is dropped and created again (records freed)


def _build(path: Path, seed: int, cold_pages: int = 4) -> Model:
    """A closed store: the hot sequences a writer churns, and a cold one it never touches."""
    model = Model(seed, VGEOM)
    with pagedkv.open(path, VGEOM, V_POOL, durability="nosync") as store:
        store.create("cold")
        model.create("cold")
        for _ in range(0, cold_pages, V_POOL):
            store.append("cold", *model.next_kv("cold", min(V_POOL, cold_pages) * VGEOM.page_size))
        store.commit()
        for seq in HOT:  # pushes every cold page out to the spill store
            store.create(seq)
            model.create(seq)
            store.append(seq, *model.next_kv(seq, 3 * VGEOM.page_size))
            store.commit()
    return model


def _busy_writer(chan: Channel, path: str, seed: int) -> None:
    """Child: commit, evict and restore as fast as it can until the parent says stop."""
    rng = random.Random(seed)
    model = Model(seed, VGEOM)
    with pagedkv.open(path, durability="nosync") as store:
        for seq in HOT:  # new content under the same ids: the old pages become garbage
            store.drop(seq)
            store.create(seq)
            model.create(seq)
            store.append(seq, *model.next_kv(seq, rng.randrange(1, HOT_MAX)))
        store.commit()
        commits = 1
        chan.send(("ready", os.getpid()))
        while not select.select([chan.read_fd], [], [], 0)[0]:
            seq = rng.choice(HOT)
            if model.lens[seq] > HOT_MAX:
                store.drop(seq)
                store.create(seq)
                model.create(seq)
            store.append(seq, *model.next_kv(seq, rng.randrange(1, 2 * VGEOM.page_size)))
            model.verify(store, rng.choice(HOT))  # restores what it reads, evicting others
            store.commit()
            commits += 1
        chan.recv()
    chan.send(("stopped", commits))


def _verify_live(path: Path) -> tuple[int, Any, str]:
    """``pagedkv verify --live --json PATH``: (exit code, parsed stdout or None, stderr)."""
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        runner = CliRunner()
    result = runner.invoke(cli, ["verify", "--live", "--json", str(path)], catch_exceptions=False)
    out = json.loads(result.stdout) if result.stdout.strip() else None
    return result.exit_code, out, result.stderr


@contextlib.contextmanager
def _writer_running(path: Path, seed: int) -> Iterator[Peer]:
    """A busy writer on ``path`` in a child, running once it has said so."""
    peer = Peer(_busy_writer, str(path), seed)
    try:
        message = peer.recv(timeout=60)
        assert message[0] == "ready", message
        yield peer
    finally:
        if peer.status is None:
            peer.kill()


def _stop(peer: Peer) -> int:
    """Stop the busy writer; how many commits it made."""
    peer.send("stop")
    message = peer.recv(timeout=60)
    assert message[0] == "stopped", message
    assert os.WEXITSTATUS(peer.wait()) == 0
    return message[1]


@pytest.mark.parametrize("cold_pages, runs, min_clean", [(4, 60, 30), (2048, 10, 0)],
                         ids=["small", "large"])
def test_verify_live_beside_busy_writer_reports_no_false_damage(tmp_path: Path, cold_pages: int,
                                                                runs: int, min_clean: int) -> None:
    """Many ``verify --live`` runs while a writer commits, evicts and restores: never DAMAGE.

    Each run reads the writer's last commit through a reader slot, whatever the size of
    data.mdb (32 MiB for the large one); a run that sees pool slots the writer rewrote
    must say it got no consistent snapshot, never call it damage.
    """
    seed = get_seed("verify --live")
    path = tmp_path / "store"
    _build(path, seed, cold_pages)
    tally: dict[str, int] = {}
    problems: list[str] = []
    with _writer_running(path, seed) as peer:
        for run in range(runs):
            code, out, err = _verify_live(path)
            if code == 0 and out is not None and out["ok"] and out["live"]:
                tally["clean"] = tally.get("clean", 0) + 1
            elif code == 3 and "could not get a consistent snapshot" in err:
                tally["no snapshot"] = tally.get("no snapshot", 0) + 1
            else:
                tally["DAMAGE"] = tally.get("DAMAGE", 0) + 1
                shown = out["damage"][:3] if out else err.strip()
                problems.append(f"run {run}: exit {code}: {shown}")
        commits = _stop(peer)
    print(f"verify --live x{runs} beside a writer that committed {commits} times: {tally}")
    assert not problems, f"{len(problems)} false damage reports:\n" + "\n".join(problems[:10])
    assert commits > runs, "the writer was not busy: the race was never run"
    assert tally.get("clean", 0) >= min_clean, f"too few runs got a snapshot to verify: {tally}"
    code, out, _ = _verify_live(path)  # the writer is gone: the store is clean, with no snapshot
    assert code == 0 and out["ok"] and not out["live"], out


def test_verify_live_beside_busy_writer_still_reports_real_damage(tmp_path: Path) -> None:
    """A spilled record damaged on disk stays DAMAGE on every look, a busy writer beside it or not."""
    seed = get_seed("verify --live damage")
    path = tmp_path / "store"
    _build(path, seed)
    with pagedkv.open(path, readonly=True) as store:
        mgr = store._mgr
        cold = next(seq for seq in store._seqs.values() if seq.seq_id == "cold")
        spilled = [int(mgr.uid[pid]) for pid in cold.table.tolist() if mgr.slot[pid] < 0]
    assert spilled, "the cold sequence has no spilled page"
    uid = spilled[0]
    env = spill_env(path, max_dbs=5)
    try:
        pages = env.open_db(b"pages", create=False)
        with env.begin(write=True) as txn:
            record = bytearray(txn.get(uid_key(uid), db=pages))
            record[-1] ^= 0x40  # a payload bit: the record's checksum no longer matches
            txn.put(uid_key(uid), bytes(record), db=pages)
    finally:
        env.close()
    named = re.compile(rf"\bpage {uid}\b|\buid {uid}\b|\b{uid}\b")
    reports = 0
    with _writer_running(path, seed) as peer:
        for run in range(8):
            code, out, err = _verify_live(path)
            if code == 3:
                assert "could not get a consistent snapshot" in err, err
                continue
            assert code == 1 and out is not None and not out["ok"], (code, out, err)
            assert any(named.search(problem["message"]) for problem in out["damage"]), out["damage"]
            reports += 1
        commits = _stop(peer)
    print(f"damaged store, writer committed {commits} times: {reports} of 8 runs reported the damage")
    assert reports >= 4, f"only {reports} of 8 runs got a snapshot to verify"
    code, out, _ = _verify_live(path)
    assert code == 1 and any(named.search(problem["message"]) for problem in out["damage"]), out
