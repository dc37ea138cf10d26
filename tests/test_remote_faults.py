"""Faults of the remote tier on real redis-servers: none reaches the engine, none serves a wrong byte.

Each test breaks the tier a different way (killed, paused, asleep, flushed, its
values damaged, full, refusing without a password, a read-only replica, another
model beside us) and checks the same things: the store's API raises nothing, every
reused byte is the prefilling host's, the counter of that fault moves, and each
``step()``, ``commit()`` and ``create()`` returns within a bound derived from the
configured timeouts.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner

import pagedkv
from kits.redisserver import RedisServer, replica_of
from pagedkv.remote import RemoteConfig, record
from tests.kits.content import kv, same_bits
from tests.kits.store import GEOM, engine_write

pytest_plugins = ("kits.redisserver",)  # its redis_server, redis_clean, redis_cluster fixtures

SLACK = 0.5  # seconds of scheduling noise on a shared machine, beyond the configured timeouts
MODEL = "llama-3-8b@abc"
SECRET = "s3cret-Pw!"


def config(url: str, **fields: Any) -> RemoteConfig:
    fields.setdefault("backoff_min", 0.05)
    fields.setdefault("backoff_max", 0.2)
    return RemoteConfig(url, connect_timeout=0.05, op_timeout=0.05, publish_timeout=0.2,
                        close_timeout=10.0, **fields)


def bound(remote: RemoteConfig) -> float:
    """The most any store operation may take while the tier misbehaves: one connect, one wait."""
    return remote.connect_timeout + max(remote.op_timeout, remote.publish_timeout) + SLACK


def open_store(path: Path, remote: RemoteConfig, model: str = MODEL) -> pagedkv.KVStore:
    return pagedkv.open(path, GEOM, pool_pages=256, model=model, remote=remote, durability="nosync")


def prompt(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, count, dtype=np.int64)


def timed(limit: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, asserted to return within ``limit`` seconds."""
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    took = time.perf_counter() - started
    assert took < limit, f"{getattr(fn, '__name__', fn)} took {took:.3f}s, bound {limit:.3f}s"
    return out


def prefill(store: pagedkv.KVStore, seq: str, tokens: np.ndarray, seed: int) -> None:
    store.create(seq)
    k, v = kv(seed, seq, 0, len(tokens))
    store.append(seq, k, v, tokens=tokens)
    store.commit()


def decode(store: pagedkv.KVStore, seq: str, steps: int, seed: int, limit: float) -> None:
    """``steps`` decode steps of ``seq`` with token ids (so pages seal and queue), each timed, then a commit."""
    for _ in range(steps):
        pos = store.length(seq)
        started = time.perf_counter()
        with store.step({seq: 1}, tokens={seq: [pos % 50000]}) as step:
            engine_write(store, step, [kv(seed, seq, pos, 1)])
        took = time.perf_counter() - started
        assert took < limit, f"step() took {took:.3f}s, bound {limit:.3f}s"
    timed(limit, store.commit)


def assert_exact(store: pagedkv.KVStore, seq: str, source: str, count: int, seed: int) -> None:
    k, v = store.read(seq, 0, count)
    want_k, want_v = kv(seed, source, 0, count)
    assert same_bits(k, want_k) and same_bits(v, want_v)


