"""The mutation campaign (``python -m tools.mutate``): damaged copies of stores of known content, checked in
forked children read-only and as a writer, never give wrong bytes, an untyped error, a crash or
a hang.

The CI size runs a few hundred copies across the three spill codecs; the soak size is the
full campaign, 2,000 copies per codec (``PAGEDKV_SOAK=1 pytest -m soak``). Seeds are printed;
replay one with ``PAGEDKV_SEED=<n>``. The oracle itself is checked too: wrong bytes, a lost
sequence, a signal and a hang in a child are each classified as such.
"""

from __future__ import annotations

import os
import select
import shutil
from pathlib import Path

import pytest

from tools import mutate

from tests.kits.content import get_seed
from tests.kits.faults import scales
from tests.kits.files import copy_store


SIZES = {"ci": 90, "soak": 2000}  # copies per codec; the kinds are taken in turn


@pytest.mark.slow
@pytest.mark.parametrize("scale", scales())
def test_damaged_copies_meet_the_bar(fast_tmp: Path, tmp_path: Path, scale: str) -> None:
    """Every kind of damage, every codec: no copy gives WRONG, UNTYPED, CRASH or HANG."""
    seed = get_seed(f"mutation campaign {scale}")
    copies = SIZES[scale]
    keep = str(tmp_path / "kept")  # under pytest's basetemp: kept after a failure
    summary = mutate.campaign(copies, mutate.CODECS, seed, jobs=2, timeout=30 if scale == "ci" else 60,
                              keep=keep, work_dir=str(fast_tmp), progress=0 if scale == "ci" else 500)
    report = f"seed {seed}\n{summary.table()}\n{summary.examples()}"
    print(report)
    assert summary.copies == copies * len(mutate.CODECS)
    # Every codec met every kind of damage, and the damage was real: most of it is reported.
    assert {kind for _, kind in summary.tallies} == set(mutate.KINDS), report
    assert summary.count("TYPED") >= summary.copies // 3, report
    assert summary.failures() == 0, report
    # Every metadata record is sealed: damage confined to them is never read back as clean.
    assert summary.unreported_sealed == 0, report


@pytest.fixture(scope="module")
def raw_base(tmp_path_factory: pytest.TempPathFactory):
    """An undamaged raw base store with its recorded reference answers."""
    work = mutate.scratch_dir(str(tmp_path_factory.mktemp("oracle")))
    base = mutate.build_base(os.path.join(work, "base"), "raw", get_seed("mutation oracle"))
    mutate.prepare(base, mutate.Runner(1, 30), work)
    yield base, work
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
def test_an_undamaged_copy_is_ok_both_ways(raw_base) -> None:
    """The oracle passes the store it was built from, read-only and as a writer."""
    base, work = raw_base
    for mode in ("ro", "rw"):
        path = copy_store(base.path, os.path.join(work, f"clean-{mode}"))
        result = mutate.examine(base, str(path), mode)
        assert result["outcome"] == "OK", result["notes"]


def test_the_oracle_sees_wrong_bytes_and_losses(raw_base) -> None:
    """A model that differs from the store by one sequence's bytes, or by one more sequence."""
    base, work = raw_base
    other = mutate.Base(**{**base.__dict__, "model": mutate.copy.deepcopy(base.model)})
    key, start, count = other.model.segs["c"][0]
    other.model.segs["c"][0] = (("not", "c"), start, count)  # other bytes for c's first tokens
    path = copy_store(base.path, os.path.join(work, "wrong"))
    result = mutate.examine(other, str(path), "ro")
    assert result["outcome"] == "WRONG", result["notes"]
    assert any("'c'" in note for note in result["notes"]["WRONG"]), result["notes"]

    lost = mutate.Base(**{**base.__dict__, "model": mutate.copy.deepcopy(base.model),
                          "states": [dict(state) for state in base.states]})
    lost.model.fork("a", "ghost")
    lost.states[-1]["ghost"] = lost.model.lens["ghost"]  # committed, as far as the oracle knows
    path = copy_store(base.path, os.path.join(work, "lost"))
    result = mutate.examine(lost, str(path), "rw")
    assert result["outcome"] == "LOST", result["notes"]


@pytest.mark.slow
def test_signals_and_hangs_are_classified(tmp_path: Path) -> None:
    """A child killed by a signal is CRASH; one that never answers is HANG once its time is up."""
    runner = mutate.Runner(2, timeout=1.0)
    never_r, never_w = os.pipe()  # nothing is ever written: a child waiting on it hangs

    def hang() -> None:  # blocks on a pipe nobody writes
        select.select([never_r], [], [])

    try:
        runner.start(mutate.Unit(None, "ro", "", err_path=str(tmp_path / "abort.err")), os.abort)
        runner.start(mutate.Unit(None, "rw", "", err_path=str(tmp_path / "hang.err")), hang)
        ends = {}
        while runner.running:
            for unit, end in runner.wait_any():
                ends[unit.mode] = mutate.verdict(end, runner.timeout)[0]
    finally:
        runner.kill_all()
        os.close(never_r)
        os.close(never_w)
    assert ends == {"ro": "CRASH", "rw": "HANG"}
