"""``inspect`` and ``verify --live`` beside a live writer: bounded space and memory, no false damage.

A store with a spill file over 1 GiB, a writer in another process committing (appends,
evictions, restores and drops, so LMDB reuses free pages), and repeated ``pagedkv inspect``
and ``pagedkv verify --live`` runs as separate processes, each with:

* ``TMPDIR`` an empty directory, watched while the run lasts (its peak size), and
  ``RLIMIT_FSIZE`` of 4 MiB, so that no file the run writes can grow past it;
* ``RLIMIT_DATA`` of 256 MiB, a hard cap on its private memory (heap and anonymous
  maps; LMDB's shared read-only map of data.mdb is not private), and its resident
  memory sampled from /proc.

Every run must succeed with no damage reported. File-backed resident memory (the
page cache of data.mdb mapped by LMDB, shared and reclaimable) is printed, not
bounded: reading every record to check it touches the whole file.

``verify --live`` run over and over (in this process) beside a writer busy committing,
evicting and restoring reports no damage that is not there, and still reports damage
that is. Seeds are printed; ``PAGEDKV_SEED=<n>`` replays a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import resource
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import pagedkv
from pagedkv import Geometry
from pagedkv.storage.spill import uid_key

from tests.kits.child import Channel, Child
from tests.kits.cli import run as run_cli
from tests.kits.content import get_seed
from tests.kits.files import spill_env
from tests.kits.model import Model
from tests.kits.store import ROOT, tree_state



BIG = pagedkv.Geometry(layers=4, kv_heads=8, head_dim=64, page_size=128, dtype="float16")  # 1 MiB pages
COLD_PAGES, PER_SEQ = 1100, 25  # a spill file of about 1.07 GiB
TEMP_LIMIT = 4 << 20
DATA_LIMIT = 256 << 20
ANON_BOUND = 160 << 20
RUNS = 3


def _pages(seed: int, n: int) -> np.ndarray:
    """``n`` pages of K (and V) content, cheap to make and distinct per ``seed``."""
    words = BIG.layers * n * BIG.page_size * BIG.kv_heads * BIG.head_dim
    base = np.arange(words, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(seed)
    return (base >> np.uint32(16)).astype(np.uint16).view(np.float16).reshape(
        BIG.layers, n * BIG.page_size, BIG.kv_heads, BIG.head_dim)


def _build(path: Path) -> None:
    with pagedkv.open(path, BIG, pool_pages=8, durability="nosync") as store:
        for i in range(COLD_PAGES // PER_SEQ):
            k = _pages(i, PER_SEQ)
            store.create(f"cold-{i}")
            store.append(f"cold-{i}", k, k)


def _writer(chan: Channel, path: str, seed: int) -> None:
    """Child: commit as fast as it can (append, evict, restore, drop) until a message arrives;
    then say how many commits it made."""
    rng = random.Random(seed)
    commits = 0
    with pagedkv.open(path, durability="nosync") as store:
        chan.send("ready")
        while not select.select([chan.read_fd], [], [], 0)[0]:
            name = f"w-{commits}"
            store.create(name)
            k = _pages(10_000 + commits, 1)
            store.append(name, k, k)
            store.read(f"cold-{rng.randrange(COLD_PAGES // PER_SEQ)}", 0, BIG.page_size)  # a restore
            if commits >= 2:
                store.drop(f"w-{commits - 2}")
            store.commit()
            commits += 1
    chan.send(commits)


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (TEMP_LIMIT, TEMP_LIMIT))
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))


def _run(args: list[str], tmpdir: Path) -> tuple[int, str, str, dict[str, int]]:
    """``python -m pagedkv ARGS`` under the limits; (exit code, stdout, stderr, peaks)."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "OPENBLAS_NUM_THREADS": "1", "PAGEDKV_DEBUG": ""}
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=ROOT, preexec_fn=_limits)
    peaks = {"temp": 0}
    done = threading.Event()

    def sample() -> None:
        # Sampling, not synchronisation: the limits above are the hard bounds.
        while not done.wait(0.005):
            for key, value in _status(proc.pid).items():
                peaks[key] = max(peaks.get(key, 0), value)
            peaks["temp"] = max(peaks["temp"], _tree_bytes(tmpdir))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        done.set()
        sampler.join()
    peaks["temp"] = max(peaks["temp"], _tree_bytes(tmpdir))
    return proc.returncode, out.decode(), err.decode(), peaks


