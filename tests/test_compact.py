"""``pagedkv gc`` and ``pagedkv compact``: bytes on disk fall, live sequences stay bit-exact,
and a SIGKILL at every step of a compaction leaves a store that opens clean.

The store: sequences with token ids (so their full pages are prefix-cached) through a
small pool, so most pages are spilled; dropping most sequences leaves their pages as
cache, ``gc`` drops the cache, and ``compact`` returns the freed LMDB pages.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import compact as compact_mod
from pagedkv.demo.kvgen import token_kv

from tests.kits.cli import run
from tests.kits.content import get_seed



ROOT = Path(__file__).resolve().parent.parent
TINY = pagedkv.PRESETS["tiny"]
KV_SEED = 11


def _tokens(seq: int, length: int) -> list[int]:
    return [seq * 100_000 + i for i in range(length)]


def _kv(seq: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    return token_kv(TINY, KV_SEED, seq, np.arange(length))


def _build(path: Path, seed: int, sequences: int = 40) -> dict[int, int]:
    """Sequences of random lengths, most spilled, then most dropped; {kept id: length}."""
    rng = random.Random(seed)
    lengths = {seq: rng.randrange(40, 400) for seq in range(sequences)}
    with pagedkv.open(path, TINY, pool_pages=8) as store:
        for seq, length in lengths.items():
            store.create(seq, tokens=_tokens(seq, length))
            store.append(seq, *_kv(seq, length), tokens=_tokens(seq, length))
        store.commit()
        kept = set(rng.sample(sorted(lengths), sequences // 4))
        for seq in lengths:
            if seq not in kept:
                store.drop(seq)
    return {seq: lengths[seq] for seq in sorted(kept)}


def _check_content(path: Path, kept: dict[int, int]) -> None:
    """Every kept sequence bit-exact, check() clean (a read-only open)."""
    with pagedkv.open(path, readonly=True) as store:
        assert store.check() == []
        assert sorted(store.sequences()) == sorted(kept)
        for seq, length in kept.items():
            k, v = store.read(seq)
            want_k, want_v = _kv(seq, length)
            assert k.tobytes() == want_k.tobytes() and v.tobytes() == want_v.tobytes(), seq


def _data(path: Path) -> Path:
    return path / "spill" / "data.mdb"


def _on_disk(path: Path) -> tuple[int, int]:
    st = _data(path).stat()
    return st.st_size, st.st_blocks * 512


def _leftovers(path: Path) -> list[str]:
    return sorted(name for name in os.listdir(path / "spill") if name.startswith(compact_mod.TEMP_PREFIX))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, int]]:
    seed = get_seed("compact store")
    path = tmp_path_factory.mktemp("compact") / "store.kv"
    kept = _build(path, seed)
    return path, kept


@pytest.fixture
def store_copy(built: tuple[Path, dict[int, int]], tmp_path: Path) -> tuple[Path, dict[int, int]]:
    path, kept = built
    target = tmp_path / "store.kv"
    shutil.copytree(path, target)
    return target, kept


@pytest.mark.slow
def test_gc_then_compact_shrinks_the_file_and_keeps_every_live_sequence(store_copy) -> None:
    path, kept = store_copy
    cached = json.loads(run("stats", path, "--json").stdout)["stats"]["cached_pages"]
    assert cached > 0, "dropping sequences left no cached pages: the test would prove nothing"
    size0, blocks0 = _on_disk(path)

    gc = json.loads(run("gc", path, "--json").stdout)
    assert gc["schema"] == 1 and gc["pages"] == cached and gc["bytes"] > 0 and gc["cached_pages_after"] == 0
    again = run("gc", path).stdout  # nothing left to drop
    assert again.startswith(f"gc {path}: dropped 0 cached pages (every cached page)") and "pagedkv compact" not in again
    _check_content(path, kept)

    out = json.loads(run("compact", path, "--json").stdout)
    size1, blocks1 = _on_disk(path)
    print(f"data.mdb: {size0:,} B ({blocks0:,} allocated) before gc and compact; after: {size1:,} B "
          f"({blocks1:,} allocated)")
    assert out["schema"] == 1 and out["bytes_before"] >= size0 and out["bytes_after"] == size1
    assert size1 < size0 // 2 and blocks1 < blocks0 // 2
    assert out["leftovers_removed"] == 0 and _leftovers(path) == []
    _check_content(path, kept)
    # A writer works on the compacted file: more data, a commit, and it reads back.
    with pagedkv.open(path) as store:
        store.create("after")
        store.append("after", *_kv(999, 50))
        assert store.check() == []
    with pagedkv.open(path, readonly=True) as store:
        k, _ = store.read("after")
        assert k.tobytes() == _kv(999, 50)[0].tobytes()
        for seq, length in kept.items():
            assert store.read(seq)[0].tobytes() == _kv(seq, length)[0].tobytes()
    text = run("compact", path).stdout
    assert text.startswith(f"compacted {path}: spill/data.mdb ") and "returned to the filesystem" in text


def test_gc_max_bytes_keeps_the_newest_cache(store_copy) -> None:
    path, _ = store_copy
    before = json.loads(run("stats", path, "--json").stdout)["stats"]["cached_pages"]
    out = json.loads(run("gc", path, "--max-bytes", "40KiB", "--json").stdout)
    assert out["max_bytes"] == 40 * 1024 and 0 < out["pages"] < before
    assert out["cached_pages_after"] == before - out["pages"] > 0
    run("gc", path, "--max-bytes", "lots", code=2)


def test_gc_and_compact_refuse_a_store_in_use(store_copy) -> None:
    path, kept = store_copy
    ctx = multiprocessing.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_writer, args=(str(path), ready, stop))
    proc.start()
    try:
        assert ready.wait(60)
        for command in ("gc", "compact"):
            result = run(command, path, "--json", code=3)
            assert json.loads(result.stdout)["error"]["kind"] == "StoreLocked"
    finally:
        stop.set()
        proc.join(60)
    assert proc.exitcode == 0
    assert _leftovers(path) == []
    _check_content(path, kept)


def _hold_writer(path: str, ready: Any, stop: Any) -> None:
    with pagedkv.open(path):
        ready.set()
        stop.wait(60)


def test_gc_and_compact_refuse_what_is_not_a_store(tmp_path: Path) -> None:
    for command in ("gc", "compact"):
        result = run(command, tmp_path / "nothing", "--json", code=4)
        assert json.loads(result.stdout)["error"]["exit_code"] == 4
    assert not (tmp_path / "nothing").exists()  # gc opens a writer: it must not create a store


def test_compact_passes_every_named_crash_point(store_copy) -> None:
    """The crash points the SIGKILL test stops at are the ones compact passes, in order."""
    path, _ = store_copy
    before = pagedkv.faults.hits()
    compact_mod.compact(path)
    after = pagedkv.faults.hits()
    passed = [name for name in compact_mod.CRASH_POINTS if after.get(name, 0) == before.get(name, 0) + 1]
    assert passed == list(compact_mod.CRASH_POINTS)


_COMPACT = "import sys, pagedkv.compact as c; c.compact(sys.argv[1])"


@pytest.mark.slow
@pytest.mark.parametrize("point", compact_mod.CRASH_POINTS)
def test_sigkill_at_every_step_of_compact(point: str, store_copy) -> None:
    path, kept = store_copy
    run("gc", path)
    size0, _ = _on_disk(path)
    env = {**os.environ, "PAGEDKV_CRASHPOINT": f"{point}:1"}
    proc = subprocess.run([sys.executable, "-c", _COMPACT, str(path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-2000:])
    copy_left = _leftovers(path)
    # Killed with its copy written but not yet renamed, it leaves the copy behind...
    if point in ("compact.after_copy", "compact.before_rename"):
        assert len(copy_left) == 1, copy_left
    else:
        assert copy_left == []
    size1, _ = _on_disk(path)
    if point in ("compact.after_rename", "compact.after_sync"):
        assert size1 < size0 // 2  # the new file is in place
    else:
        assert size1 == size0  # the old one, untouched
    # ...which the next open deletes; every committed sequence is bit-exact.
    with pagedkv.open(path) as store:
        assert store.check() == []
    assert _leftovers(path) == []
    _check_content(path, kept)
    out = compact_mod.compact(path)  # and a compaction after it works
    assert out["leftovers_removed"] == 0 and _leftovers(path) == []
    _check_content(path, kept)


def test_compact_removes_a_leftover_copy(store_copy) -> None:
    path, kept = store_copy
    (path / "spill" / f"{compact_mod.TEMP_PREFIX}12345-deadbeef").write_bytes(b"half a copy")
    out = compact_mod.compact(path)
    assert out["leftovers_removed"] == 1 and _leftovers(path) == []
    _check_content(path, kept)


def test_compact_refuses_a_damaged_store_and_changes_nothing(store_copy) -> None:
    path, _ = store_copy
    import lmdb

    env = lmdb.open(str(path / "spill"), max_dbs=5)
    with env.begin(write=True) as txn:
        txn.put(b"superblock", b"\xc1 not msgpack", db=env.open_db(b"meta", txn=txn))
    env.close()
    before = _data(path).read_bytes()
    result = run("compact", path, "--json", code=4)
    assert json.loads(result.stdout)["error"]["kind"] == "StoreCorrupt"
    assert _data(path).read_bytes() == before and _leftovers(path) == []


def _reads_right(store: pagedkv.KVStore, seq: int, length: int) -> bool:
    """The right bytes, or PageCorrupt of a pool slot: never other bytes.

    The writer that ran since this read-only handle opened may have reused the
    pool slot of a resident page; the handle's view of the pool is then stale
    (its LMDB snapshot is not), and the checksum says so.
    """
    try:
        return store.read(seq)[0].tobytes() == _kv(seq, length)[0].tobytes()
    except pagedkv.PageCorrupt as exc:
        return "pool slot" in str(exc)


def _reader(path: str, kept: dict[int, int], conn: Any) -> None:
    """Child: a registered reader (opened beside a writer) that outlives a compaction."""
    with pagedkv.open(path, readonly=True) as store:
        conn.send(bool(store._spill.env.flags()["lock"]))
        conn.recv()  # the compaction and a new writer's commit are done
        conn.send(all(_reads_right(store, seq, length) for seq, length in kept.items()))
        conn.recv()


def _bump(path: Path) -> None:
    """One LMDB transaction that changes no content (a key put and deleted): the txn id moves on by one."""
    import lmdb

    env = lmdb.open(str(path / "spill"), max_dbs=5)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"bump", b"x")
            txn.delete(b"bump")
    finally:
        env.close()


@pytest.mark.slow
def test_a_reader_open_across_a_compaction_and_the_next_writer(store_copy) -> None:
    """A reader slot held across the swap: the writer after it shares lock.mdb's last txn id.

    That writer picks the meta page the lock file's transaction id names (slot id & 1):
    the copy's meta pages carry the original's id, so it reads the compacted commit
    whichever the parity. Rounds go on until both parities were compacted (every other one
    adds a transaction, so the parity changes within two rounds).
    """
    from pagedkv.snapshot import lmdb_meta

    path, kept = store_copy
    ctx = multiprocessing.get_context("fork")
    parities: list[int] = []
    for round_ in range(6):
        if round_ % 2:
            _bump(path)  # rounds apart by one transaction more or less: one of two changes the parity
        parent, child = ctx.Pipe()
        ready, stop = ctx.Event(), ctx.Event()
        writer = ctx.Process(target=_hold_writer, args=(str(path), ready, stop))
        writer.start()
        assert ready.wait(60)
        proc = ctx.Process(target=_reader, args=(str(path), kept, child))
        proc.start()
        try:
            assert parent.poll(60) and parent.recv() is True, "the reader did not register"
            stop.set()
            writer.join(60)
            assert writer.exitcode == 0
            before = lmdb_meta(str(path))["txnid"]
            compact_mod.compact(path)
            carried = lmdb_meta(str(path))["txnid"]
            assert carried > before, (before, carried)  # the copy goes on from the original's id
            parities.append(carried & 1)
            with pagedkv.open(path) as store:  # lock.mdb is still held open by the reader
                assert store.check() == []
                for seq, length in kept.items():
                    assert store.read(seq)[0].tobytes() == _kv(seq, length)[0].tobytes()
                store.create(f"new-{round_}")
                store.append(f"new-{round_}", *_kv(777, 40))
            parent.send("read")
            assert parent.poll(60) and parent.recv() is True, "the reader's snapshot changed under it"
            parent.send("stop")
        finally:
            stop.set()
            proc.join(60)
            writer.join(60)
        assert proc.exitcode == 0
        if set(parities) == {0, 1}:
            break
    assert set(parities) == {0, 1}, f"compacted only at txn id parity {parities}"
    with pagedkv.open(path, readonly=True) as store:
        assert store.check() == []
        assert store.read("new-0")[0].tobytes() == _kv(777, 40)[0].tobytes()
