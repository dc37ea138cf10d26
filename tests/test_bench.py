"""The benchmark suite runs end to end in quick mode (CI checks that it runs, not its numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import pagedkv
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
    churn = by_id["B4"]
    assert {row["params"]["durability"] for row in churn} == {"durable", "nosync"}
    assert {row["params"]["working_set"] for row in churn} == {"2x", "4x", "16x"}
    assert any("naive" in row["name"] for row in churn)
    for row in churn:
        assert {"restore_ms_p50", "restore_ms_p99"} <= set(row["metrics"])
    assert [row["params"]["spill_codec"] for row in churn if "spill_codec" in row["params"]] == \
        ["raw", "int8", "zstd"]  # quick: one configuration
    (seed,) = by_id["B5"]
    assert {"memory_hits", "disk_hits", "misses", "restore_ms_mean", "total_s"} <= set(seed["metrics"])
    assert seed["metrics"]["disk_hits"] == 20  # tokens 0-19 were all spilled
    assert {row["params"]["durability"] for row in by_id["B7"]} == {"durable", "nosync", "volatile"}
    assert all(row["unit"] == "B/page" for row in by_id["B8"])


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