@pytest.mark.slow
def test_inspect_and_verify_beside_a_live_writer_use_bounded_space(tmp_path: Path) -> None:
    seed = get_seed("live inspect")
    path = tmp_path / "big.kv"
    _build(path)
    data_bytes = (path / "spill" / "data.mdb").stat().st_size
    assert data_bytes >= 1 << 30
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    results: list[tuple[str, int, str, str, dict[str, int]]] = []
    with Child(_writer, str(path), seed) as writer:
        assert writer.recv(timeout=120) == "ready", "the writer did not start"
        try:
            for _ in range(RUNS):
                for args in (["inspect", "--json", str(path)], ["verify", "--live", "--json", str(path)]):
                    results.append((args[0], *_run(args, tmpdir)))
        finally:
            writer.send("stop")
            commits = writer.recv(timeout=120)
            status = writer.wait()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the writer failed"
    problems = []
    for command, code, out, err, peaks in results:
        print(f"{command}: exit {code}, temp peak {peaks['temp']:,} B, private RSS peak "
              f"{peaks.get('RssAnon', 0) / 2**20:.1f} MiB, file-backed RSS peak {peaks.get('RssFile', 0) / 2**20:.0f} "
              f"MiB, VmHWM {peaks.get('VmHWM', 0) / 2**20:.0f} MiB (data.mdb {data_bytes / 2**30:.2f} GiB)")
        if code != 0:
            problems.append(f"{command} exit {code}: {err.strip()[-500:]}")
            continue
        report = json.loads(out)
        if command == "inspect":
            if not (report["writer"]["locked"] and report["snapshot"]):
                problems.append(f"inspect did not read through a reader slot: {report['writer']}")
        elif not (report["ok"] and report["live"]) or report["damage"]:
            problems.append(f"verify reported damage: {report['damage'][:3]}")
        if peaks["temp"] >= TEMP_LIMIT:
            problems.append(f"{command} used {peaks['temp']:,} B of temporary space")
        if peaks.get("RssAnon", 0) >= ANON_BOUND:
            problems.append(f"{command} used {peaks['RssAnon']:,} B of private memory")
    print(f"the writer committed {commits} times meanwhile")
    assert not problems, "\n".join(problems)
    assert list(tmpdir.iterdir()) == []
    assert commits > len(results), "the writer was not busy: nothing raced the runs"


@pytest.mark.slow
def test_with_no_writer_nothing_is_written_not_even_lock_mdb(tmp_path: Path) -> None:
    """A store copied without LMDB's lock file: inspect, verify and stats create none."""
    path = tmp_path / "s.kv"
    with pagedkv.open(path, BIG, pool_pages=2) as store:
        k = _pages(1, 3)
        store.create("a")
        store.append("a", k, k)
    (path / "spill" / "lock.mdb").unlink()
    before = tree_state(path)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    for args in (["inspect", str(path)], ["inspect", "--json", "--sequences", "--map", str(path)],
                 ["verify", str(path)], ["verify", "--live", "--json", str(path)], ["stats", str(path)]):
        code, out, err, peaks = _run(args, tmpdir)
        assert code == 0, (args, err)
        assert peaks["temp"] == 0
    assert not (path / "spill" / "lock.mdb").exists()
    assert tree_state(path) == before
    assert list(tmpdir.iterdir()) == []


# -- verify --live beside a busy writer, in this process ---------------------------------------------


VGEOM = Geometry(layers=2, kv_heads=2, head_dim=64, page_size=8, dtype="float32")  # 16 KiB pages
V_POOL = 8
HOT = [f"hot{i}" for i in range(6)]
HOT_MAX = 64  # tokens: a longer hot sequence is dropped and created again (records freed)


def _build_hot(path: Path, seed: int, cold_pages: int = 4) -> Model:
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
    result = run_cli("verify", "--live", "--json", path, code=None)
    out = json.loads(result.stdout) if result.stdout.strip() else None
    return result.exit_code, out, result.stderr


@contextlib.contextmanager
def _writer_running(path: Path, seed: int) -> Iterator[Child]:
    """A busy writer on ``path`` in a child, running once it has said so."""
    peer = Child(_busy_writer, str(path), seed)
    try:
        message = peer.recv(timeout=60)
        assert message[0] == "ready", message
        yield peer
    finally:
        if peer.status is None:
            peer.kill()


def _stop(peer: Child) -> int:
    """Stop the busy writer; how many commits it made."""
    peer.send("stop")
    message = peer.recv(timeout=60)
    assert message[0] == "stopped", message
    assert os.WEXITSTATUS(peer.wait()) == 0
    return message[1]


@pytest.mark.slow
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
    _build_hot(path, seed, cold_pages)
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


@pytest.mark.slow
def test_verify_live_beside_busy_writer_still_reports_real_damage(tmp_path: Path) -> None:
    """A spilled record damaged on disk stays DAMAGE on every look, a busy writer beside it or not."""
    seed = get_seed("verify --live damage")
    path = tmp_path / "store"
    _build_hot(path, seed)
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
