"""Everything the README shows is true: its tour runs as written, its inspect output is the sample's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pagedkv.cli.commands import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_tour_runs_as_written_twice(tmp_path: Path) -> None:
    """The first code block, run in a fresh directory and then again over the store it left."""
    tour = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    assert 'pagedkv.open("kv.store"' in tour
    for run in range(2):
        done = subprocess.run([sys.executable, "-c", tour], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"run {run + 1}: {done.stderr[-2000:]}"
        assert done.stdout.strip() == "['a', 'b'] 41 0", done.stdout


def test_the_inspect_output_shown_is_the_sample_stores(monkeypatch) -> None:
    shown = re.search(r"```\n\$ pagedkv inspect data/sample\.kv\n(.*?)```", README, re.S)
    assert shown, "the README no longer shows inspect of the sample store"
    monkeypatch.chdir(ROOT)  # the path as the README types it
    result = CliRunner().invoke(cli, ["inspect", "data/sample.kv"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # The disk line describes the machine inspect runs on, not the store.
    def store_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("disk ")]

    assert store_lines(result.output) == store_lines(shown.group(1))
    assert len(store_lines(result.output)) >= 15
