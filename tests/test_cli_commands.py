"""The command line: every command and option through CliRunner, with exit codes and JSON checked.

JSON output is compared with the library's own view of the same store; the
read-only promises of ``inspect``/``verify`` are checked byte for byte (T13),
hostile paths and names are checked against one-line errors and escaped output
(T14), and a live writer in another process is inspected (T11).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

import pagedkv
from pagedkv.cli.commands import cli
from pagedkv.demo.kvgen import check_read, token_kv
from pagedkv.storage.spill import uid_key
from tools import make_sample

from tests.kits.cli import assert_one_line_error, run, run_json
from tests.kits.store import ROOT, tree_state



SAMPLE = ROOT / "data" / "sample.kv"
TINY = pagedkv.PRESETS["tiny"]
HOSTILE = ["esc\x1b[31mred", "cr\rreturn", "nul\x00byte", "rtl\u202eevil", "tab\there",
           "nl\nline", "emoji\U0001f600", "back\\slash"]


def kv(origin: int, start: int, stop: int, geom: pagedkv.Geometry = TINY) -> tuple[np.ndarray, np.ndarray]:
    return token_kv(geom, 7, origin, np.arange(start, stop))


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    """A private copy of the golden store."""
    target = tmp_path / "sample.kv"
    shutil.copytree(SAMPLE, target)
    return target


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """A closed store: shared and spilled pages, int and str ids, hostile names."""
    path = tmp_path / "store.kv"
    with pagedkv.open(path, TINY, pool_pages=6) as store:
        store.create("a")
        store.append("a", *kv(1, 0, 40))
        store.fork("a", "b")
        store.append("b", *kv(2, 40, 50))
        store.create(5)
        store.append(5, *kv(3, 0, 64))
        store.create("12")
        store.append("12", *kv(4, 0, 3))
        store.create(12)
        for name in HOSTILE:
            store.create(name)
            store.append(name, *kv(5, 0, 2))
        assert store.check() == []
    return path


# -- help, version, entry points ------------------------------------------------------


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_every_command_has_example(command: str) -> None:
    result = run(command, "--help")
    assert "Example" in result.stdout
    assert f"pagedkv {command}" in result.stdout


def test_help_group_has_example() -> None:
    assert "Example" in run("--help").stdout


def test_version_prints_package_version() -> None:
    assert pagedkv.__version__ in run("--version").stdout


def test_python_m_pagedkv_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "inspect" in proc.stdout


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--bogus", "x"], ["bogus"], ["verify"],
                                  ["inspect", "-x"], ["demo", "--preset", "huge"],
                                  ["demo", "--seed-workload", "--preset", "tiny"]])
def test_usage_errors_are_one_line(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(*args, code=2))
    assert not (tmp_path / "demo.kv").exists()


# -- demo -----------------------------------------------------------------------------

DEMO_KEYS = {
    "workload", "path", "store", "geometry", "pool_pages", "pool_bytes", "sequences", "max_new_tokens",
    "seed", "durability", "tokens", "prompt_tokens", "reused_tokens", "prefix_hit_rate", "prefill_tokens",
    "decode_tokens", "follow_ups", "forks", "steps", "commits", "pages", "pages_live", "cached_pages",
    "cow_copies", "evictions", "restores", "resident_hits", "spill_hits", "misses", "resident_hit_rate",
    "spill_hit_rate", "restore_ms_p50", "restore_ms_p99", "bytes_spilled", "bytes_restored", "seconds",
    "tokens_per_s", "spot_checks", "verified_tokens", "reopen_prefix", "verified", "preset", "schema",
}
SMALL_DEMO = ["--preset", "tiny", "--pool-pages", "24", "--sequences", "24", "--tokens", "24"]


def test_demo_json_spills_restores_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "demo.kv"
    out = run_json("demo", path, *SMALL_DEMO)
    assert set(out) == DEMO_KEYS
    assert out["verified"] is True and out["store"] == "new" and out["preset"] == "tiny"
    assert out["tokens"] == out["prefill_tokens"] + out["decode_tokens"] > 0
    assert out["prompt_tokens"] == out["prefill_tokens"] + out["reused_tokens"]
    assert out["reused_tokens"] > 0 and out["follow_ups"] > 0 and out["forks"] > 0
    assert out["evictions"] > 0 and out["restores"] > 0 and out["misses"] == 0
    assert out["resident_hit_rate"] + out["spill_hit_rate"] == pytest.approx(1.0)
    assert out["verified_tokens"] >= out["tokens"]
    probe = out["reopen_prefix"]
    assert probe["cached"] >= probe["tokens"] // 16 * 16 > 0
    with pagedkv.open(path, readonly=True) as store:
        assert store.check() == []
        assert len(store.sequences()) == 4  # the newest finished requests stay
        stats = store.stats()
    summary = run_json("inspect", path)
    assert summary["sequences"] == 4 and summary["tokens"] == stats["tokens"]
    assert summary["pages"]["cached"] == stats["cached_pages"] > 0
    assert summary["last_commit"]["commits"] == out["commits"] + 1  # close() commits once more


def test_demo_text_table_and_next_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = run("demo", *SMALL_DEMO).stdout
    for label in ("tokens", "pages", "evictions", "restores", "resident hit rate", "spill hit rate",
                  "restore latency", "bytes spilled", "bytes restored", "throughput", "bit-exact",
                  "prefix cache", "after reopen"):
        assert label in text
    assert "next: pagedkv inspect demo.kv" in text
    assert (tmp_path / "demo.kv" / "pool.bin").exists()


def test_demo_seed_workload_hits(tmp_path: Path) -> None:
    out = run_json("demo", tmp_path / "seed.kv", "--seed-workload", "--durability", "nosync")
    assert out["workload"] == "seed" and out["tokens"] == 20_000 and out["token_bytes"] == 60
    assert out["pool_pages"] == 500_000 // 60 and out["spilled_pages"] >= 20_000 - out["pool_pages"]
    assert out["read"] == {**out["read"], "memory_hits": 0, "disk_hits": 20, "misses": 0, "verified": True}
    assert out["read"]["restore_ms_mean"] > 0
    assert out["reread"]["memory_hits"] == 20 and out["reread"]["disk_hits"] == 0


@pytest.mark.slow
def test_demo_replaces_an_earlier_store(tmp_path: Path) -> None:
    path = tmp_path / "demo.kv"
    first = run_json("inspect", _demo(path))
    out = run_json("demo", path, *SMALL_DEMO, "--seed", "3")
    assert out["store"] == "replaced"
    assert run_json("inspect", path)["uuid"] != first["uuid"]


def _demo(path: Path) -> Path:
    run("demo", path, *SMALL_DEMO, "--json")
    return path


def test_demo_refuses_a_pool_too_small_before_touching_path(store_path: Path) -> None:
    before = tree_state(store_path)
    assert_one_line_error(run("demo", store_path, "--pool-pages", "4", code=2))
    assert tree_state(store_path) == before


def test_demo_refuses_other_directories_and_files(tmp_path: Path) -> None:
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    assert_one_line_error(run("demo", other, *SMALL_DEMO, code=2))
    assert (other / "keep.txt").read_text() == "precious"
    plain = tmp_path / "file"
    plain.write_text("x")
    assert_one_line_error(run("demo", plain, *SMALL_DEMO, code=2))
    assert plain.read_text() == "x"


def test_demo_refuses_a_store_in_use(store_path: Path) -> None:
    with pagedkv.open(store_path):
        result = run("demo", store_path, *SMALL_DEMO, code=3)
    assert_one_line_error(result)
    with pagedkv.open(store_path, readonly=True) as store:
        assert store.length("a") == 40


# -- inspect --------------------------------------------------------------------------

SUMMARY_KEYS = {"path", "format_version", "metadata_checked", "uuid", "created", "geometry", "model", "page_bytes", "token_bytes",
                "pool", "pages", "prefix_cache", "lifetime", "spill_codecs", "lmdb", "sequences", "tokens",
                "last_commit", "remote", "writer", "snapshot", "notes", "schema", "disk", "warnings"}
PREFIX_KEYS = {"shared_pages", "cached_pages", "queries", "query_tokens", "hit_tokens", "hit_pages", "hit_rate"}


def test_inspect_summary_json_matches_library(store_path: Path) -> None:
    out = run_json("inspect", store_path)
    assert set(out) == SUMMARY_KEYS
    assert set(out["pool"]) == {"slots", "free", "resident", "pinned", "shared", "file_bytes"}
    assert set(out["pages"]) == {"total", "resident", "spilled", "shared", "hashed", "cached", "orphan", "spill_records",
                                 "spilled_bytes"}
    assert set(out["lmdb"]) == {"map_size", "map_used", "file_bytes", "last_txnid", "readers",
                                "stale_readers", "entries"}
    with pagedkv.open(store_path, readonly=True) as store:
        stats = store.stats()
        assert out["uuid"] == store.uuid
        assert out["geometry"] == store.geometry.to_dict()
        assert out["page_bytes"] == store.geometry.page_nbytes
        assert out["format_version"] == store.superblock["format"] == pagedkv.storage.codec.FORMAT_VERSION
        commits = store._state["commits"]
        state = dict(store._state)
    assert set(out["prefix_cache"]) == PREFIX_KEYS
    assert out["lifetime"] == {key: state[key] for key in ("evictions", "restores", "cache_drops")}
    assert out["lifetime"]["evictions"] > 0  # a 6-slot pool under 12+ pages of sequences
    assert set(out["spill_codecs"]) == {"raw", "int8", "zstd"}
    assert out["spill_codecs"]["raw"]["pages"] == stats["codec_raw_pages"] == stats["spilled_pages"]
    assert out["spill_codecs"]["raw"]["bytes"] == stats["codec_raw_bytes"] == out["pages"]["spilled_bytes"]
    assert out["spill_codecs"]["int8"] == out["spill_codecs"]["zstd"] == {"pages": 0, "bytes": 0, "ratio": 0.0}
    assert out["sequences"] == stats["sequences"] and out["tokens"] == stats["tokens"]
    assert out["pool"]["slots"] == stats["pool_pages"] == 6
    assert out["pool"]["resident"] == stats["pool_used"] and out["pool"]["free"] == stats["pool_free"]
    assert out["pages"]["total"] == stats["pages"]
    assert out["pages"]["spilled"] == stats["spilled_pages"] > 0
    assert out["pages"]["spilled_bytes"] > out["pages"]["spilled"] * TINY.page_nbytes
    assert out["last_commit"] == {**out["last_commit"], "commits": commits, "durability": "durable"}
    assert out["writer"] == {"locked": False, "pid": None} and out["snapshot"] is False
    assert out["lmdb"]["readers"] == 0 and out["lmdb"]["map_size"] >= out["lmdb"]["map_used"]


def test_inspect_summary_text(store_path: Path) -> None:
    text = run("inspect", store_path).stdout
    for label in ("format version", "uuid", "geometry", "page bytes", "pool slots", "spilled on disk",
                  "spill codecs", "prefix cache", "prefix hits", "lifetime", "lmdb", "sequences", "last commit",
                  "durable mode", "writer"):
        assert label in text


def test_inspect_sequences_match_library(store_path: Path) -> None:
    rows = run_json("inspect", store_path, "--sequences")["sequences"]
    with pagedkv.open(store_path, readonly=True) as store:
        expected = {json.dumps(s): store.length(s) for s in store.sequences()}
    assert {json.dumps(r["id"]): r["length"] for r in rows} == expected
    assert all(r["resident"] + r["spilled"] == r["pages"] == -(-r["length"] // 16) for r in rows)
    assert "tokens" in run("inspect", store_path, "--sequences").stdout


def test_inspect_seq_block_table(store_path: Path) -> None:
    out = run_json("inspect", store_path, "--seq", "b")["seq"]
    assert out["id"] == "b" and out["length"] == 50 and len(out["pages"]) == 4
    assert [p["index"] for p in out["pages"]] == [0, 1, 2, 3]
    assert {p["state"] for p in out["pages"]} == {"verified"}
    a_uids = [p["uid"] for p in run_json("inspect", store_path, "--seq", "a")["seq"]["pages"]]
    assert [p["uid"] for p in out["pages"][:2]] == a_uids[:2]  # shared with "a"...
    assert out["pages"][0]["refcount"] == 2 and out["pages"][2]["uid"] != a_uids[2]  # ...but copied on write
    for page in out["pages"]:
        assert (page["slot"] is None) == (page["where"] == "spilled")
    assert "refcount" in run("inspect", store_path, "--seq", "b").stdout


def test_inspect_seq_int_and_str_ids(store_path: Path) -> None:
    assert run_json("inspect", store_path, "--seq", "5")["seq"]["id"] == 5
    assert run_json("inspect", store_path, "--seq", "12")["seq"]["id"] == 12  # as --sequences shows the int
    assert run_json("inspect", store_path, "--seq", "'12'")["seq"]["id"] == "12"  # and the str, quoted
    assert_one_line_error(run("inspect", store_path, "--seq", "missing", code=2))
    assert_one_line_error(run("inspect", store_path, "--seq", "6", code=2))


def test_inspect_page_matches_library_read(store_path: Path) -> None:
    seen = set()
    # LMDB allows one handle per process: every inspect runs before the library opens the store.
    shown = {}
    for seq_id in (5, "b", HOSTILE[-1]):
        table = run_json("inspect", store_path, "--seq", seq_id)["seq"]["pages"]
        shown[seq_id] = [(entry, run_json("inspect", store_path, "--page", entry["uid"])["page"])
                         for entry in table]
    with pagedkv.open(store_path, readonly=True) as store:
        for seq_id, pages in shown.items():
            for entry, page in pages:
                seen.add(entry["where"])
                assert {k: page[k] for k in entry if k != "index"} == {k: v for k, v in entry.items() if k != "index"}
                assert seq_id in page["sequences"]
                assert (page["record"] is None) == (entry["where"] == "resident")
                if page["record"] is not None:
                    assert page["record"]["uid"] == entry["uid"] and page["record"]["fill"] == entry["fill"]
                    assert page["record_bytes"] > TINY.page_nbytes
                start = entry["index"] * 16
                k, v = store.read(seq_id, start, start + entry["fill"])
                assert len(page["layers"]) == TINY.layers
                for layer in page["layers"]:
                    for part, data in (("k", k), ("v", v)):
                        values = data[layer["layer"]].astype(np.float64)
                        assert layer[part] == {"min": values.min(), "max": values.max(),
                                               "mean": pytest.approx(values.mean()), "nan": 0, "inf": 0}
    assert seen == {"resident", "spilled"}
    text = run("inspect", store_path, "--page", table[0]["uid"]).stdout
    assert "mean" in text and "refcount" in text


@pytest.mark.parametrize("uid", ["999999", "abc", "-1", str(1 << 64)])
def test_inspect_page_bad_uid(store_path: Path, uid: str) -> None:
    assert_one_line_error(run("inspect", store_path, "--page", uid, code=2))


def test_inspect_map_matches_summary(store_path: Path) -> None:
    out = run_json("inspect", store_path, "--map")["map"]
    summary = run_json("inspect", store_path)
    assert set(out) == {"slots", "slots_per_cell", "width", "rows", "legend", "counts"}
    grid = "".join(out["rows"])
    assert len(grid) == out["slots"] == 6 and set(grid) <= set(out["legend"])
    assert out["counts"]["free"] == grid.count(".") == summary["pool"]["free"]
    assert out["counts"]["shared"] == grid.count("S") == summary["pool"]["shared"]
    assert sum(out["counts"].values()) == out["slots"]
    text = run("inspect", store_path, "--map").stdout
    assert "free" in text and "resident" in text and "pinned" in text


def test_inspect_forms_combine(store_path: Path) -> None:
    out = run_json("inspect", store_path, "--sequences", "--map", "--seq", "a")
    assert set(out) == {"schema", "sequences", "map", "seq"}


def _prefix_store(path: Path) -> list[int]:
    """Two sessions of prefix reuse (3 queries, 2 hits), one dropped prompt left cached; the prompt."""
    prompt = list(range(100, 140))  # 40 tokens: two full pages and a half
    other = list(range(500, 532))  # 32 tokens: two full pages
    with pagedkv.open(path, TINY, pool_pages=32, model="test-model") as store:
        assert store.create("p", tokens=prompt) == 0  # nothing cached yet: 40 tokens asked, 0 hit
        store.append("p", *kv(1, 0, 40), tokens=prompt)
        assert store.create("q", tokens=prompt + [7, 8]) == 32  # 42 asked, 2 pages hit
        store.create("gone")
        store.append("gone", *kv(2, 0, 32), tokens=other)
        store.drop("gone")  # its two full pages stay in the prefix index, refcount 0
    with pagedkv.open(path) as store:  # a second session adds to the persisted counters
        assert store.create("r", tokens=prompt[:33]) == 32  # 33 asked, 2 pages hit
        store.drop("p")  # the half page goes; the full ones stay shared by q and r
    return prompt


def test_inspect_prefix_cache_counts_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "prefix.kv"
    _prefix_store(path)
    out = run_json("inspect", path)
    assert out["prefix_cache"] == {"shared_pages": 2, "cached_pages": 2, "queries": 3,
                                   "query_tokens": 40 + 42 + 33, "hit_tokens": 64, "hit_pages": 4,
                                   "hit_rate": 64 / 115}
    assert out["pages"]["shared"] == 2 and out["pages"]["cached"] == 2
    assert out["lifetime"] == {"evictions": 0, "restores": 0, "cache_drops": 0}
    assert out["model"] == "test-model"
    with pagedkv.open(path, readonly=True) as store:
        assert {key: store._state[f"prefix_{key}"] for key in ("queries", "query_tokens", "hit_tokens",
                                                               "hit_pages")} == \
            {key: out["prefix_cache"][key] for key in ("queries", "query_tokens", "hit_tokens", "hit_pages")}
    text = run("inspect", path).stdout
    assert "2 pages shared (refcount > 1), 2 cached only" in text
    assert "55.7%: 64 of 115 prompt tokens reused (4 pages) in 3 create(tokens=...)" in text
    assert "0 evictions, 0 restores, 0 cached pages dropped" in text
    assert re.search(r"^model +test-model$", text, re.M)


def test_inspect_prefix_cache_without_queries_is_zero(store_path: Path) -> None:
    cache = run_json("inspect", store_path)["prefix_cache"]
    assert cache["queries"] == cache["hit_tokens"] == 0 and cache["hit_rate"] == 0.0
    assert cache["shared_pages"] == 2  # "a" and its fork "b" share two full pages
    assert "no create(tokens=...) so far" in run("inspect", store_path).stdout


def test_inspect_spill_codecs(tmp_path: Path) -> None:
    path = tmp_path / "codecs.kv"
    for session, codec in enumerate(("int8", "zstd")):
        with pagedkv.open(path, TINY, pool_pages=4, spill_codec=codec) as store:
            store.create(codec)
            store.append(codec, *kv(session + 1, 0, 96))  # six pages through a 4-slot pool
            store.create(f"{codec}-pusher")  # pushes the rest of the sequence out
            store.append(f"{codec}-pusher", *kv(session + 9, 0, 64))
    out = run_json("inspect", path)
    with pagedkv.open(path, readonly=True) as store:
        stats = store.stats()
    codecs = out["spill_codecs"]
    for name in ("raw", "int8", "zstd"):
        figures = codecs[name]
        assert figures["pages"] == stats[f"codec_{name}_pages"]
        assert figures["bytes"] == stats[f"codec_{name}_bytes"]
        assert figures["ratio"] == pytest.approx(stats[f"codec_{name}_ratio"])
        if figures["bytes"]:
            assert figures["ratio"] == pytest.approx(figures["pages"] * TINY.page_nbytes / figures["bytes"])
    assert codecs["int8"]["pages"] > 0 and codecs["zstd"]["pages"] > 0 and codecs["raw"]["pages"] == 0
    assert 1.8 < codecs["int8"]["ratio"] < 2.0  # one byte per fp16 element, plus scales and a header
    assert codecs["zstd"]["ratio"] > 1.0  # kvgen's values are multiples of 1/512: compressible
    assert sum(c["pages"] for c in codecs.values()) == out["pages"]["spill_records"]
    text = run("inspect", path).stdout
    assert f"int8: {codecs['int8']['pages']} pages in " in text and "zstd: " in text and "raw: " not in text


# -- bench ----------------------------------------------------------------------------

ROW_KEYS = ["scenario", "name", "pagedkv", "reference", "unit", "ratio", "target", "meets", "params", "notes",
            "metrics"]


def test_bench_json_rows(tmp_path: Path) -> None:
    out = run_json("bench", "--quick", "--scenario", "b1", "--scenario", "B1", "--seed", 3,
                   "--workdir", tmp_path)
    assert set(out) == {"schema", "rows"} and out["schema"] == 1
    rows = out["rows"]
    assert len(rows) == 1 and list(rows[0]) == ROW_KEYS
    assert rows[0]["scenario"] == "B1" and rows[0]["unit"] == "GiB/s" and rows[0]["params"]["pairs"] == 5
    assert list(tmp_path.iterdir()) == []  # the temporary stores are gone


def test_bench_text_table(tmp_path: Path) -> None:
    text = run("bench", "--quick", "--scenario", "B1", "--workdir", tmp_path).stdout
    assert re.search(r"^B1  prefill append ", text, re.M)
    assert "1 rows;" in text and "target" in text


@pytest.mark.parametrize("args", [["--scenario", "B99"], ["--scenario", "b1", "--scenario", "x"],
                                  ["--seed", "nope"], ["--workdir", "/no/such/dir"]])
def test_bench_bad_input_is_one_line_exit_2(args: list[str]) -> None:
    result = run("bench", "--quick", *args, code=2)
    assert_one_line_error(result)
    if args[0] == "--scenario":
        assert "choose from B1, B2" in result.stderr


# -- verify ---------------------------------------------------------------------------

VERIFY_KEYS = {"path", "ok", "damage", "garbage", "unverified", "pages_checked", "resident_pages",
               "spilled_pages", "sequences", "live", "writer_pid", "notes", "schema"}


def test_verify_clean_store(store_path: Path) -> None:
    out = run_json("verify", store_path)
    assert set(out) == VERIFY_KEYS
    assert out["ok"] is True and out["damage"] == [] and out["live"] is False
    with pagedkv.open(store_path, readonly=True) as store:
        assert out["pages_checked"] == store.stats()["pages"]
    assert run("verify", store_path).stdout.startswith("ok: ")


def test_verify_orphan_record_is_a_note_not_damage(store_path: Path) -> None:
    env = lmdb.open(str(store_path / "spill"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(uid_key(999_999), b"left by an interrupted writer", db=env.open_db(b"pages", txn=txn))
    env.close()
    out = run_json("verify", store_path)
    assert out["ok"] is True and len(out["garbage"]) == 1
    assert out["garbage"] == [{"kind": "stray_record", "page": 999_999, "sequence": None,
                               "message": "spill record 999999 belongs to no page"}]
    assert "note: 1 spill record belongs to no page" in run("verify", store_path).stdout


# -- the golden sample store ------------------------------------------------------------


def test_sample_store_inspects_and_verifies_in_place() -> None:
    before = tree_state(SAMPLE)
    assert run_json("verify", SAMPLE)["ok"] is True
    summary = run_json("inspect", SAMPLE)
    assert summary["format_version"] == 1 and summary["pages"]["spilled"] > 0
    assert summary["metadata_checked"] is False and "without checksums" in run("inspect", SAMPLE).stdout
    assert summary["sequences"] == len(make_sample.SEQUENCES)
    assert summary["pages"]["shared"] > 0 and summary["pages"]["cached"] == 3
    assert summary["model"] == make_sample.MODEL
    # Committed before writers kept prefix counters: unknown, not zero.
    prefix = summary["prefix_cache"]
    assert prefix["cached_pages"] == 3 and prefix["query_tokens"] > prefix["hit_tokens"] > 0
    assert prefix["hit_rate"] == prefix["hit_tokens"] / prefix["query_tokens"]
    assert summary["lifetime"]["evictions"] > 0 and summary["lifetime"]["cache_drops"] == 0
    assert "not recorded" not in run("inspect", SAMPLE).stdout
    assert tree_state(SAMPLE) == before


def test_sample_store_content_is_bit_exact(sample: Path) -> None:
    with pagedkv.open(sample, readonly=True) as store:
        assert sorted(map(repr, store.sequences())) == sorted(map(repr, make_sample.SEQUENCES))
        for req in make_sample.requests():
            assert store.length(req.seq_id) == req.length
            if req.length:
                check_read(store, make_sample.GEOMETRY, make_sample.SEED, req)
        gone = make_sample.DROPPED
        assert store.lookup(gone.token_ids(make_sample.SEED, 0, gone.length)) == gone.length


@pytest.mark.slow
def test_sample_cached_pages_have_no_sequence() -> None:
    pages = []
    for uid in range(1, 40):
        result = run("inspect", SAMPLE, "--json", "--page", uid, code=None)
        if result.exit_code == 0:
            pages.append(json.loads(result.stdout)["page"])
    cached = [p for p in pages if p["refcount"] == 0]
    assert len(pages) == 17 and len(cached) == 3
    assert all(p["sequences"] == [] and p["prefix_hash"] and p["state"] == "verified" for p in cached)


def _resident_page(path: Path) -> dict[str, Any]:
    for seq in run_json("inspect", path, "--sequences")["sequences"]:
        for page in run_json("inspect", path, "--seq", str(seq["id"]))["seq"]["pages"]:
            if page["where"] == "resident":
                return page
    raise AssertionError("no resident page")


def test_damaged_pool_slot_verifies_with_exit_1(sample: Path) -> None:
    page = _resident_page(sample)
    offset = 4096 + page["slot"] * make_sample.GEOMETRY.page_nbytes + 3
    with open(sample / "pool.bin", "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    out = run_json("verify", sample, code=1)
    assert out["ok"] is False and any(f"page {page['uid']}" in p["message"] for p in out["damage"])
    assert {"kind": "pool_checksum", "page": page["uid"], "sequence": None} in [
        {k: p[k] for k in ("kind", "page", "sequence")} for p in out["damage"]]
    assert "DAMAGED" in run("verify", sample, code=1).stdout
    shown = run_json("inspect", sample, "--page", page["uid"])
    assert set(shown) == {"schema", "page"} and shown["page"]["uid"] == page["uid"]
    assert shown["page"]["state"] == "corrupt"


def test_damaged_spill_record_verifies_with_exit_1(sample: Path) -> None:
    env = lmdb.open(str(sample / "spill"), max_dbs=4)
    with env.begin(write=True) as txn:
        pages = env.open_db(b"pages", txn=txn)
        key, value = next(iter(txn.cursor(db=pages)))
        damaged = bytearray(value)
        damaged[-5] ^= 0x01
        txn.put(key, bytes(damaged), db=pages)
    env.close()
    uid = int.from_bytes(key, "big")
    out = run_json("verify", sample, code=1)
    assert any(f"page {uid}" in p["message"] and p["page"] == uid and p["kind"] == "record" for p in out["damage"])
    assert run_json("inspect", sample, "--page", uid)["page"]["state"] == "corrupt"


# -- read-only guarantees (T13) -----------------------------------------------------------

INSPECT_FORMS = [[], ["--sequences"], ["--seq", "chat-1"], ["--seq", "7"], ["--map"], ["--page", "1"],
                 ["--json"], ["--sequences", "--map", "--json"]]


def test_inspect_and_verify_write_nothing(sample: Path) -> None:
    before = tree_state(sample)
    for form in INSPECT_FORMS:
        run("inspect", sample, *form)
    run("verify", sample)
    run("verify", sample, "--json")
    assert tree_state(sample) == before


def test_inspect_works_on_a_read_only_copy(sample: Path) -> None:
    paths = [sample, *sample.rglob("*")]
    for path in paths:  # tests run as root, so modes prove nothing alone; the states must not change
        path.chmod(0o500 if path.is_dir() else 0o400)
    try:
        before = tree_state(sample)
        for form in INSPECT_FORMS:
            run("inspect", sample, *form)
        assert run_json("verify", sample)["ok"] is True
        assert tree_state(sample) == before
    finally:
        for path in paths:
            path.chmod(stat.S_IRWXU if path.is_dir() else stat.S_IRUSR | stat.S_IWUSR)


# -- hostile paths and names (T14) --------------------------------------------------------


def _other_lmdb(tmp: Path) -> Path:
    env = lmdb.open(str(tmp / "other"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"key", b"value")
    env.close()
    return tmp / "other"


def _truncated_pool(sample: Path) -> Path:
    os.truncate(sample / "pool.bin", (sample / "pool.bin").stat().st_size // 2)
    return sample


def _bad_header(sample: Path) -> Path:
    with open(sample / "pool.bin", "r+b") as fh:
        fh.seek(40)
        fh.write(b"\xff")
    return sample


def _bad_superblock(sample: Path) -> Path:
    env = lmdb.open(str(sample / "spill"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"superblock", b"\xc1 not msgpack", db=env.open_db(b"meta", txn=txn))
    env.close()
    return sample


def _zeroed_lmdb(sample: Path) -> Path:
    data = sample / "spill" / "data.mdb"
    data.write_bytes(b"\0" * data.stat().st_size)
    return sample


def _no_spill(sample: Path) -> Path:
    shutil.rmtree(sample / "spill")
    return sample


def _foreign_pool(sample: Path) -> Path:
    other = sample.parent / "other.kv"
    pagedkv.open(other, TINY, pool_pages=8).close()
    shutil.copyfile(other / "pool.bin", sample / "pool.bin")
    return sample


BAD_INPUTS = {
    "missing": lambda tmp, sample: tmp / "nope",
    "plain file": lambda tmp, sample: (tmp / "f").write_text("x") and tmp / "f",
    "empty dir": lambda tmp, sample: (tmp / "empty").mkdir() or tmp / "empty",
    "other lmdb": lambda tmp, sample: _other_lmdb(tmp),
    "spill dir itself": lambda tmp, sample: sample / "spill",
    "truncated pool.bin": lambda tmp, sample: _truncated_pool(sample),
    "bad pool header": lambda tmp, sample: _bad_header(sample),
    "bad superblock": lambda tmp, sample: _bad_superblock(sample),
    "zeroed data.mdb": lambda tmp, sample: _zeroed_lmdb(sample),
    "no spill dir": lambda tmp, sample: _no_spill(sample),
    "pool.bin of another store": lambda tmp, sample: _foreign_pool(sample),
    "spaces and unicode": lambda tmp, sample: tmp / "no such st\u00f8re \u2713",
    "control characters": lambda tmp, sample: tmp / "bad\x1b[2J\rname\x07",
    "symlink": lambda tmp, sample: (tmp / "link").symlink_to(sample) or tmp / "link",
    "symlinked pool.bin": lambda tmp, sample: _replace(sample, "pool.bin", "link"),
    "symlinked LOCK": lambda tmp, sample: _replace(sample, "LOCK", "link"),
    "fifo pool.bin": lambda tmp, sample: _replace(sample, "pool.bin", "fifo"),
    "fifo LOCK": lambda tmp, sample: _replace(sample, "LOCK", "fifo"),
    "directory as data.mdb": lambda tmp, sample: _replace(sample, "spill/data.mdb", "dir"),
}


def _replace(sample: Path, name: str, kind: str) -> Path:
    """Swap a store file for a symlink to a copy of it, a FIFO, or a directory."""
    target = sample / name
    if kind == "link":
        shutil.copyfile(target, sample.parent / "elsewhere")
        target.unlink()
        target.symlink_to(sample.parent / "elsewhere")
    else:
        target.unlink()
        if kind == "fifo":
            os.mkfifo(target)
        else:
            target.mkdir()
    return sample


# A store too damaged to open: verify found damage (exit 1); inspect cannot open it (exit 4).
DAMAGED_INPUTS = {"bad pool header", "bad superblock", "directory as data.mdb", "fifo LOCK", "fifo pool.bin",
                  "no spill dir", "pool.bin of another store", "truncated pool.bin", "zeroed data.mdb"}


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_4_or_damage_1(command: str, case: str, tmp_path: Path, sample: Path) -> None:
    path = BAD_INPUTS[case](tmp_path, sample)
    code = 1 if command == "verify" and case in DAMAGED_INPUTS else 4
    result = run(command, "--", path, code=code)
    assert_one_line_error(result)
    error = run_json(command, "--", path, code=code)["error"]
    assert error["exit_code"] == code
    assert error["kind"] == ("StoreCorrupt" if case in DAMAGED_INPUTS else "NotAStore")


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_missing_path_with_leading_dash(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(command, "--", "-nope", code=4))
    assert_one_line_error(run(command, "-nope", code=2))  # parsed as an option: still one line


@pytest.mark.parametrize("name", ["my store", "st\u00f8re \u2713", "-dash"])
def test_awkward_store_paths_work(name: str, sample: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / name
    sample.rename(target)
    monkeypatch.chdir(tmp_path)
    assert run_json("inspect", "--", name)["sequences"] == len(make_sample.SEQUENCES)
    assert run_json("verify", "--", name)["ok"] is True
    assert "store" in run("inspect", "--", name).stdout


def test_hostile_sequence_names_are_escaped(store_path: Path) -> None:
    text = run("inspect", store_path, "--sequences").stdout
    assert "\\x1b" in text and "\\r" in text and "\\x00" in text and "\\u202e" in text
    assert "'emoji\U0001f600'" in text  # printable: shown as it is
    rows = run_json("inspect", store_path, "--sequences")["sequences"]
    assert set(HOSTILE) <= {r["id"] for r in rows}
    for name in HOSTILE:
        out = run_json("inspect", store_path, "--seq", name)["seq"]
        assert out["id"] == name and out["length"] == 2
        run("inspect", store_path, "--seq", name)  # text form: escaped (checked in run)
    error = run("verify", store_path / "\x1bmissing\r\n", code=4).stderr
    assert "\\x1bmissing\\x0d\\x0a" in error


# -- a live writer in another process (T11) -----------------------------------------------


def _writer(path: str, conn: Any) -> None:
    """Child: open the store as writer, commit one change, leave another uncommitted, wait."""
    with pagedkv.open(path) as store:
        store.create("live")
        store.append("live", *kv(9, 0, 20))
        store.commit()
        store.append("live", *kv(9, 20, 30))  # not committed: inspect must not see it
        conn.send(os.getpid())
        conn.recv()
    conn.close()


def test_live_writer_inspect_shows_pid_and_verify_exits_3(sample: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(str(sample), child))
    proc.start()
    try:
        assert parent.poll(60), "the writer did not start"
        pid = parent.recv()
        before = (sample / "pool.bin").read_bytes()
        out = run_json("inspect", sample)
        assert out["writer"] == {"locked": True, "pid": pid} and out["snapshot"] is True
        assert out["sequences"] == len(make_sample.SEQUENCES) + 1
        assert f"pid {pid}" in run("inspect", sample).stdout
        live = run_json("inspect", sample, "--seq", "live")["seq"]
        assert live["length"] == 20  # the committed length, from the snapshot
        result = run("verify", sample, code=3)
        assert_one_line_error(result)
        assert "--live" in result.stderr and str(pid) in result.stderr
        checked = run_json("verify", sample, "--live")
        assert checked["ok"] is True and checked["live"] is True and checked["writer_pid"] == pid
        assert (sample / "pool.bin").read_bytes() == before
    finally:
        parent.send("stop")
        proc.join(60)
    assert proc.exitcode == 0
    assert run_json("inspect", sample)["writer"] == {"locked": False, "pid": None}
    assert run_json("verify", sample)["ok"] is True