def until(what: str, check: Any, seconds: float = 15.0) -> None:
    """Repeat ``check()`` (which does real work each time) until it is true; a backoff must run out."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"


# -- the server goes away, hangs, forgets -------------------------------------------------


def test_killed_mid_run_and_restarted(tmp_path: Path, redis_clean: RedisServer) -> None:
    remote = config(redis_clean.url)
    limit = bound(remote)
    tokens = prompt(400, 1)
    with open_store(tmp_path / "a", remote) as a:
        prefill(a, "s", tokens, 1)
        assert a._remote.drain() and a.stats()["remote_published"] == 100
        redis_clean.kill()
        decode(a, "s", 12, 1, limit)  # three pages sealed and committed with the tier gone
        assert timed(limit, a.create, "t", tokens=prompt(400, 2)) == 0
        a._remote.drain()
        stats = a.stats()
        assert stats["remote_errors"] >= 1 and stats["remote_skipped"] >= 3
        assert a.create("u", tokens=tokens) == 396  # the local cache is untouched
        redis_clean.start()  # back, empty
        attempts = iter(range(10, 1 << 20))

        def published() -> bool:
            # A page of a fresh sequence per attempt, sealed by its last decode step: growing
            # one sequence per attempt would pass the pool's size while the client backs off.
            seed = next(attempts)
            prefill(a, f"r{seed}", prompt(GEOM.page_size - 1, seed), seed)
            decode(a, f"r{seed}", 1, seed, limit)
            a._remote.drain()
            return a.stats()["remote_published"] > 100

        until("publishing resumed after the restart", published)
        assert a.check() == []
    assert int(redis_clean.cli("DBSIZE")) >= 1


def _published_prompt(tmp_path: Path, url: str, count: int = 400, seed: int = 3) -> np.ndarray:
    tokens = prompt(count, seed)
    with open_store(tmp_path / "a", config(url)) as a:
        prefill(a, "src", tokens, seed)
    return tokens


@pytest.mark.slow
def test_paused_server(tmp_path: Path, redis_clean: RedisServer) -> None:
    tokens = _published_prompt(tmp_path, redis_clean.url)
    remote = config(redis_clean.url)
    limit = bound(remote)
    with open_store(tmp_path / "b", remote) as b:
        prefill(b, "own", prompt(40, 9), 9)
        redis_clean.cli("CLIENT", "PAUSE", "5000", "ALL")
        try:
            assert timed(limit, b.create, "x", tokens=tokens) == 0
            assert b.stats()["remote_timeouts"] == 1
            assert timed(limit, b.lookup, tokens) == 0  # backing off: no second wait
            decode(b, "own", 8, 9, limit)
        finally:
            redis_clean.cli("CLIENT", "UNPAUSE")
        until("a fetch after the pause", lambda: b.lookup(tokens) == 400)
        assert b.create("y", tokens=tokens) == 396
        assert_exact(b, "y", "src", 396, 3)
        assert b.check() == []


@pytest.mark.slow
def test_server_asleep(tmp_path: Path, redis_clean: RedisServer) -> None:
    tokens = _published_prompt(tmp_path, redis_clean.url)
    remote = config(redis_clean.url)
    limit = bound(remote)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    probe = redis_clean.client(socket_timeout=0.05, socket_connect_timeout=0.05, retry=Retry(NoBackoff(), 0))
    with open_store(tmp_path / "b", remote) as b:
        sleeper = subprocess.Popen([redis_clean.cli_bin, "-p", str(redis_clean.port), "DEBUG", "SLEEP", "3"],
                                   stdout=subprocess.DEVNULL)
        try:
            def asleep() -> bool:
                try:
                    probe.ping()
                    return False
                except redis.exceptions.TimeoutError:
                    return True

            until("the server is asleep", asleep, 5.0)
            assert timed(limit, b.create, "x", tokens=tokens) == 0
            assert b.stats()["remote_timeouts"] >= 1
            prefill(b, "own", prompt(40, 8), 8)
            decode(b, "own", 8, 8, limit)
        finally:
            sleeper.wait(timeout=30)
        until("a fetch after the sleep", lambda: b.lookup(tokens) == 400)
        assert_exact(b, "own", "own", 40, 8)
        assert b.check() == []


def test_flushed_server(tmp_path: Path, redis_clean: RedisServer) -> None:
    tokens = _published_prompt(tmp_path, redis_clean.url)
    redis_clean.cli("FLUSHALL")
    with open_store(tmp_path / "b", config(redis_clean.url)) as b:
        assert b.create("x", tokens=tokens) == 0
        stats = b.stats()
        assert stats["remote_fetch_misses"] == 1 and stats["remote_rejected"] == 0 and stats["remote_errors"] == 0


# -- damaged and foreign values -----------------------------------------------------------


def _key(store: pagedkv.KVStore, tokens: np.ndarray, index: int) -> bytes:
    tier = store._remote
    return tier.key(record.chain(tier.salt, tokens.astype("<u4"), GEOM.page_size, index + 1)[index])


@pytest.mark.parametrize("damage", ["garbage", "truncated", "copied", "bit flip", "empty"])
def test_damaged_value_is_a_miss(tmp_path: Path, redis_clean: RedisServer, damage: str, seed: int) -> None:
    tokens = _published_prompt(tmp_path, redis_clean.url, 40, seed)
    client = redis_clean.client()
    rng = np.random.default_rng(seed)
    with open_store(tmp_path / "b", config(redis_clean.url)) as b:
        key = _key(b, tokens, 5)
        value = client.get(key)
        flipped = bytearray(value)
        flipped[int(rng.integers(len(value) - GEOM.page_nbytes, len(value)))] ^= 1 << int(rng.integers(8))
        client.set(key, {"garbage": rng.bytes(len(value)), "truncated": value[:len(value) - 7],
                         "copied": client.get(_key(b, tokens, 2)), "bit flip": bytes(flipped),
                         "empty": b""}[damage])
        assert b.create("x", tokens=tokens) == 20  # pages 0-4; page 5 is refused, so nothing after it
        assert b.stats()["remote_rejected"] == 1 and b.stats()["remote_fetched"] == 5
        assert_exact(b, "x", "src", 20, seed)
        assert b.check() == []


def test_another_models_store_on_the_same_redis(tmp_path: Path, redis_clean: RedisServer) -> None:
    tokens = _published_prompt(tmp_path, redis_clean.url, 40)
    with open_store(tmp_path / "c", config(redis_clean.url), model="mistral-7b@def") as c:
        assert c.create("x", tokens=tokens) == 0 and c.stats()["remote_fetch_misses"] == 1
        # Our pages copied under the other model's keys are refused, never served.
        with open_store(tmp_path / "a2", config(redis_clean.url)) as a:
            ours = redis_clean.client().get(_key(a, tokens, 0))
        redis_clean.client().set(_key(c, tokens, 0), ours)
        assert c.create("y", tokens=tokens) == 0 and c.stats()["remote_rejected"] == 1
        assert c.check() == []


# -- refusals: full, password, replica -------------------------------------------------------


def test_full_server_refuses_writes_reads_go_on(tmp_path: Path, redis_clean: RedisServer) -> None:
    tokens = _published_prompt(tmp_path, redis_clean.url)
    redis_clean.cli("CONFIG", "SET", "maxmemory", "1")  # every write is OOM now
    remote = config(redis_clean.url)
    limit = bound(remote)
    with open_store(tmp_path / "b", remote) as b:
        prefill(b, "new", prompt(200, 5), 5)
        decode(b, "new", 8, 5, limit)
        b._remote.drain()
        stats = b.stats()
        assert stats["remote_refused"] >= 1 and stats["remote_published"] == 0 and stats["remote_skipped"] >= 1
        assert b.create("x", tokens=tokens) == 396  # a refused write does not stop fetches
        assert_exact(b, "x", "src", 396, 3)


def test_password_required(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.cli.commands import cli

    caplog.set_level(logging.DEBUG, logger="pagedkv")
    server = RedisServer(tmp_path / "srv", password=SECRET)
    monkeypatch.delenv("PAGEDKV_REMOTE_PASSWORD", raising=False)
    try:
        quoted = SECRET.replace("!", "%21")
        good = f"redis://:{quoted}@127.0.0.1:{server.port}/0"
        tokens = _published_prompt(tmp_path, good)
        assert int(server.cli("DBSIZE")) == 100
        seen: list[str] = []
        for name, url in (("none", server.url), ("wrong", f"redis://:wrong-pw@127.0.0.1:{server.port}/0")):
            remote = config(url)
            with open_store(tmp_path / name, remote) as store:
                assert timed(bound(remote), store.create, "x", tokens=tokens) == 0
                prefill(store, "own", prompt(40, 4), 4)
                store._remote.drain()
                stats = store.stats()
                assert stats["remote_refused"] >= 1 and stats["remote_fetched"] == 0
                seen.append(repr(stats))
        monkeypatch.setenv("PAGEDKV_REMOTE_PASSWORD", SECRET)
        with open_store(tmp_path / "env", config(server.url)) as store:  # the password from the environment
            assert store.create("x", tokens=tokens) == 396
            seen += [repr(store.stats()), repr(store._remote.config), repr(store._remote.client.url)]
        with pytest.raises(pagedkv.PagedKVError) as info:
            pagedkv.open(tmp_path / "bad", remote=f"redis://:{quoted}@127.0.0.1:0x10/0")
        seen.append(str(info.value))
        for path in ("a", "none", "env"):
            for args in (["--json"], []):
                result = CliRunner().invoke(cli, ["inspect", str(tmp_path / path), *args])
                assert result.exit_code == 0
                seen.append(result.output)
        assert "remote tier" in seen[-1]
        seen.append(caplog.text)
        assert "NOAUTH" in caplog.text or "Authentication" in caplog.text or "WRONGPASS" in caplog.text
        for text in seen:
            assert SECRET not in text and quoted not in text and "wrong-pw" not in text
    finally:
        server.stop()


@pytest.mark.slow
def test_read_only_replica(tmp_path: Path, redis_clean: RedisServer) -> None:
    replica = replica_of(tmp_path / "replica", redis_clean)
    try:
        tokens = _published_prompt(tmp_path, redis_clean.url)
        until("the replica has the pages", lambda: int(replica.cli("DBSIZE")) == 100)
        remote = config(replica.url)
        with open_store(tmp_path / "r", remote) as r:
            assert r.create("x", tokens=tokens) == 396  # reads from a replica are fine
            assert_exact(r, "x", "src", 396, 3)
            prefill(r, "own", prompt(200, 6), 6)
            decode(r, "own", 8, 6, bound(remote))
            r._remote.drain()
            stats = r.stats()
            assert stats["remote_refused"] >= 1 and stats["remote_published"] == 0
            later = prompt(80, 12)
            with open_store(tmp_path / "a3", config(redis_clean.url)) as a:
                prefill(a, "src", later, 12)
            until("the replica has the later pages", lambda: int(replica.cli("DBSIZE")) == 120)
            assert r.create("y", tokens=later) == 76  # fetching goes on after the refusals
            assert r.check() == []
    finally:
        replica.stop()
