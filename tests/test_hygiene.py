"""Locking (T11), stale readers (T12), permissions (T13) and handle hygiene (T15).

Other processes are forked children that talk to the test over pipes: every wait is
for a message, never a sleep.
"""

from __future__ import annotations

import os
import select
import stat
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

import pagedkv
from faultkit import (DATA_MDB, LOCK, LOCK_MDB, POOL, SPILL, Channel, Peer, Tally, copy_store, describe,
                      fast_tmp, fd_count, in_child, maps_count, scales, spill_env)  # noqa: F401
from pagedkv import GeometryMismatch, PagedKVError, ReadOnlyStore, StoreClosed, StoreLocked
from pagedkv.storage import files
from support import GEOM, Model

SEQS = {"a": 21, "b": 30, "c": 9}  # 17 pages through an 8-slot pool: some spilled


def fill(store: pagedkv.KVStore, seed: int, seqs: dict[str, int] = SEQS) -> Model:
    model = Model(seed)
    for seq, tokens in seqs.items():
        store.create(seq)
        model.create(seq)
        k, v = model.next_kv(seq, tokens)
        store.append(seq, k, v)
    store.commit()
    return model


def build(path: Path, seed: int, **kwargs: Any) -> Model:
    store = pagedkv.open(path, GEOM, 8, **kwargs)
    try:
        return fill(store, seed)
    finally:
        store.close()


# -- T11: one writer ------------------------------------------------------------------------


def hold_writer(chan: Channel, path: str, seed: int, create: bool) -> None:
    """Open ``path`` for writing (filling it when creating), report, hold until told to go."""
    store = pagedkv.open(path, GEOM, 8) if create else pagedkv.open(path)
    if create:
        fill(store, seed)
    chan.send(("holding", os.getpid()))
    chan.recv(timeout=120)
    store.close()
    chan.send(("closed", os.getpid()))


