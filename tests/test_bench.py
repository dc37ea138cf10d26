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
from pagedkv.bench import ROW_KEYS, SCENARIOS, format_table, run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario once, quick (the budget: under 60 s on 2 cores)."""
    started = time.perf_counter()
    out = run(None, quick=True, seed=1, workdir=str(tmp_path_factory.mktemp("bench")))
    print(f"quick suite: {time.perf_counter() - started:.1f}s")
    return out


def test_every_scenario_reports(rows: list[dict[str, Any]]) -> None:
    assert {row["scenario"] for row in rows} == set(SCENARIOS)


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


def test_rows_carry_the_requested_figures(rows: list[dict[str, Any]]) -> None:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row["scenario"], []).append(row)
    assert {row["params"]["sequences"] for row in by_id["B2"]} >= {64, 256}
    churn = by_id["B4"]
    assert {row["params"]["durability"] for row in churn} == {"durable", "nosync"}
    assert {row["params"]["working_set"] for row in churn} == {"2x", "4x", "16x"}
    assert any("naive" in row["name"] for row in churn)
    for row in churn:
        assert {"restore_ms_p50", "restore_ms_p99"} <= set(row["metrics"])
    (seed,) = by_id["B5"]
    assert {"memory_hits", "disk_hits", "misses", "restore_ms_mean", "total_s"} <= set(seed["metrics"])
    assert seed["metrics"]["disk_hits"] == 20  # tokens 0-19 were all spilled
    assert {row["params"]["durability"] for row in by_id["B7"]} == {"durable", "nosync", "volatile"}
    assert all(row["unit"] == "B/page" for row in by_id["B8"])


def test_rows_are_json_and_render(rows: list[dict[str, Any]]) -> None:
    assert json.loads(json.dumps(rows)) == rows
    table = format_table(rows)
    for name in SCENARIOS:
        assert f"\n{name} " in table


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(pagedkv.PagedKVError, match="B9"):
        run(["B9"], quick=True)


def test_tool_prints_json(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--scenario", "b6",
                           "--json", "--quiet", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and {row["scenario"] for row in rows} == {"B6"}
