"""``inspect`` and ``verify --live`` beside a live writer use bounded temporary space and memory.

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
"""

from __future__ import annotations

import json
import os
import random
import resource
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

import pagedkv
from support import get_seed

ROOT = Path(__file__).resolve().parent.parent
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


def _writer(path: str, seed: int, read_fd: int, write_fd: int) -> None:
    """Child: commit as fast as it can (append, evict, restore, drop) until a byte arrives."""
    rng = random.Random(seed)
    commits = 0
    with pagedkv.open(path, durability="nosync") as store:
        os.write(write_fd, b"r")
        while not select.select([read_fd], [], [], 0)[0]:
            name = f"w-{commits}"
            store.create(name)
            k = _pages(10_000 + commits, 1)
            store.append(name, k, k)
            store.read(f"cold-{rng.randrange(COLD_PAGES // PER_SEQ)}", 0, BIG.page_size)  # a restore
            if commits >= 2:
                store.drop(f"w-{commits - 2}")
            store.commit()
            commits += 1
    os.write(write_fd, commits.to_bytes(8, "little"))


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


def test_inspect_and_verify_beside_a_live_writer_use_bounded_space(tmp_path: Path) -> None:
    seed = get_seed("live inspect")
    path = tmp_path / "big.kv"
    _build(path)
    data_bytes = (path / "spill" / "data.mdb").stat().st_size
    assert data_bytes >= 1 << 30
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    to_child, from_parent = os.pipe()
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 1
        try:
            _writer(str(path), seed, to_child, to_parent)
            code = 0
        finally:
            os._exit(code)
    results: list[tuple[str, int, str, str, dict[str, int]]] = []
    try:
        ready, _, _ = select.select([from_child], [], [], 120)
        assert ready and os.read(from_child, 1) == b"r", "the writer did not start"
        for _ in range(RUNS):
            for args in (["inspect", "--json", str(path)], ["verify", "--live", "--json", str(path)]):
                results.append((args[0], *_run(args, tmpdir)))
    finally:
        os.write(from_parent, b"s")
        ready, _, _ = select.select([from_child], [], [], 120)
        commits = int.from_bytes(os.read(from_child, 8), "little") if ready else -1
        _, status = os.waitpid(pid, 0)
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


def _states(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    out = {}
    for item in [root, *sorted(root.rglob("*"))]:
        st = item.lstat()
        out[str(item.relative_to(root))] = (item.read_bytes() if item.is_file() else None, st.st_mtime_ns,
                                            st.st_mode)
    return out


def test_with_no_writer_nothing_is_written_not_even_lock_mdb(tmp_path: Path) -> None:
    """A store copied without LMDB's lock file: inspect, verify and stats create none."""
    path = tmp_path / "s.kv"
    with pagedkv.open(path, BIG, pool_pages=2) as store:
        k = _pages(1, 3)
        store.create("a")
        store.append("a", k, k)
    (path / "spill" / "lock.mdb").unlink()
    before = _states(path)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    for args in (["inspect", str(path)], ["inspect", "--json", "--sequences", "--map", str(path)],
                 ["verify", str(path)], ["verify", "--live", "--json", str(path)], ["stats", str(path)]):
        code, out, err, peaks = _run(args, tmpdir)
        assert code == 0, (args, err)
        assert peaks["temp"] == 0
    assert not (path / "spill" / "lock.mdb").exists()
    assert _states(path) == before
    assert list(tmpdir.iterdir()) == []