def test_second_writer_in_another_process_is_locked(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with Peer(hold_writer, str(path), 1, True) as holder:
        kind, pid = holder.recv()
        assert kind == "holding"
        began = time.monotonic()
        with pytest.raises(StoreLocked) as info:
            pagedkv.open(path)
        elapsed = time.monotonic() - began
        message = str(info.value)
        assert elapsed < 1.0, elapsed
        assert str(path) in message and str(pid) in message, message
        # Creating-style opens (geometry given) are refused the same way, and nothing is touched.
        with pytest.raises(StoreLocked):
            pagedkv.open(path, GEOM, 8)
        holder.send("release")
        assert holder.recv()[0] == "closed"
        holder.wait()
    store = pagedkv.open(path)  # free again
    store.close()


def test_second_writer_in_same_process_is_locked(tmp_path: Path) -> None:
    path = tmp_path / "store"
    first = pagedkv.open(path, GEOM, 8)
    try:
        model = fill(first, 2)
        for kwargs in ({}, {"geometry": GEOM, "pool_pages": 8}, {"durability": "nosync"}):
            began = time.monotonic()
            with pytest.raises(StoreLocked) as info:
                pagedkv.open(path, **kwargs)
            assert time.monotonic() - began < 1.0
            assert str(path) in str(info.value) and str(os.getpid()) in str(info.value), str(info.value)
        # A read-only open in the writer's own process is refused too (LMDB cannot open one
        # environment twice in a process); another process may read beside it (below).
        with pytest.raises(StoreLocked):
            pagedkv.open(path, readonly=True)
        model.verify_all(first)  # the refused opens did not disturb the writer
        first.commit()
    finally:
        first.close()
    again = pagedkv.open(path)
    again.close()


def racer(chan: Channel, path: str, go_fd: int) -> None:
    chan.send("armed")
    os.read(go_fd, 1)  # released together with the other racer
    try:
        store = pagedkv.open(path, GEOM, 8)
    except StoreLocked as exc:
        chan.send(("locked", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001
        chan.send(("error", describe(exc)))
        return
    chan.send(("won", os.getpid()))
    chan.recv(timeout=60)  # hold the store until both racers have reported
    store.close()
    chan.send(("closed", None))


@pytest.mark.parametrize("scale", scales())
def test_simultaneous_opens_of_a_fresh_path_have_one_winner(fast_tmp: Path, scale: str) -> None:
    races = {"ci": 100, "soak": 10000}[scale]
    tally = Tally()
    named_pid = 0
    for race in range(races):
        root = fast_tmp / f"race{race}"
        root.mkdir()
        path = root / "store"
        go_r, go_w = os.pipe()
        peers = [Peer(racer, str(path), go_r), Peer(racer, str(path), go_r)]
        try:
            for peer in peers:
                assert peer.recv() == "armed"
            os.write(go_w, b"gg")
            results = [peer.recv(timeout=30) for peer in peers]
            kinds = sorted(kind for kind, _ in results)
            tally.add(" + ".join(kinds), f"race {race}: {results}")
            for peer, (kind, value) in zip(peers, results):
                if kind == "won":
                    peer.send("release")
                    assert peer.recv()[0] == "closed"
                    winner = value
            if kinds == ["locked", "won"]:
                message = next(value for kind, value in results if kind == "locked")
                named_pid += str(winner) in message
        finally:
            os.close(go_r)
            os.close(go_w)
            for peer in peers:
                peer.wait()
        leftovers = sorted(set(os.listdir(root)) - {"store"})
        assert not leftovers, f"race {race}: {leftovers}"
        store = pagedkv.open(path, readonly=True)
        store.close()
    print(f"T11 races: {races}; {dict(tally.counts)}; the loser named the winner's pid in {named_pid}")
    assert tally.counts == {"locked + won": races}, str(tally)


def test_killed_holder_releases_the_lock_at_once(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed = 3
    holder = Peer(hold_writer, str(path), seed, True)
    assert holder.recv()[0] == "holding"
    holder.kill()
    began = time.monotonic()
    store = pagedkv.open(path)
    elapsed = time.monotonic() - began
    try:
        assert elapsed < 1.0, elapsed
        model = Model(seed)
        for seq, tokens in SEQS.items():
            model.create(seq)
            model.next_kv(seq, tokens)
        model.verify_all(store)
        assert store.check() == []
    finally:
        store.close()


def test_readonly_open_beside_a_live_writer(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed = 4
    with Peer(hold_writer, str(path), seed, True) as holder:
        assert holder.recv()[0] == "holding"
        model = Model(seed)
        for seq, tokens in SEQS.items():
            model.create(seq)
            model.next_kv(seq, tokens)
        reader = pagedkv.open(path, readonly=True)
        try:
            model.verify_all(reader)
            with pytest.raises(ReadOnlyStore):
                reader.create("x")
        finally:
            reader.close()
        holder.send("release")
        assert holder.recv()[0] == "closed"


def busy_writer(chan: Channel, path: str, seed: int) -> None:
    """Evict and restore (and commit) in a loop until told to stop."""
    store = pagedkv.open(path, durability="nosync")
    model = Model(seed)
    for seq, tokens in SEQS.items():
        model.create(seq)
        model.next_kv(seq, tokens)
    chan.send("running")
    rounds = 0
    while True:
        for seq in SEQS:
            store.read(seq)
        store.commit()
        rounds += 1
        ready = select.select([chan.read_fd], [], [], 0)[0]
        if ready:
            break
    chan.recv()
    store.close()
    chan.send(("stopped", rounds))


def read_beside(path: str, seed: int, opens: int) -> dict[str, int]:
    model = Model(seed)
    for seq, tokens in SEQS.items():
        model.create(seq)
        model.next_kv(seq, tokens)
    tally: dict[str, int] = {}
    for _ in range(opens):
        try:
            store = pagedkv.open(path, readonly=True)
        except PagedKVError as exc:
            key = f"open: {type(exc).__name__}"
            tally[key] = tally.get(key, 0) + 1
            continue
        except BaseException as exc:  # noqa: BLE001
            key = f"UNTYPED at open: {describe(exc)}"
            tally[key] = tally.get(key, 0) + 1
            continue
        try:
            for seq in [*SEQS] * 3:  # several rounds per handle: its view of the store ages
                try:
                    k, v = store.read(seq)
                except PagedKVError as exc:
                    key = f"read: {type(exc).__name__}"
                else:
                    ek, ev = model.expected(seq)
                    key = "exact" if k.tobytes() == ek.tobytes() and v.tobytes() == ev.tobytes() else "WRONG"
                tally[key] = tally.get(key, 0) + 1
        except BaseException as exc:  # noqa: BLE001
            key = f"UNTYPED {describe(exc)}"
            tally[key] = tally.get(key, 0) + 1
        finally:
            store.close()
    return tally


def test_readonly_reads_beside_a_busy_writer(tmp_path: Path) -> None:
    """A reader beside a writer that keeps moving pages: never wrong data, never a crash."""
    path = tmp_path / "store"
    seed = 5
    build(path, seed)
    with Peer(busy_writer, str(path), seed) as writer:
        assert writer.recv() == "running"
        result = in_child(read_beside, str(path), seed, 150, timeout=60)
        writer.send("stop")
        kind, rounds = writer.recv()
    print(f"T11 reader beside a busy writer ({rounds} writer rounds): {result}")
    assert result.status == "ok", str(result)
    tally = result.value
    assert not any(key.startswith(("WRONG", "UNTYPED")) for key in tally), tally
    spurious = sum(count for key, count in tally.items() if key != "exact")
    assert spurious == 0, f"a read-only handle beside a live writer failed {spurious} reads: {tally}"


# -- T12: stale readers ------------------------------------------------------------------------


def hold_read_txn(chan: Channel, path: str, take_txn: bool = True) -> None:
    """Open the spill environment directly (with its lock table); optionally hold a read txn."""
    env = spill_env(path, readonly=True, lock=True)
    meta = env.open_db(b"meta", create=False)
    txn = env.begin() if take_txn else None
    if txn is not None:
        assert txn.get(b"superblock", db=meta) is not None
    chan.send(("reading" if take_txn else "open", os.getpid()))
    chan.recv(timeout=600)
    if txn is not None:
        txn.abort()
    env.close()
    chan.send("done")


def cycles(store: pagedkv.KVStore, count: int, sizes: list[int], every: int = 100) -> None:
    """Evict/restore cycles (one cycle = one page restored, one evicted); sample data.mdb size."""
    data = Path(store.path, DATA_MDB)
    done = 0
    next_sample = every
    while done < count:
        for seq in ("a", "b"):
            before = store.stats()["restores"]
            store.read(seq)
            store.commit()
            done += store.stats()["restores"] - before
        if done >= next_sample:
            sizes.append(data.stat().st_size)
            next_sample += every


def test_stale_reader_cleared_and_file_stays_bounded(fast_tmp: Path) -> None:
    path = fast_tmp / "store"
    store = pagedkv.open(path, GEOM, 8, durability="nosync")
    fill(store, 6, {"a": 32, "b": 32})  # 16 pages through 8 slots: every read restores
    store.close()
    # A bystander keeps the environment open (as a live inspector would), so LMDB does not
    # simply reset its lock table at the next open: the dead reader's slot stays stale.
    with Peer(hold_read_txn, str(path), False) as bystander:
        assert bystander.recv()[0] == "open"
        reader = Peer(hold_read_txn, str(path))
        assert reader.recv()[0] == "reading"
        reader.kill()  # dies holding its read transaction
        store = pagedkv.open(path, durability="nosync")
        try:
            stale = store._spill.stale_readers
            sizes: list[int] = []
            total = 1000
            cycles(store, total, sizes)
            assert store.check() == []
        finally:
            store.close()
        bystander.send("stop")
        assert bystander.recv() == "done"
    steady = sizes[0]
    print(f"T12: reader_check cleared {stale}; {total} evict/restore cycles; data.mdb {steady} -> "
          f"{sizes[-1]} bytes (max {max(sizes)})")
    assert stale >= 1, "reader_check cleared no stale reader at open"
    assert max(sizes) <= 2 * steady, sizes


def test_live_reader_grows_the_file_control(fast_tmp: Path) -> None:
    """Control for the bound above: a reader that stays alive pins old pages and the file grows."""
    path = fast_tmp / "store"
    store = pagedkv.open(path, GEOM, 8, durability="nosync")
    fill(store, 7, {"a": 32, "b": 32})
    store.close()
    with Peer(hold_read_txn, str(path)) as reader:
        assert reader.recv()[0] == "reading"
        store = pagedkv.open(path, durability="nosync")
        try:
            sizes: list[int] = []
            cycles(store, 600, sizes)
        finally:
            store.close()
        reader.send("stop")
        assert reader.recv() == "done"
    print(f"T12 control: with a live reader data.mdb {sizes[0]} -> {sizes[-1]} bytes")
    assert sizes[-1] > 2 * sizes[0], sizes


def fill_readers(chan: Channel, path: str, wait: bool = False) -> None:
    """Take every free slot of the reader table (after a "fill" message if ``wait``), then hold them."""
    if wait:
        assert chan.recv(timeout=60) == "fill"
    env = spill_env(path, readonly=True, lock=True)
    txns = []
    while True:
        try:
            txns.append(env.begin())
        except lmdb.ReadersFullError:
            break
    chan.send(("full", len(txns)))
    chan.recv(timeout=600)
    for txn in txns:
        txn.abort()
    env.close()
    chan.send("done")


def try_open_and_read(path: str, seed: int, ready: bool) -> list[str]:
    """Open and read everything; the error types met (or "ok")."""
    out = []
    try:
        store = pagedkv.open(path, durability="nosync")
    except BaseException as exc:  # noqa: BLE001
        return [f"open: {describe(exc)}"]
    try:
        for seq in ("a", "b"):
            try:
                store.read(seq)
                out.append("ok")
            except BaseException as exc:  # noqa: BLE001
                out.append(f"read: {describe(exc)}")
        for name in ("stats", "check", "commit"):
            try:
                getattr(store, name)()
            except BaseException as exc:  # noqa: BLE001
                out.append(f"{name}: {describe(exc)}")
    finally:
        try:
            store.close()
        except BaseException as exc:  # noqa: BLE001
            out.append(f"close: {describe(exc)}")
    return out


def open_then_exhaust(path: str) -> list[str]:
    """Open first, then let another process take every reader slot, then use the store."""
    out = []
    with Peer(fill_readers, path, True) as filler:  # forked before the store is open here
        store = pagedkv.open(path, durability="nosync")
        filler.send("fill")
        kind, taken = filler.recv()
        assert kind == "full", kind
        for seq in ("a", "b", "a"):
            try:
                store.read(seq)
                out.append("ok")
            except BaseException as exc:  # noqa: BLE001
                out.append(f"read: {describe(exc)}")
        for name in ("stats", "check"):
            try:
                getattr(store, name)()
                out.append("ok")
            except BaseException as exc:  # noqa: BLE001
                out.append(f"{name}: {describe(exc)}")
        filler.send("stop")
        filler.recv()
    for seq in ("a", "b"):  # the table is free again: the handle must work as before
        try:
            store.read(seq)
            out.append("ok")
        except BaseException as exc:  # noqa: BLE001
            out.append(f"read after the readers left: {describe(exc)}")
    store.close()
    return out


def test_reader_table_full_is_typed_and_prompt(fast_tmp: Path) -> None:
    path = fast_tmp / "store"
    store = pagedkv.open(path, GEOM, 8, durability="nosync")
    fill(store, 8, {"a": 32, "b": 32})
    store.close()
    problems = []
    with Peer(fill_readers, str(path)) as filler:
        kind, taken = filler.recv()
        assert kind == "full" and taken >= 100, taken
        result = in_child(try_open_and_read, str(path), 8, True, timeout=10)
        filler.send("stop")
        assert filler.recv() == "done"
    print(f"T12 readers full ({taken} slots taken), open afterwards: {result}")
    if result.status != "ok":
        problems.append(f"open with a full reader table: child {result}")
    else:
        problems += [f"open with a full reader table: {line}" for line in result.value
                     if line != "ok" and "pagedkv.errors." not in line]
    result = in_child(open_then_exhaust, str(path), timeout=20)
    print(f"T12 readers full, store opened before: {result}")
    if result.status != "ok":
        problems.append(f"store open before the table filled: child {result}")
    else:
        problems += [f"store open before the table filled: {line}" for line in result.value
                     if line != "ok" and ("pagedkv.errors." not in line or "after" in line)]
    assert not problems, "\n".join(problems)


# -- T13: permissions and links --------------------------------------------------------------


def modes_under_umask(root: str, mask: int) -> list[tuple[str, int, bool]]:
    os.umask(mask)
    path = os.path.join(root, "parent", "child", "store")  # parents are created too
    store = pagedkv.open(path, GEOM, 8)
    fill(store, 9)
    store.close()
    store = pagedkv.open(path, durability="nosync")
    store.read("b")
    store.close()
    pagedkv.open(path, readonly=True).close()
    top = os.path.join(root, "parent")  # created by pagedkv too, as the store's ancestor
    out = [("parent", stat.S_IMODE(os.lstat(top).st_mode), True)]
    for base, dirs, names in os.walk(top):
        for name in dirs + names:
            full = os.path.join(base, name)
            info = os.lstat(full)
            out.append((os.path.relpath(full, root), stat.S_IMODE(info.st_mode), stat.S_ISDIR(info.st_mode)))
    return out


@pytest.mark.parametrize("mask", [0o000, 0o022], ids=["umask000", "umask022"])
def test_private_modes_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    result = in_child(modes_under_umask, str(tmp_path), mask, timeout=60)
    assert result.status == "ok", str(result)
    entries = result.value
    names = {name for name, _, _ in entries}
    for needed in ("parent/child/store/" + POOL, "parent/child/store/" + LOCK,
                   "parent/child/store/" + DATA_MDB, "parent/child/store/" + LOCK_MDB):
        assert needed in names, (needed, sorted(names))
    bad = [(name, oct(mode)) for name, mode, is_dir in entries
           if (is_dir and mode != 0o700) or (not is_dir and mode & 0o077)]
    assert not bad, bad
    assert not [name for name in names if ".creating-" in name]


def _link_out(work: Path, name: str, outside: Path) -> Path:
    """Move ``work/name`` outside the store and leave a symlink to it in its place."""
    target = outside / name.replace("/", "_")
    os.rename(work / name, target)
    os.symlink(target, work / name)
    return target


def _snapshot(target: Path) -> Any:
    if target.is_dir():
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(target.iterdir())}
    return target.read_bytes(), target.stat().st_mtime_ns


@pytest.mark.parametrize("name", [POOL, LOCK, DATA_MDB, LOCK_MDB, SPILL])
@pytest.mark.parametrize("readonly", [False, True], ids=["writer", "readonly"])
def test_symlinked_store_files_are_refused(tmp_path: Path, name: str, readonly: bool) -> None:
    source = tmp_path / "source"
    model = build(source, 10)
    work = copy_store(source, tmp_path / "work")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = _link_out(work, name, outside)
    before = _snapshot(target)
    try:
        store = pagedkv.open(work, readonly=readonly)
    except PagedKVError as exc:
        assert "link" in str(exc), str(exc)
    else:
        store.close()
        # Only a reader may ignore a linked LOCK: it never opens it.
        assert readonly and name == LOCK, f"{name} as a symlink was followed ({'ro' if readonly else 'rw'})"
    assert _snapshot(target) == before, "the link target was touched"
    del model


def test_symlinked_store_directory_is_refused(tmp_path: Path) -> None:
    build(tmp_path / "real", 11)
    os.symlink(tmp_path / "real", tmp_path / "link")
    for readonly in (False, True):
        with pytest.raises(PagedKVError, match="link"):
            pagedkv.open(tmp_path / "link", readonly=readonly)


def test_readonly_open_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    model = build(path, 12)
    files_before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}
    store = pagedkv.open(path, readonly=True)
    try:
        model.verify_all(store)
        store.stats()
    finally:
        store.close()
    files_after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}
    assert files_after == files_before
    # And on a copy nobody may write (a real restriction only when not running as root).
    frozen = copy_store(path, tmp_path / "frozen")
    for p in [frozen, *frozen.rglob("*")]:
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~0o222)
    try:
        store = pagedkv.open(frozen, readonly=True)
        try:
            model.verify_all(store)
        finally:
            store.close()
    finally:
        for p in [frozen, *frozen.rglob("*")]:
            p.chmod(stat.S_IMODE(p.stat().st_mode) | 0o200)


def test_files_are_allocated_and_lmdb_configured(tmp_path: Path) -> None:
    """P6: pool.bin fully reserved; LMDB without writemap, with locking and a sized reader table."""
    path = tmp_path / "store"
    build(path, 13)
    info = os.stat(path / POOL)
    assert info.st_blocks * 512 >= info.st_size, "pool.bin is sparse: posix_fallocate was skipped"
    for durability, synced in (("durable", True), ("nosync", False)):
        store = pagedkv.open(path, durability=durability)
        try:
            env = store._spill.env
            flags = env.flags()
            assert flags["writemap"] is False and flags["lock"] is True, flags
            assert flags["sync"] is synced and flags["metasync"] is synced, flags
            assert env.max_readers() >= 126
        finally:
            store.close()


# -- T15: handle hygiene -------------------------------------------------------------------------


def _cycle(path: Path, kind: int, model: Model, token: list[int]) -> None:
    if kind == 0:  # a writer that appends and commits
        store = pagedkv.open(path, durability="nosync")
        k, v = model.next_kv("a", 1)
        store.append("a", k, v)
        store.commit()
        store.close()
    elif kind == 1:  # a reader
        store = pagedkv.open(path, readonly=True)
        store.read("b")
        store.close()
    elif kind == 2:  # a refused geometry
        with pytest.raises(GeometryMismatch):
            pagedkv.open(path, pagedkv.Geometry(1, 1, 8, 4, "float32"))
    elif kind == 3:  # a refused second writer
        store = pagedkv.open(path, durability="nosync")
        with pytest.raises(StoreLocked):
            pagedkv.open(path)
        store.close()
    token[0] += 1


@pytest.mark.parametrize("scale", scales())
def test_open_close_cycles_return_fds_and_maps(fast_tmp: Path, scale: str) -> None:
    path = fast_tmp / "store"
    model = build(path, 14)
    count = [0]
    for kind in range(4):  # warm up every path once (imports, caches)
        _cycle(path, kind, model, count)
    fds, maps = fd_count(), maps_count()
    total = {"ci": 1000, "soak": 100000}[scale]
    samples = []
    for index in range(total):
        _cycle(path, index % 4, model, count)
        if index % 250 == 249:
            samples.append((fd_count(), maps_count()))
    print(f"T15: {total} open/close cycles; fds {fds} -> {fd_count()}, maps {maps} -> {maps_count()}, "
          f"samples {samples}")
    assert fd_count() == fds, samples
    # A leak per cycle would add hundreds of mappings; the allocator may add an arena or two.
    assert maps_count() <= maps + 2, samples
    assert max(count for _, count in samples) - min(count for _, count in samples) <= 2, samples
    store = pagedkv.open(path)
    try:
        model.verify_all(store)
        assert store.check() == []
    finally:
        store.close()


def test_closed_handles_release_their_mappings(tmp_path: Path) -> None:
    """close() unmaps pool.bin and the LMDB map even while the handle object lives on."""
    path = tmp_path / "store"
    build(path, 15)
    pagedkv.open(path).close()
    # Only the store's files count: a thread's first allocation may map a malloc arena.
    assert maps_count(path) == 0
    kept = []
    for _ in range(20):
        store = pagedkv.open(path)
        store.read("a")
        assert maps_count(path) > 0  # the count sees the maps of an open handle
        store.close()
        kept.append(store)
    leaked = maps_count(path)
    assert leaked == 0, f"{leaked} mappings outlive close() while 20 closed handles are referenced"


def test_use_after_close_raises_store_closed(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path, 16)
    for readonly in (False, True):
        store = pagedkv.open(path, readonly=readonly)
        store.close()
        store.close()  # idempotent
        k = np.zeros((GEOM.layers, 1, GEOM.kv_heads, GEOM.head_dim), GEOM.np_dtype)
        calls = {
            "create": lambda: store.create("z"), "append": lambda: store.append("a", k, k),
            "read": lambda: store.read("a"), "fork": lambda: store.fork("a", "f"),
            "drop": lambda: store.drop("a"), "length": lambda: store.length("a"),
            "sequences": lambda: store.sequences(), "commit": lambda: store.commit(),
            "stats": lambda: store.stats(), "check": lambda: store.check(),
            "pool": lambda: store.pool, "can_step": lambda: store.can_step({"a": 1}),
            "step": lambda: store.step({"a": 1}).__enter__(),
        }
        for name, call in calls.items():
            with pytest.raises(StoreClosed):
                call()
                pytest.fail(f"{name} worked on a closed handle")


def touch_view_after_close(path: str) -> float:
    store = pagedkv.open(path)
    view = store.pool
    first = float(view[0].astype(np.float64).sum())
    store.close()
    return float(view[0].astype(np.float64).sum()) + first * 0  # must not SIGSEGV/SIGBUS


def test_pool_view_kept_past_close_never_crashes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path, 17)
    result = in_child(touch_view_after_close, str(path), timeout=30)
    assert result.status in ("ok", "raised"), str(result)
    if result.status == "raised":
        assert "pagedkv.errors" in result.value, result.value


