"""The shared remote tier on a real redis-server: URLs, the value envelope, two hosts, a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pagedkv
from pagedkv.remote import RemoteConfig, parse_url
from pagedkv.remote import record
from tests.kits.content import kv, same_bits
from tests.kits.store import GEOM

pytest_plugins = ("kits.redisserver",)  # its redis_server, redis_clean, redis_cluster fixtures

HOST = Path(__file__).resolve().parent / "kits" / "remotehost.py"
PROMPT = 2000  # tokens: 500 pages of 4; create() reuses (2000 - 1) // 4 = 499 of them
REUSABLE = (PROMPT - 1) // GEOM.page_size * GEOM.page_size


def host(role: str, **args: object) -> dict:
    """Run one host of the test in its own process; return what it printed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOST.parent.parent.parent)]
                                                       + sys.path))
    done = subprocess.run([sys.executable, str(HOST), role, json.dumps(args)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def prompt(count: int = PROMPT, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, count, dtype=np.int64)


def prefill(store: pagedkv.KVStore, tokens: np.ndarray, seq: str = "prompt", seed: int = 7) -> None:
    store.create(seq)
    k, v = kv(seed, "prompt", 0, len(tokens))
    store.append(seq, k, v, tokens=tokens)
    store.commit()


def open_host(tmp_path: Path, name: str, url: str, model: str = "llama-3-8b@abc", **config: object):
    remote = RemoteConfig(url, close_timeout=30.0, **config)  # type: ignore[arg-type]
    return pagedkv.open(tmp_path / name, GEOM, pool_pages=64, model=model, remote=remote)


def assert_reused_exact(store: pagedkv.KVStore, seq: str, count: int, seed: int = 7) -> None:
    k, v = store.read(seq)
    want_k, want_v = kv(seed, "prompt", 0, count)
    assert len(k[0]) == count and same_bits(k, want_k) and same_bits(v, want_v)


# -- URLs and settings --------------------------------------------------------------------


@pytest.mark.parametrize("url, hosts, db, cluster, shown", [
    ("redis://127.0.0.1:6380/2", [("127.0.0.1", 6380)], 2, False, "redis://127.0.0.1:6380/2"),
    ("redis://cache", [("cache", 6379)], 0, False, "redis://cache:6379/0"),
    ("rediss://u:pw@h:1/0", [("h", 1)], 0, False, "rediss://u:***@h:1/0"),
    ("redis://:pw@h", [("h", 6379)], 0, False, "redis://:***@h:6379/0"),
    ("redis+cluster://a:7000,b:7001", [("a", 7000), ("b", 7001)], 0, True,
     "redis+cluster://a:7000,b:7001"),
    ("redis://[::1]:6379/3", [("::1", 6379)], 3, False, "redis://[::1]:6379/3"),
])
def test_url_forms(url: str, hosts: list, db: int, cluster: bool, shown: str) -> None:
    parsed = parse_url(url, password_env=None)
    assert list(parsed.hosts) == hosts and parsed.db == db and parsed.cluster is cluster
    assert parsed.redacted == shown == str(parsed) and "pw" not in repr(parsed)


def test_url_unix_and_env_password(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = parse_url("unix:///run/redis/redis.sock?db=4", password_env=None)
    assert parsed.unix_path == "/run/redis/redis.sock" and parsed.db == 4 and parsed.password is None
    monkeypatch.setenv("PAGEDKV_REMOTE_PASSWORD", "from-env-secret")
    parsed = parse_url("redis://h:1/0")
    assert parsed.password == "from-env-secret" and "from-env-secret" not in parsed.redacted
    assert parse_url("redis://:in-url@h:1/0").password == "in-url"  # the URL wins
    assert parse_url("redis://h:1/0", cluster=True).cluster


@pytest.mark.parametrize("url", ["http://h", "redis://u:hunter2@h:notaport/0", "redis://a:1,b:2/0",
                                 "unix://", "redis://h/x", "redis+cluster://u:hunter2@a:1/3",
                                 "redis://u:hunter2@h/0?nope=1", 42])
def test_url_refused_without_echoing_the_password(url: object) -> None:
    with pytest.raises(pagedkv.PagedKVError) as info:
        parse_url(url, password_env=None)  # type: ignore[arg-type]
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("field, value", [("op_timeout", 0), ("connect_timeout", -1.0), ("ttl", 0),
                                          ("queue_bytes", 0), ("namespace", "a b"), ("codec", "lz4"),
                                          ("backoff_max", 0.01), ("key_prefix", "x" * 80)])
def test_config_refuses_bad_values(field: str, value: object) -> None:
    with pytest.raises(pagedkv.PagedKVError):
        RemoteConfig("redis://h:1/0", **{field: value})  # type: ignore[arg-type]


def test_config_repr_hides_the_password() -> None:
    config = RemoteConfig("redis://user:hunter2@h:1/0")
    assert "hunter2" not in repr(config) and "user:***@" in repr(config)


def test_open_needs_a_model_and_a_writer(tmp_path: Path, redis_clean) -> None:
    with pytest.raises(pagedkv.PagedKVError, match="model fingerprint"):
        pagedkv.open(tmp_path / "none", GEOM, pool_pages=8, remote=redis_clean.url)
    pagedkv.open(tmp_path / "none", GEOM, pool_pages=8).close()  # refused whole: the lock was let go
    pagedkv.open(tmp_path / "s", GEOM, pool_pages=8, model="m").close()
    with pytest.raises(pagedkv.PagedKVError, match="writable"):
        pagedkv.open(tmp_path / "s", readonly=True, remote=redis_clean.url)
    with pytest.raises(pagedkv.PagedKVError, match="URL string"):
        pagedkv.open(tmp_path / "s", remote=5)


# -- the value envelope ----------------------------------------------------------------------

SALT = record.remote_salt("default", "m", GEOM)


def _page(seed: int = 3) -> tuple[np.ndarray, np.ndarray, bytes]:
    k, v = kv(seed, "p", 0, GEOM.page_size)
    page = np.stack([k, v], axis=1)  # (layers, 2, page_size, heads, dim)
    ids = prompt(GEOM.page_size).astype("<u4")
    return page, ids, record.chain(SALT, ids, GEOM.page_size, 1)[0]


@pytest.mark.parametrize("codec", ["raw", "zstd", "int8"])
def test_record_round_trip(codec: str) -> None:
    page, ids, digest = _page()
    value = record.encode(GEOM, SALT, digest, record.ROOT, ids, page, codec)
    back = record.decode(GEOM, value, SALT, digest, record.ROOT, ids)
    if codec == "int8":
        assert back.shape == page.shape  # lossy: within the codec's bound (tested in test_spillcodecs)
    else:
        assert same_bits(back, page)


def _mutations(value: bytes) -> dict[str, bytes]:
    flipped = bytearray(value)
    flipped[-5] ^= 0x40
    token = bytearray(value)
    token[record._FIXED.size] ^= 1
    return {"garbage": os.urandom(len(value)), "truncated": value[:len(value) // 2],
            "short": value[:10], "empty": b"", "payload bit": bytes(flipped), "token id": bytes(token),
            "version": value[:4] + b"\x09" + value[5:]}


@pytest.mark.parametrize("what", ["garbage", "truncated", "short", "empty", "payload bit", "token id",
                                  "version"])
def test_record_refuses_damage(what: str) -> None:
    page, ids, digest = _page()
    value = record.encode(GEOM, SALT, digest, record.ROOT, ids, page)
    with pytest.raises(record.Refused):
        record.decode(GEOM, _mutations(value)[what], SALT, digest, record.ROOT, ids)


def test_record_refuses_another_page_model_or_prefix() -> None:
    page, ids, digest = _page()
    value = record.encode(GEOM, SALT, digest, record.ROOT, ids, page)
    other_ids = ids.copy()
    other_ids[0] += 1
    other = record.chain(SALT, other_ids, GEOM.page_size, 1)[0]
    for salt, key_digest, parent, want_ids in [
            (record.remote_salt("default", "other-model", GEOM), digest, record.ROOT, ids),
            (SALT, other, record.ROOT, ids),  # copied under another page's key
            (SALT, digest, digest, ids),  # the same ids after another prefix
            (SALT, digest, record.ROOT, other_ids)]:  # the prompt holds other ids there
        with pytest.raises(record.Refused):
            record.decode(GEOM, value, salt, key_digest, parent, want_ids)
    big = pagedkv.Geometry(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    with pytest.raises(record.Refused):
        record.decode(big, value, record.remote_salt("default", "m", big), digest, record.ROOT, ids)


# -- two hosts ------------------------------------------------------------------------


def _two_hosts(tmp_path: Path, url: str) -> None:
    published = host("prefill", path=str(tmp_path / "a"), url=url, model="m", tokens=PROMPT, seed=11)
    assert published["remote_published"] == PROMPT // GEOM.page_size and published["remote_errors"] == 0
    got = host("reuse", path=str(tmp_path / "b"), url=url, model="m", tokens=PROMPT, seed=11)
    assert got["reused"] == REUSABLE and got["exact"] and got["problems"] == []
    assert got["fetched"] == REUSABLE // GEOM.page_size
    assert got["again"] == REUSABLE and got["fetched_after"] == got["fetched"]  # the second one is local
    assert got["stats"]["remote_rejected"] == 0 and got["stats"]["remote_errors"] == 0


@pytest.mark.slow
def test_two_hosts_share_a_prompt(tmp_path: Path, redis_clean) -> None:
    _two_hosts(tmp_path, redis_clean.url)


@pytest.mark.slow
def test_two_hosts_share_a_prompt_across_a_cluster(tmp_path: Path, redis_cluster) -> None:
    client = redis_cluster.client()
    client.flushall(target_nodes="primaries")
    _two_hosts(tmp_path, redis_cluster.url)
    keys = sum(node.client().dbsize() for node in redis_cluster.nodes)
    assert keys == PROMPT // GEOM.page_size
    assert all(node.client().dbsize() for node in redis_cluster.nodes)  # spread over every node


@pytest.mark.slow
def test_unix_socket_lookup_then_local_create(tmp_path: Path, redis_clean) -> None:
    tokens = prompt()
    with open_host(tmp_path, "a", redis_clean.unix_url) as a:
        prefill(a, tokens)
    with open_host(tmp_path, "b", redis_clean.unix_url) as b:
        assert b.lookup(tokens) == PROMPT  # lookup counts every full page, and keeps them
        fetched = b.stats()["remote_fetched"]
        assert fetched == PROMPT // GEOM.page_size
        assert b.create("x", tokens=tokens) == REUSABLE
        assert b.stats()["remote_fetched"] == fetched and b.stats()["remote_fetch_ms_p50"] > 0
        assert_reused_exact(b, "x", REUSABLE)
        assert b.check() == []
    # Fetched pages are local cache pages: committed, reused after a reopen without the tier.
    with pagedkv.open(tmp_path / "b") as b:
        assert b.create("y", tokens=tokens) == REUSABLE
        assert_reused_exact(b, "y", REUSABLE)


def test_local_prefix_then_remote_rest(tmp_path: Path, redis_clean) -> None:
    tokens = prompt()
    with open_host(tmp_path, "a", redis_clean.url) as a:
        prefill(a, tokens)
    with open_host(tmp_path, "b", redis_clean.url) as b:
        prefill(b, tokens[:400], seq="local")  # the first 100 pages are B's own
        assert b.stats()["remote_present"] >= 1 or b.stats()["remote_published"] == 0
        assert b.create("x", tokens=tokens) == REUSABLE
        assert b.stats()["remote_fetched"] == (REUSABLE - 400) // GEOM.page_size
        assert_reused_exact(b, "x", REUSABLE)


def test_a_page_the_tier_holds_is_not_sent_again(tmp_path: Path, redis_clean) -> None:
    tokens = prompt()
    with open_host(tmp_path, "a", redis_clean.url) as a:
        prefill(a, tokens)
    with open_host(tmp_path, "c", redis_clean.url) as c:  # computes the same prompt itself
        prefill(c, tokens)
        counters = c._remote.counters
    stats = counters.snapshot()
    assert stats["remote_published"] == 0 and stats["remote_present"] == PROMPT // GEOM.page_size
    assert int(redis_clean.cli("DBSIZE")) == PROMPT // GEOM.page_size


def test_pages_of_a_dropped_sequence_are_published(tmp_path: Path, redis_clean) -> None:
    tokens = prompt(400)
    with open_host(tmp_path, "a", redis_clean.url) as a:
        a.create("s")
        k, v = kv(7, "prompt", 0, 400)
        a.append("s", k, v, tokens=tokens)
        a.drop("s")  # a request that ended between two commits: its pages stay as cache
    assert int(redis_clean.cli("DBSIZE")) == 100


def test_continuing_a_sequence_after_reopen_publishes_its_new_pages(tmp_path: Path, redis_clean) -> None:
    tokens = prompt(800)
    with pagedkv.open(tmp_path / "a", GEOM, pool_pages=64, model="llama-3-8b@abc") as a:
        prefill(a, tokens[:400])  # before the tier: the first 100 pages stay local
    with open_host(tmp_path, "a", redis_clean.url) as a:
        k, v = kv(7, "prompt", 400, 400)
        a.append("prompt", k, v, tokens=tokens[400:])
    assert int(redis_clean.cli("DBSIZE")) == 100
    with open_host(tmp_path, "b", redis_clean.url) as b:
        prefill(b, tokens[:400], seq="head")  # B holds the head; the tail comes from A's pages
        assert b.create("x", tokens=tokens) == 796 and b.stats()["remote_fetched"] == 99
        assert_reused_exact(b, "x", 796)


@pytest.mark.parametrize("codec", ["zstd", "int8"])
def test_codecs_travel_smaller(tmp_path: Path, redis_clean, codec: str) -> None:
    tokens = prompt(400)
    zeros = np.zeros((GEOM.layers, 400, GEOM.kv_heads, GEOM.head_dim), np.float32)
    with open_host(tmp_path, "a", redis_clean.url, codec=codec) as a:
        a.create("s")
        a.append("s", zeros, zeros, tokens=tokens)
        a.commit()
        counters = a._remote.counters
    sent = counters.snapshot()["remote_bytes_sent"]
    assert 0 < sent < 100 * GEOM.page_nbytes
    with open_host(tmp_path, "b", redis_clean.url) as b:
        assert b.create("x", tokens=tokens) == 396
        k, _ = b.read("x")
        assert not k.any()


def test_ttl_namespace_and_key_prefix(tmp_path: Path, redis_clean) -> None:
    tokens = prompt(40)
    with open_host(tmp_path, "a", redis_clean.url, ttl=600, namespace="fleet-1", key_prefix="kv:") as a:
        prefill(a, tokens)
    client = redis_clean.client()
    keys = client.keys("*")
    assert len(keys) == 10 and all(key.startswith(b"kv:fleet-1:") for key in keys)
    assert all(0 < client.pttl(key) <= 600_000 for key in keys)
    with open_host(tmp_path, "b", redis_clean.url, namespace="fleet-2") as b:
        assert b.create("x", tokens=tokens) == 0 and b.stats()["remote_fetch_misses"] == 1
    with open_host(tmp_path, "c", redis_clean.url, namespace="fleet-1", key_prefix="kv:") as c:
        assert c.create("x", tokens=tokens) == 36


def test_a_full_queue_skips_pages_and_never_blocks(tmp_path: Path, redis_clean) -> None:
    tokens = prompt()
    with open_host(tmp_path, "a", redis_clean.url, queue_bytes=GEOM.page_nbytes * 3) as a:
        prefill(a, tokens)
        assert a.stats()["remote_skipped"] >= 1  # at once, in the commit: it never waited for room
        counters = a._remote.counters
    stats = counters.snapshot()
    assert stats["remote_skipped"] + stats["remote_published"] == PROMPT // GEOM.page_size


def test_inspect_shows_the_tier_as_of_the_last_commit(tmp_path: Path, redis_clean) -> None:
    from pagedkv.cli.commands import cli

    url = redis_clean.url.replace("redis://", "redis://pagedkv-user:sekrit-pw@")
    redis_clean.cli("ACL", "SETUSER", "pagedkv-user", "on", ">sekrit-pw", "~*", "+@all")
    with open_host(tmp_path, "a", url) as a:
        prefill(a, prompt(40))
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "a"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0 and "sekrit-pw" not in result.output
    section = json.loads(result.output)["remote"]
    assert section["url"] == f"redis://pagedkv-user:***@127.0.0.1:{redis_clean.port}/0"
    assert section["counters"]["remote_published"] == 10
    text = CliRunner().invoke(cli, ["inspect", str(tmp_path / "a")], catch_exceptions=False).output
    assert "remote tier" in text and "10 published" in text and "sekrit-pw" not in text
    redis_clean.cli("ACL", "DELUSER", "pagedkv-user")


def test_inspect_of_a_store_without_a_tier(store: pagedkv.KVStore) -> None:
    from pagedkv.inspection.report import summary
    from pagedkv.snapshot import open_snapshot

    store.commit()
    assert store.stats()["remote_fetched"] == 0 and store.stats()["remote_fetch_ms_p99"] == 0.0
    path = store.path
    store.close()
    with open_snapshot(path) as snap:
        assert summary(snap)["remote"] is None


def test_vllm_config_takes_remote() -> None:
    from pagedkv.integrations.vllm.config import ConnectorConfig

    config = ConnectorConfig.from_extra({"path": "/tmp/x", "remote": "redis://h:1/0"})
    assert dict(config.open_options)["remote"] == "redis://h:1/0"
    with pytest.raises(pagedkv.PagedKVError):
        ConnectorConfig.from_extra({"path": "/tmp/x", "remote": 5})
