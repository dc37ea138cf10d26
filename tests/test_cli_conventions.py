"""The command line behaves like the tools people know: exit codes, JSON (errors included),
bare ``pagedkv``, readable unicode ids, ``--map`` on a terminal, plurals, and the
store-keeping commands ``gc``, ``stats`` and ``compact``; and ``check(detailed=True)``.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv.cli import options as cli_mod, text as clitext
from pagedkv.inspection import report as inspector
from pagedkv.cli.commands import cli
from pagedkv.demo.kvgen import token_kv

from tests.kits.cli import error_of, run, run_json
from tests.kits.store import ROOT



TINY = pagedkv.PRESETS["tiny"]


def kv(origin: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    return token_kv(TINY, 7, origin, np.arange(start, stop))


# -- check(detailed=True) -------------------------------------------------------------


def _damage_resident_page(path: Path) -> int:
    """Flip a byte of a resident page in pool.bin; its uid."""
    with pagedkv.open(path, readonly=True) as store:
        mgr = store._mgr
        pid = next(p for p in np.flatnonzero(mgr.live).tolist() if mgr.slot[p] >= 0)
        uid, slot = int(mgr.uid[pid]), int(mgr.slot[pid])
    offset = 4096 + slot * TINY.page_nbytes + 5
    with open(path / "pool.bin", "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))
    return uid


def test_check_detailed_gives_kinds_pages_and_the_same_messages(tmp_path: Path) -> None:
    path = tmp_path / "s.kv"
    with pagedkv.open(path, TINY, pool_pages=4) as store:
        store.create("a")
        store.append("a", *kv(1, 0, 40))
        assert store.check(detailed=True) == []
    uid = _damage_resident_page(path)
    with pagedkv.open(path, readonly=True) as store:
        detailed = store.check(detailed=True)
        plain = store.check()
    assert plain == [problem.message for problem in detailed] and plain
    assert all(isinstance(problem, pagedkv.Problem) for problem in detailed)
    hit = [problem for problem in detailed if problem.kind == "pool_checksum"]
    assert len(hit) == 1 and hit[0].page == uid and hit[0].sequence is None
    assert hit[0].to_dict() == {"kind": "pool_checksum", "page": uid, "sequence": None,
                                "message": f"page {uid}: pool slot {hit[0].message.split()[4]} fails its checksum"}
    assert str(hit[0]) == hit[0].message


# -- a store to run commands on ----------------------------------------------------------------


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "s.kv"
    with pagedkv.open(path, TINY, pool_pages=4) as store:
        store.create("a")
        store.append("a", *kv(1, 0, 40))
        store.create(7)
        store.append(7, *kv(2, 0, 20))
        store.create("7")
        store.append("7", *kv(3, 0, 3))
    return path


# -- exit codes ---------------------------------------------------------------------------------


def test_exit_0_ok(store_path: Path) -> None:
    run("inspect", store_path)
    assert run_json("verify", store_path)["ok"] is True


def test_exit_1_damage_found_by_verify(store_path: Path) -> None:
    uid = _damage_resident_page(store_path)
    out = run_json("verify", store_path, code=1)
    assert out["schema"] == 1 and out["ok"] is False
    assert [{k: p[k] for k in ("kind", "page", "sequence")} for p in out["damage"]] == \
        [{"kind": "pool_checksum", "page": uid, "sequence": None}]
    text = run("verify", store_path, code=1).stdout
    assert "DAMAGED" in text and "1 problem in " in text and "1 problems" not in text


def test_exit_1_a_store_too_damaged_to_open(store_path: Path) -> None:
    os.truncate(store_path / "pool.bin", 5000)
    assert error_of("verify", store_path, code=1)["kind"] == "StoreCorrupt"
    assert error_of("inspect", store_path, code=4)["kind"] == "StoreCorrupt"  # inspect cannot open it


@pytest.mark.parametrize("args", [["verfy", "x"], ["verify", "--bogus", "x"], ["verify"], ["inspect", "--page"],
                                  ["gc", "x", "--max-bytes", "lots"], ["stats", "x", "--prometheus", "--json"]])
def test_exit_2_usage_error_is_not_damage(args: list[str]) -> None:
    """``verify x || alert`` must not fire as damage on a typo: usage is 2, never 1."""
    result = run(*args, code=2)
    assert result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1
    assert result.stdout == "" or "--json" in args
    assert error_of(*args, code=2)["kind"] == "UsageError"


def test_exit_2_an_id_that_names_nothing(store_path: Path) -> None:
    assert error_of("inspect", store_path, "--seq", "missing", code=2)["kind"] == "SequenceNotFound"
    assert error_of("inspect", store_path, "--page", "999999", code=2)["kind"] == "PageNotFound"


def test_exit_3_locked(store_path: Path) -> None:
    with pagedkv.open(store_path):  # this process holds the writer lock
        error = error_of("verify", store_path, code=3)
        assert error["kind"] == "StoreLocked" and "--live" in error["message"]
        assert error_of("gc", store_path, code=3)["kind"] == "StoreLocked"
        assert error_of("compact", store_path, code=3)["kind"] == "StoreLocked"
        result = run("verify", store_path, code=3)
    assert result.stderr.startswith("Error: ") and str(os.getpid()) in result.stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "stats", "gc", "compact"])
def test_exit_4_not_a_store(command: str, tmp_path: Path) -> None:
    error = error_of(command, tmp_path / "missing", code=4)
    assert error["kind"] == "NotAStore" and "no such file or directory" in error["message"]
    (tmp_path / "plain").write_text("x")
    assert error_of(command, tmp_path / "plain", code=4)["kind"] == "NotAStore"
    assert not (tmp_path / "missing").exists()


def test_exit_130_on_ctrl_c(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(snap: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(inspector, "summary", interrupted)
    result = run("inspect", store_path, code=130)
    assert result.stdout == "" and "interrupted" in result.stderr
    assert error_of("inspect", store_path, code=130)["kind"] == "Interrupted"


def test_exit_70_on_an_internal_error(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(snap: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(inspector, "summary", broken)
    error = error_of("inspect", store_path, code=70)
    assert error["kind"] == "InternalError" and "RuntimeError: a bug" in error["message"]


def test_broken_pipe_is_quiet(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def gone(snap: Any) -> Any:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(inspector, "summary", gone)
    result = run("inspect", store_path, code=141)
    assert result.stdout == "" and result.stderr == ""


def test_exit_codes_are_documented_in_every_help_and_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for code in ("0", "1", "2", "3", "4", "70", "130"):
        assert re.search(rf"^\| {code} \|", readme, re.M), f"exit {code} is not in the README's table"
    for command in [[], *([name] for name in sorted(cli.commands))]:
        text = run(*command, "--help").stdout
        assert "Exit codes:" in text and re.search(r"^\s+1\s+damage found", text, re.M), command
        assert re.search(r"^\s+130\s+interrupted", text, re.M), command


# -- bare pagedkv, help, deprecations -------------------------------------------------------------


def test_bare_pagedkv_prints_the_help_and_exits_0() -> None:
    result = run(code=0)
    assert result.stdout.startswith("Usage: ") and "Commands:" in result.stdout
    assert result.stdout == run("--help").stdout and result.stderr == ""
    proc = subprocess.run([sys.executable, "-m", "pagedkv"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: ") and proc.stderr == ""


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_command_has_help(command: str) -> None:
    text = run(command, "--help").stdout
    assert f"pagedkv {command}" in text and "Example" in text and "--help" in text
    if command != "bench":
        assert "--json" in text


def test_no_deprecated_click_api() -> None:
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-m", "pagedkv", "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "PacifyFlushWrapper" not in (ROOT / "pagedkv" / "cli" / "commands.py").read_text()


# -- JSON: a schema version everywhere, errors too -------------------------------------------------


def test_every_json_output_has_a_schema_version(store_path: Path, tmp_path: Path) -> None:
    outputs = [run_json("inspect", store_path), run_json("inspect", store_path, "--sequences", "--map"),
               run_json("verify", store_path), run_json("stats", store_path), run_json("gc", store_path),
               run_json("compact", store_path),
               run_json("demo", tmp_path / "d.kv", "--preset", "tiny", "--pool-pages", "32",
                        "--sequences", "2", "--tokens", "4")]
    assert all(out["schema"] == 1 for out in outputs)


@pytest.mark.parametrize("args", [["demo", "--preset", "huge"], ["bench", "--scenario", "B99"],
                                  ["inspect", "--bogus"], ["nosuchcommand"]])
def test_usage_errors_are_json_objects_with_json(args: list[str]) -> None:
    error = error_of(*args, code=2)
    assert error["kind"] == "UsageError" and error["message"]


def test_json_error_escapes_control_characters(tmp_path: Path) -> None:
    out = run("inspect", tmp_path / "bad\x1b[2J\rname", "--json", code=4).stdout
    assert "\x1b" not in out and "\r" not in out and "\\u001b" in out
    assert json.loads(out)["error"]["message"].startswith(str(tmp_path / "bad\x1b[2J\rname"))


# -- unicode ids ---------------------------------------------------------------------------------

UNICODE = "café-🚀"
HOSTILE = {"esc": "esc\x1b[31mred", "cr": "cr\rreturn", "nul": "nul\x00byte", "rtl": "rtl\u202eevil",
           "nbsp": "nb\u00a0sp"}


@pytest.fixture
def unicode_store(tmp_path: Path) -> Path:
    path = tmp_path / "u.kv"
    with pagedkv.open(path, TINY, pool_pages=8) as store:
        for n, seq_id in enumerate([UNICODE, 7, "7", "8", "it's", 'say "hi"', "'quoted'", *HOSTILE.values()]):
            store.create(seq_id)
            store.append(seq_id, *kv(n + 1, 0, n + 1))
    return path


def test_unicode_ids_are_shown_as_they_are(unicode_store: Path) -> None:
    text = run("inspect", unicode_store, "--sequences").stdout
    assert f"'{UNICODE}'" in text and "caf\\xe9" not in text
    assert f"sequence '{UNICODE}': 1 token in 1 page" in run("inspect", unicode_store, "--seq", UNICODE).stdout


def test_control_and_unprintable_characters_stay_escaped(unicode_store: Path) -> None:
    text = run("inspect", unicode_store, "--sequences").stdout
    for raw in ("\x1b", "\r", "\x00", "\u202e", "\u00a0"):
        assert raw not in text
    for shown in ("'esc\\x1b[31mred'", "'cr\\rreturn'", "'nul\\x00byte'", "'rtl\\u202eevil'", "'nb\\xa0sp'"):
        assert shown in text, shown


def _shown_ids(path: Path) -> list[str]:
    """The id column of ``inspect --sequences``, as printed."""
    lines = run("inspect", path, "--sequences").stdout.splitlines()[2:]
    return [re.split(r"  +", line)[0] for line in lines]


def test_every_id_is_selectable_as_shown(unicode_store: Path) -> None:
    with pagedkv.open(unicode_store, readonly=True) as store:
        expected = {seq: store.length(seq) for seq in store.sequences()}
    shown = _shown_ids(unicode_store)
    assert len(shown) == len(expected)
    found = {}
    for text in shown:
        out = run_json("inspect", unicode_store, "--seq", text)["seq"]
        found[json.dumps(out["id"])] = out["length"]
        assert clitext.show_id(out["id"]) == text  # the id selected is the one shown
    assert found == {json.dumps(seq): length for seq, length in expected.items()}


def test_int_and_str_ids_rule(unicode_store: Path) -> None:
    assert run_json("inspect", unicode_store, "--seq", "7")["seq"]["id"] == 7  # bare: the int
    assert run_json("inspect", unicode_store, "--seq", "'7'")["seq"]["id"] == "7"  # quoted: the str
    assert run_json("inspect", unicode_store, "--seq", '"7"')["seq"]["id"] == "7"
    assert run_json("inspect", unicode_store, "--seq", "8")["seq"]["id"] == "8"  # no int 8: the str
    assert run_json("inspect", unicode_store, "--seq", "it's")["seq"]["id"] == "it's"  # as typed
    assert run_json("inspect", unicode_store, "--seq", "'quoted'")["seq"]["id"] == "'quoted'"  # literal fallback
    assert run_json("inspect", unicode_store, "--seq", "\"'quoted'\"")["seq"]["id"] == "'quoted'"
    assert error_of("inspect", unicode_store, "--seq", "9", code=2)["kind"] == "SequenceNotFound"


# -- the pool map ----------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_map_uses_terminal_width_and_colour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", _Terminal())
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(80, 24): os.terminal_size((132, 40)))
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert cli_mod._map_style() == (132 - clitext.MAP_GUTTER, True)
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli_mod._map_style() == (132 - clitext.MAP_GUTTER, False)
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("TERM", "dumb")
    assert cli_mod._map_style()[1] is False
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cli_mod._map_style() == (inspector.MAP_WIDTH, False)


def test_map_colour_marks_only_the_grid_and_legend(store_path: Path) -> None:
    info = run_json("inspect", store_path, "--map")["map"]
    plain, coloured = clitext.map_text(info), clitext.map_text(info, color=True)
    assert "\x1b" not in plain and "\x1b[32m" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == plain
    assert "\x1b" not in run("inspect", store_path, "--map").stdout  # not a terminal: no colour
    for meaning in inspector.MAP_LEGEND.values():
        assert meaning in plain
    assert re.search(r"^summary: \d+ free, \d+ resident, .* of 4 slots$", plain, re.M)


def test_map_of_a_pool_too_large_to_draw(tmp_path: Path) -> None:
    path = tmp_path / "big.kv"
    with pagedkv.open(path, TINY, pool_pages=10_000) as store:
        store.create("a")
        store.append("a", *kv(1, 0, 64))
    out = run_json("inspect", path, "--map")["map"]
    assert out["slots_per_cell"] == 3 and len(out["rows"]) <= 64
    text = run("inspect", path, "--map").stdout
    assert "too large to draw a slot per character" in text and "10,000 slots" in text
    assert re.search(r"^summary: 9,996 free, 4 resident, .* of 10,000 slots$", text, re.M)


# -- plurals, latency, progress -------------------------------------------------------------------


def test_plurals(tmp_path: Path) -> None:
    geom = pagedkv.Geometry(layers=1, kv_heads=1, head_dim=8, page_size=1, dtype="float16")
    path = tmp_path / "one.kv"
    with pagedkv.open(path, geom, pool_pages=1) as store:
        store.create("x")
        k = np.ones((1, 1, 1, 8), np.float16)
        store.append("x", k, k)
    text = run("inspect", path).stdout
    assert "1 layer x 1 kv head x 8 head_dim, 1 token/page" in text
    assert re.search(r"^sequences +1 \(1 token\)$", text, re.M)
    assert "sequence 'x': 1 token in 1 page" in run("inspect", path, "--seq", "x").stdout
    verified = run("verify", path).stdout
    assert "ok: " in verified and "1 page (1 resident, 0 spilled), 1 sequence checked" in verified
    assert clitext.plural(1, "problem") == "1 problem" and clitext.plural(0, "problem") == "0 problems"
    assert clitext.plural(2, "miss", "misses") == "2 misses" and clitext.plural(1_000, "page") == "1,000 pages"


def test_demo_without_restores_says_so(tmp_path: Path) -> None:
    out = run_json("demo", tmp_path / "d.kv", "--preset", "tiny", "--pool-pages", "200", "--sequences", "2",
                   "--tokens", "4")
    assert out["restores"] == 0
    text = run("demo", tmp_path / "d.kv", "--preset", "tiny", "--pool-pages", "200", "--sequences", "2",
               "--tokens", "4").stdout
    assert re.search(r"^restore latency +no restores$", text, re.M) and "p50 0.000" not in text


def test_progress_bar_shows_a_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with cli_mod._progress(10, "serving", "requests", False) as bar:
        bar.update(4)
    assert re.search(r"[0-9.,]+ requests/s", terminal.getvalue()), terminal.getvalue()
    assert clitext.rate_text(10, 4.0, "requests") == "2.5 requests/s"
    assert clitext.rate_text(0, 4.0, "requests") is None and clitext.rate_text(3, 0.0, "tokens") is None


# -- a nearly full filesystem --------------------------------------------------------------------------


def _filesystem(free: int, total: int) -> Any:
    return lambda path: os.statvfs_result((4096, 4096, total // 4096, free // 4096, free // 4096,
                                           0, 0, 0, 0, 255))


def test_inspect_warns_when_the_filesystem_is_nearly_full(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspector, "_statvfs", _filesystem(free=5 << 30, total=100 << 30))  # 5% free
    result = run("inspect", store_path, "--json")
    assert result.stderr == ""  # JSON carries the warning; stdout alone parses
    out = json.loads(result.stdout)
    assert out["disk"] == {"free_bytes": 5 << 30, "total_bytes": 100 << 30, "low": True}
    assert len(out["warnings"]) == 1 and "nearly full" in out["warnings"][0]
    result = run("inspect", store_path)
    assert "warning: the filesystem holding" in result.stdout and "NEARLY FULL" in result.stdout
    assert result.stderr.startswith("warning: ") and "pagedkv gc" in result.stderr
    monkeypatch.setattr(inspector, "_statvfs", _filesystem(free=500 << 20, total=2 << 30))  # under 1 GiB free
    assert run_json("inspect", store_path)["disk"]["low"] is True
    monkeypatch.setattr(inspector, "_statvfs", _filesystem(free=50 << 30, total=100 << 30))
    out = run_json("inspect", store_path)
    assert out["disk"]["low"] is False and out["warnings"] == []
    assert run("inspect", store_path).stderr == ""


# -- stats and sizes ------------------------------------------------------------------------------------


def test_stats_text_json_and_prometheus(store_path: Path) -> None:
    out = run_json("stats", store_path)
    with pagedkv.open(store_path, readonly=True) as store:
        expected = dict(store.stats())
    assert out["schema"] == 1 and out["stats"] == expected
    assert out["lifetime"] == {"evictions": out["lifetime"]["evictions"], "restores": out["lifetime"]["restores"],
                               "cache_drops": 0} and out["lifetime"]["evictions"] > 0  # 4 slots, 5 pages
    text = run("stats", store_path).stdout
    assert re.search(r"^lifetime +\d+ evictions, \d+ restores, 0 cached pages dropped", text, re.M)
    assert re.search(r"^sequences +3$", text, re.M) and re.search(r"^pool_pages +4$", text, re.M)
    prom = run("stats", store_path, "--prometheus").stdout
    assert "# TYPE" in prom and "pagedkv_" in prom


@pytest.mark.parametrize("text, value", [("1000", 1000), ("64MiB", 64 << 20), ("2G", 2 << 30), ("1.5K", 1536),
                                         ("0", 0), ("4 GiB", 4 << 30), ("10kb", 10 << 10)])
def test_byte_sizes(text: str, value: int) -> None:
    assert cli_mod.ByteSize().convert(text, None, None) == value


def test_a_store_open_in_this_process_is_refused_in_one_line(store_path: Path) -> None:
    """LMDB allows one handle per process: no private copy is made to get around it."""
    with pagedkv.open(store_path, readonly=True):
        error = error_of("inspect", store_path, code=4)
    assert error["kind"] == "AlreadyOpenHere" and "another process" in error["message"]