def use_in_forked_child(store: pagedkv.KVStore) -> str:
    try:
        store.read("a")
    except StoreClosed as exc:
        return f"StoreClosed: {exc}"
    except BaseException as exc:  # noqa: BLE001
        return f"other: {describe(exc)}"
    return "worked"


def test_handle_used_in_a_forked_child_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path, 18)
    store = pagedkv.open(path)
    try:
        result = in_child(use_in_forked_child, store, timeout=30)
        assert result.status == "ok" and result.value.startswith("StoreClosed"), str(result)
        store.read("a")  # the parent's handle is unharmed
        store.commit()
    finally:
        store.close()


def _mountinfo(path: Path, lines: list[tuple[str, str]]) -> Path:
    """A fake /proc/self/mountinfo: (mount point, fstype) lines, octal-escaped like the kernel's."""
    out = []
    for number, (mount, fstype) in enumerate(lines, 20):
        escaped = mount.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
        out.append(f"{number} 1 0:{number} / {escaped} rw,relatime shared:1 - {fstype} src rw\n")
    table = path / "mountinfo"
    table.write_text("".join(out))
    return table


def test_remote_filesystem_is_refused_unless_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(os.path.realpath(tmp_path))
    for name in ("plain", "with space"):
        home = base / name
        home.mkdir()
        monkeypatch.setattr(files, "MOUNTINFO", str(_mountinfo(base, [("/", "ext4"), (str(home), "nfs4")])))
        path = home / "store"
        with pytest.raises(PagedKVError, match="nfs4"):
            pagedkv.open(path, GEOM, 8)
        assert not path.exists()
        store = pagedkv.open(path, GEOM, 8, allow_remote=True)
        store.close()
        for readonly in (False, True):  # an existing store is refused as well
            with pytest.raises(PagedKVError, match="nfs4"):
                pagedkv.open(path, readonly=readonly)
        store = pagedkv.open(path, allow_remote=True)
        store.close()
    # A mount point is a path prefix only at a separator: /x/ab is not under /x/a.
    sibling = base / "ab"
    sibling.mkdir()
    monkeypatch.setattr(files, "MOUNTINFO", str(_mountinfo(base, [("/", "ext4"), (str(base / "a"), "cifs")])))
    pagedkv.open(sibling / "store", GEOM, 8).close()
    # Every fstype of the guard's list is refused.
    for fstype in files.REMOTE_FS:
        monkeypatch.setattr(files, "MOUNTINFO", str(_mountinfo(base, [("/", "ext4"), (str(base), fstype)])))
        with pytest.raises(PagedKVError):
            pagedkv.open(base / "plain" / "store")
