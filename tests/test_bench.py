"""The benchmark suite runs end to end in quick mode (CI checks that it runs, not its numbers)."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

import pagedkv
from pagedkv.bench import vllmref
from pagedkv.bench.meta import META_GEOM
from pagedkv.bench.records import SameRecords, recording
from pagedkv.bench.ref import RefHashingBlockManager
from pagedkv.bench.suite import ROW_KEYS, SCENARIOS, format_table, run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario once, quick (the budget: under 60 s on 2 cores)."""
    started = time.perf_counter()
    out = run(None, quick=True, seed=1, workdir=str(tmp_path_factory.mktemp("bench")))
    print(f"quick suite: {time.perf_counter() - started:.1f}s")
    return out


@pytest.mark.slow
def test_every_scenario_reports(rows: list[dict[str, Any]]) -> None:
    assert {row["scenario"] for row in rows} == set(SCENARIOS)


@pytest.mark.slow
def test_rows_have_the_stable_keys(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        assert tuple(row) == ROW_KEYS, row["name"]
        assert isinstance(row["name"], str) and row["name"]
        assert isinstance(row["unit"], str) and row["unit"]
        assert isinstance(row["target"], str) and row["target"]
        assert isinstance(row["params"], dict) and isinstance(row["metrics"], dict)
        assert isinstance(row["pagedkv"], float) and row["pagedkv"] >= 0
        assert row["meets"] in (True, False, None)
        if row["reference"] is None:
            assert row["ratio"] is None, row["name"]  # nothing to divide by
        else:
            assert isinstance(row["ratio"], float) and row["ratio"] > 0, row["name"]


@pytest.mark.slow
def test_rows_carry_the_requested_figures(rows: list[dict[str, Any]]) -> None:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row["scenario"], []).append(row)
    assert {row["params"]["sequences"] for row in by_id["B2"]} >= {64, 256}
    assert sorted(row["name"] for row in by_id["B3"]) == ["read whole sequences",
                                                          "read whole sequences as pages"]
    churn = [row for row in by_id["B4"] if "working_set" in row["params"] or "naive" in row["name"]]
    assert {row["name"] for row in by_id["B4"]} - {row["name"] for row in churn} == {
        "eviction per page, 100000 vs 10000 slots"}  # the one row that is not churn
    assert {row["params"]["durability"] for row in churn} == {"durable", "nosync"}
    assert {row["params"]["working_set"] for row in churn} == {"2x", "4x", "16x"}
    assert any("naive" in row["name"] for row in churn)
    for row in churn:
        assert {"restore_ms_p50", "restore_ms_p99"} <= set(row["metrics"])
    assert [row["params"]["spill_codec"] for row in churn if "spill_codec" in row["params"]] == \
        ["raw", "int8", "zstd"]  # quick: one configuration
    (seed,) = [row for row in by_id["B5"] if row["name"] == "seed workload"]
    assert {"memory_hits", "disk_hits", "misses", "restore_ms_mean", "total_s"} <= set(seed["metrics"])
    assert seed["metrics"]["disk_hits"] == 20  # tokens 0-19 were all spilled
    assert {row["params"]["durability"] for row in by_id["B7"]} == {"durable", "nosync", "volatile"}
    assert all(row["unit"] == "B/page" for row in by_id["B8"])
    # The warm-up ran in each child before the measurement (and left something: imports at least).
    assert all(row["metrics"]["warm_up_traced_bytes"] > 0 for row in by_id["B8"])


def _named(rows: list[dict[str, Any]], scenario: str, name: str) -> dict[str, Any]:
    (row,) = [row for row in rows if row["scenario"] == scenario and row["name"] == name]
    for key in ("pagedkv", "reference", "ratio"):
        assert row[key] is not None and math.isfinite(row[key]) and row[key] > 0, (name, key)
    return row


