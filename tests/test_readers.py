"""Readers beside a writer: read-only opens see one snapshot, stale reader slots are cleared.

A read-only open in another process reads beside a live (and a busy) writer; a reader
process killed holding a read transaction must not pin LMDB's pages for ever (the file
stays bounded); a full reader table is a typed error, promptly. Other processes are forked
children that talk to the test over pipes: every wait is for a message, never a sleep.
"""

from __future__ import annotations

import os
import select
from pathlib import Path
from typing import Any

import lmdb
import pytest

import pagedkv
from pagedkv import PagedKVError, ReadOnlyStore

from tests.kits.child import Channel, Child, describe, in_child
from tests.kits.files import DATA_MDB, spill_env
from tests.kits.model import Model, build_committed, fill, hold_writer
from tests.kits.store import GEOM



SEQS = {"a": 21, "b": 30, "c": 9}  # 17 pages through an 8-slot pool: some spilled


def build(path: Path, seed: int, **kwargs: Any) -> Model:
    """A closed store at ``path`` holding ``SEQS`` (one commit); its model."""
    return build_committed(path, SEQS, seed, 8, chunks=1, **kwargs)


def test_readonly_open_beside_a_live_writer(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed = 4
    with Child(hold_writer, str(path), SEQS, seed) as holder:
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


@pytest.mark.slow
def test_readonly_reads_beside_a_busy_writer(tmp_path: Path) -> None:
    """A reader beside a writer that keeps moving pages: never wrong data, never a crash."""
    path = tmp_path / "store"
    seed = 5
    build(path, seed)
    with Child(busy_writer, str(path), seed) as writer:
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
    with Child(hold_read_txn, str(path), False) as bystander:
        assert bystander.recv()[0] == "open"
        reader = Child(hold_read_txn, str(path))
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
    with Child(hold_read_txn, str(path)) as reader:
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
    with Child(fill_readers, path, True) as filler:  # forked before the store is open here
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
    with Child(fill_readers, str(path)) as filler:
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
