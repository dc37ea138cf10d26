"""One writer at a time: a second writer, in this process or another, is refused at once.

The lock is held by a forked child that talks with the test over pipes (``kits.child``):
every wait is for a message, never a sleep. Racing creators of a fresh path have one winner;
a SIGKILLed holder's lock is free at once. Waiting for the lock: tests/test_lock_timeout.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv import StoreLocked

from tests.kits.child import Channel, Child, describe, run_python
from tests.kits.faults import Tally, scales
from tests.kits.model import Model, build_committed, fill, hold_writer
from tests.kits.store import GEOM




SEQS = {"a": 21, "b": 30, "c": 9}  # 17 pages through an 8-slot pool: some spilled


def build(path: Path, seed: int, **kwargs: Any) -> Model:
    """A closed store at ``path`` holding ``SEQS`` (one commit); its model."""
    return build_committed(path, SEQS, seed, 8, chunks=1, **kwargs)


# -- T11: one writer ------------------------------------------------------------------------


def test_second_writer_in_another_process_is_locked(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with Child(hold_writer, str(path), SEQS, 1) as holder:
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
    """Every kind of writer open beside a writer of this process is refused at once, naming the
    path and this pid; a reader in another process may read beside it, a writer there may not."""
    path = tmp_path / "store"
    first = pagedkv.open(path, GEOM, 8)
    try:
        model = fill(first, 2, SEQS)
        for kwargs in ({}, {"geometry": GEOM, "pool_pages": 8}, {"durability": "nosync"},
                       {"durability": "volatile"}):
            began = time.monotonic()
            with pytest.raises(StoreLocked) as info:
                pagedkv.open(path, **kwargs)
            assert time.monotonic() - began < 1.0
            assert str(path) in str(info.value) and str(os.getpid()) in str(info.value), str(info.value)
        # A read-only open in the writer's own process is refused too (LMDB cannot open one
        # environment twice in a process); another process may read beside it.
        with pytest.raises(StoreLocked):
            pagedkv.open(path, readonly=True)
        model.verify_all(first)  # the refused opens did not disturb the writer
        first.commit()
        out = run_python("import pagedkv, sys; s = pagedkv.open(sys.argv[1], readonly=True); "
                         "print(sorted(s.sequences())); s.close()", path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(sorted(SEQS))
        out = run_python("import pagedkv, sys; pagedkv.open(sys.argv[1])", path)  # a writer process
        assert out.returncode != 0 and "StoreLocked" in out.stderr and str(os.getpid()) in out.stderr
    finally:
        first.close()
    model.verify_reopened(path)


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


@pytest.mark.slow
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
        peers = [Child(racer, str(path), go_r), Child(racer, str(path), go_r)]
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
    holder = Child(hold_writer, str(path), SEQS, seed)
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