@pytest.mark.slow
def test_b2_token_id_rows_hash_every_filled_page(rows: list[dict[str, Any]]) -> None:
    vllm_here = vllmref.unavailable() is None
    for nseq in (64, 256):  # quick sizes
        row = _named(rows, "B2", f"decode step with token ids {nseq} seqs")
        assert row["params"]["sequences"] == nseq and row["target"] == "<= 1.0x"
        assert row["metrics"]["hashed_pages"] > nseq  # prompts of up to 512 tokens fill pages
        peers = [other for other in rows if other["name"] == f"decode step with token ids {nseq} seqs vs vLLM"]
        assert len(peers) == (1 if vllm_here else 0)
        if vllm_here:
            peer = _named(rows, "B2", peers[0]["name"])
            assert peer["target"] == "<= 0.5x" and peer["pagedkv"] == row["pagedkv"]
            assert peer["metrics"]["vllm_cached_blocks"] == row["metrics"]["hashed_pages"]
            assert peer["params"]["vllm_hash_algo"] == "sha256"  # vLLM's default
        else:
            assert "vLLM not importable" in row["notes"]
    fixed = _named(rows, "B2", "one-sequence step fixed cost")
    assert fixed["params"]["sequences"] == 1 and fixed["unit"] == "us/step" and fixed["target"] == "<= 25 us"
    growth = _named(rows, "B2", "one-sequence step fixed cost, 100000 vs 1000 slots")
    assert growth["target"] == "<= 1.2x" and growth["params"]["large_pool_pages"] == 100 * growth["params"][
        "small_pool_pages"]
    assert growth["metrics"]["small_us"] == growth["reference"]


@pytest.mark.slow
def test_b4_eviction_growth_row(rows: list[dict[str, Any]]) -> None:
    row = _named(rows, "B4", "eviction per page, 100000 vs 10000 slots")
    assert row["target"] == "<= 1.2x" and row["unit"] == "us/page" and row["metrics"]["small_us"] == row["reference"]
    assert row["params"]["large_pool_pages"] == 100_000 and row["params"]["evict_batch"] == 64


@pytest.mark.slow
def test_b5_spilled_read_row_reads_from_spill(rows: list[dict[str, Any]]) -> None:
    row = _named(rows, "B5", "one-page read() of a spilled page")
    params, metrics = row["params"], row["metrics"]
    assert row["unit"] == "us" and row["target"] == "<= 3.0x" and params["page_nbytes"] == 60
    assert metrics["disk_hits"] == params["pairs"] * params["pages_per_block"]
    assert metrics["spilled_pages"] > metrics["disk_hits"]


@pytest.mark.slow
def test_b7_same_records_and_growth_rows(rows: list[dict[str, Any]]) -> None:
    nosync = _named(rows, "B7", "commit after decode step nosync")
    same = _named(rows, "B7", "commit after decode step nosync vs the same records")
    assert same["ratio"] == nosync["metrics"]["ratio_to_same_records_nosync"]
    assert same["metrics"]["puts_dir"] == same["metrics"]["puts_seqs"] == 256  # one page and table per sequence
    assert same["metrics"]["records"] >= 512 and same["metrics"]["put_bytes"] > 0
    for mode in ("nosync", "durable"):
        row = _named(rows, "B7", f"commit after decode step {mode}, 100000 vs 10000 pages")
        assert row["target"] == "<= 1.2x"
        assert row["params"]["pages_small"] == 10_000 and row["params"]["pages_large"] == 100_000
        assert row["metrics"]["spilled_large"] > 0.9 * 100_000 - row["params"]["pool_pages"]
        (pool,) = [row for row in rows if row["scenario"] == "B7"
                   and row["name"].startswith(f"commit after decode step {mode}, 100000-slot vs ")]
        assert pool["target"] == "<= 1.2x" and pool["params"]["pool_pages_large"] == 100_000
        assert pool["params"]["pool_pages_small"] < 100_000 and pool["metrics"]["small_ms"] == pool["reference"]


