"""Crash-safety soak runs of pagedkv (docs/reliability.md T2, T3, T4) with a summary of figures.

The loops are the ones of tests/test_crash.py (tests/kits/crash.py, crashpoints.py and
powerloss.py), run at soak sizes, as a module from the repository root (it imports the kits as
``tests.kits``; run as a file it says so and exits 2):

    python -m tools.crashtest --cycles 5000                  # T2: SIGKILL loop, durable and nosync
    python -m tools.crashtest --mode power --cycles 50000    # T4: simulated power loss
    python -m tools.crashtest --mode points --hits 50        # T3: every crash point, hits 1..50
    python -m tools.crashtest --mode mutation                # the oracles catch planted bugs
    python -m tools.crashtest --mode all --seed 7 --dir /var/tmp

SIGKILL loops keep their stores in the system temp dir (a real filesystem), power-loss loops
on /dev/shm when it is a tmpfs; --dir (or PAGEDKV_CRASH_DIR) puts both elsewhere.
Exit status: 0 when no loop found a violation (and every mutation was caught), 1 otherwise.
Failing stores are copied under --artifacts (default: <SIGKILL dir>/artifacts, kept on failure).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the kits are importable only from the repository root
    print("run it from the repository root as a module: python -m tools.crashtest [options]", file=sys.stderr)
    sys.exit(2)

from tests.kits.content import get_seed
from tests.kits.crash import sigkill_loop
from tests.kits.crashpoints import POINTS, crashpoint_run
from tests.kits.powerloss import GEOM_POWER, GEOM_POWER_SHARED, noflush_mutation, power_loss_loop
from tests.kits.verdict import LoopResult, scratch_root

MODES = ("durable", "nosync", "power", "power-shared", "points", "mutation")
KEY_FIGURES = ("sigkilled", "state_acked", "state_acked+1", "acked_commits", "evictions", "restores",
               "lost_pages", "wrong_tokens", "commits", "crash_inside_op", "blocks_unflushed",
               "flagged_cycles", "reopen_failures")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cycles", type=int, default=5000,
                        help="cycles per loop: per mode for T2, per page geometry for T4 (default 5000)")
    parser.add_argument("--mode", default="durable,nosync",
                        help=f"comma-separated loops among {', '.join(MODES)}, or 'all' "
                             "(default durable,nosync)")
    parser.add_argument("--seed", type=lambda text: int(text, 0), default=None,
                        help="seed (default: PAGEDKV_SEED, else random; printed either way)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory for the stores (default: PAGEDKV_CRASH_DIR, else the system "
                             "temp dir for SIGKILL loops and /dev/shm (tmpfs) for power loss)")
    parser.add_argument("--artifacts", type=Path, default=None, help="where failing stores are copied")
    parser.add_argument("--kill-max-ms", type=float, default=50.0, help="T2 kill delay is U(1, this) ms")
    parser.add_argument("--hits", type=int, default=5, help="T3: crash at hits 1..N of every point")
    parser.add_argument("--progress", type=int, default=1000, help="print a line every N cycles (0: never)")
    args = parser.parse_args(argv)
    modes = MODES if args.mode == "all" else tuple(m.strip() for m in args.mode.split(",") if m.strip())
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)} or all")
    args.modes = modes
    return args


def progress_printer(every: int, total: int):
    started = time.monotonic()

    def report(result: LoopResult) -> None:
        if every and result.cycles % every == 0:
            rate = result.cycles / max(time.monotonic() - started, 1e-9)
            print(f"  [{result.name}] {result.cycles}/{total} cycles, {result.violation_cycles} violating, "
                  f"{rate:.0f} cycles/s", flush=True)

    return report


def run_mode(mode: str, args: argparse.Namespace, seed: int, kill_work: Path, power_work: Path,
             artifacts: Path) -> tuple[list[LoopResult], list[str]]:
    """Run one loop; return its results and the reasons it failed (empty when it passed)."""
    cycles, failures = args.cycles, []
    work = power_work if mode.startswith("power") else kill_work
    report = progress_printer(args.progress, cycles)
    if mode in ("durable", "nosync"):
        result = sigkill_loop(work / f"t2-{mode}", mode, cycles, seed, kill_max_ms=args.kill_max_ms,
                              artifact_root=artifacts, progress=report)
        return [result], ["violations"] if result.violation_cycles else []
    if mode in ("power", "power-shared"):
        geom = GEOM_POWER if mode == "power" else GEOM_POWER_SHARED
        result = power_loss_loop(work / f"t4-{mode}", cycles, seed, geom=geom,
                                 name=f"T4-{mode}", artifact_root=artifacts, progress=report)
        return [result], ["violations"] if result.violation_cycles else []
    if mode == "points":
        results = []
        for durability in ("durable", "nosync"):
            result = crashpoint_run(work / f"t3-{durability}", durability, seed, POINTS,
                                    range(1, args.hits + 1), sessions=max(6, args.hits // 4 + 2),
                                    ops_per_session=24 if args.hits <= 5 else 40,
                                    artifact_root=artifacts)
            results.append(result)
            silent = [p for p in POINTS if not result.figures[f"fired:{p}"]]
            if result.violation_cycles:
                failures.append(f"{result.name}: violations")
            if silent:
                failures.append(f"{result.name}: points never fired: {silent}")
        return results, failures
    # mutation: each planted bug must be caught by the loop that guards against it
    undo = noflush_mutation()
    try:
        t4 = power_loss_loop(power_work / "mut-t4", 100, seed, name="T4-mutation-noflush",
                             artifact_root=power_work / "mutation-artifacts")
    finally:
        undo()
    t2 = sigkill_loop(work / "mut-t2", "nosync", 400, seed, mutation="reuse-pending",
                      name="T2-mutation-reuse-pending", stop_after_lost=True,
                      artifact_root=work / "mutation-artifacts")
    if t4.figures["flagged_cycles"] < 90:
        failures.append(f"T4 flagged only {t4.figures['flagged_cycles']} of 100 no-flush cycles")
    if not t2.figures["lost_pages"]:
        failures.append("T2 never caught slot reuse before commit")
    return [t4, t2], failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("PAGEDKV_CRASHPOINT"):
        print("unset PAGEDKV_CRASHPOINT first: it would kill this process", file=sys.stderr)
        return 2
    if args.seed is None:
        seed = get_seed("crashtest")
    else:
        seed = args.seed
        print(f"PAGEDKV_SEED={seed} (crashtest)", flush=True)
    workdirs = []
    for power_loss in (False, True):
        base = args.dir or scratch_root(power_loss)
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        workdirs.append(Path(tempfile.mkdtemp(prefix="pagedkv-crashtest-", dir=base)))
    kill_work, power_work = workdirs
    artifacts = args.artifacts or kill_work / "artifacts"
    print(f"stores under {kill_work} (SIGKILL loops) and {power_work} (power loss)", flush=True)
    rows, failures = [], []
    try:
        for mode in args.modes:
            started = time.monotonic()
            results, failed = run_mode(mode, args, seed, kill_work, power_work, artifacts)
            failures += [f"{mode}: {reason}" for reason in failed]
            for result in results:
                print(result.summary(), flush=True)
                rows.append((result, time.monotonic() - started))
    finally:
        keep = failures or any(r.artifacts for r, _ in rows if "mutation" not in r.name)
        if not keep:
            for work in workdirs:
                shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'loop':<28}{'cycles':>8}{'time s':>9}{'cyc/s':>8}{'violating':>10}  figures")
    for result, _ in rows:
        figures = " ".join(f"{k}={result.figures[k]}" for k in KEY_FIGURES if k in result.figures)
        rate = result.cycles / max(result.elapsed_s, 1e-9)
        print(f"{result.name:<28}{result.cycles:>8}{result.elapsed_s:>9.1f}{rate:>8.0f}"
              f"{result.violation_cycles:>10}  {figures}")
    print(f"seed {seed}: " + ("FAILED: " + "; ".join(failures) if failures else "all loops clean"))
    if failures:
        print(f"stores and artifacts kept under {artifacts}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