def test_hashing_reference_chains_blocks_over_their_ids() -> None:
    ref = RefHashingBlockManager(num_blocks=8, block_size=4)
    ref.add("a")
    ids = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    tables, slots, lens = ref.step_ids({"a": 6}, {"a": ids[:6]})
    assert lens.tolist() == [6] and tables.tolist() == [[0, 1]] and slots.tolist() == [0, 1, 2, 3, 4, 5]
    first = xxhash.xxh3_128_digest(bytes(16) + struct.pack("<4I", *ids[:4]))
    assert ref.prefix_cache == {first: 0} and ref.block_hash == {0: first}
    ref.step_ids({"a": 3}, {"a": ids[6:9]})  # the second block fills at token 8
    second = xxhash.xxh3_128_digest(first + struct.pack("<4I", *ids[4:8]))
    assert ref.prefix_cache == {first: 0, second: 1} and ref.last_hash["a"] == second


def test_recording_logs_a_commit_and_same_records_replays_it(tmp_path: Path) -> None:
    store = pagedkv.open(str(tmp_path / "store"), META_GEOM, pool_pages=64, durability="nosync")
    try:
        for seq in range(3):
            store.create(seq)
        with store.step({0: 20, 1: 5, 2: 1}):
            pass
        with recording(store) as txns:
            store.commit()
        (log,) = txns
        by_db = log.by_db()
        assert by_db["dir"] == 4 and by_db["seqs"] == 3  # pages 2 + 1 + 1, three block tables
        assert by_db["meta"] >= 2 and not log.deletes
        store.commit()  # recording ended: the store's own write path is back
        assert "write" not in vars(store._spill)
        same = SameRecords(str(tmp_path / "same"), store, log)
        try:
            assert same.commit_ms() > 0
            with same.env.begin() as txn:
                for name, key, value in log.puts:
                    assert txn.get(key, db=same.dbs[name]) == value
        finally:
            same.close()
    finally:
        store.close()


@pytest.mark.slow
def test_b4_codec_rows_report_throughput_and_bytes_on_disk(rows: list[dict[str, Any]]) -> None:
    codec = {row["params"]["spill_codec"]: row for row in rows if "spill_codec" in row["params"]}
    for name, row in codec.items():
        metrics = row["metrics"]
        assert row["scenario"] == "B4" and name in row["name"] and row["unit"] == "GiB/s"
        assert row["pagedkv"] > 0 and row["reference"] > 0
        assert metrics["spill_bytes"] > 0 and metrics["data_mdb_bytes"] >= metrics["spill_bytes"]
        assert metrics["codec_pages"] > 0 and metrics["codec_ratio"] > 0
        assert metrics["pagedkv_restores_per_pass"] > 0
    # The same passes through every store: the same pages stored, fewer bytes when compressed.
    assert codec["int8"]["metrics"]["codec_pages"] == codec["raw"]["metrics"]["codec_pages"]
    assert codec["int8"]["metrics"]["spill_bytes"] < 0.6 * codec["raw"]["metrics"]["spill_bytes"]
    assert codec["zstd"]["metrics"]["spill_bytes"] < codec["raw"]["metrics"]["spill_bytes"]
    assert codec["raw"]["metrics"]["readback_exact"] is True and codec["zstd"]["metrics"]["readback_exact"] is True
    assert codec["int8"]["metrics"]["readback_exact"] is False  # lossy, within half a step
    assert 0 < codec["int8"]["metrics"]["readback_max_abs_error"] < 0.02


@pytest.mark.slow
def test_rows_are_json_and_render(rows: list[dict[str, Any]]) -> None:
    assert json.loads(json.dumps(rows)) == rows
    table = format_table(rows)
    for name in SCENARIOS:
        assert f"\n{name} " in table


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(pagedkv.PagedKVError, match="B99"):
        run(["B99"], quick=True)


@pytest.mark.slow
def test_tool_prints_json(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--scenario", "b6",
                           "--json", "--quiet", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and {row["scenario"] for row in rows} == {"B6"}
