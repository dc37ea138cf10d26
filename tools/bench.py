"""Run the pagedkv benchmark suite (B1-B8 of docs/performance.md) and print a table or JSON.

Usage, from the repository root::

    python tools/bench.py                 # the full suite (several minutes)
    python tools/bench.py --quick         # small sizes, as CI runs it
    python tools/bench.py --scenario B4 --scenario B7 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Runnable from a checkout without installing: the package sits next to tools/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedkv.bench.suite import SCENARIOS, format_table, run  # noqa: E402
from pagedkv.errors import PagedKVError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the scenarios, print the result; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (what CI runs)")
    parser.add_argument("--scenario", action="append", metavar="ID", type=str.upper,
                        choices=list(SCENARIOS), help="run only this scenario (repeatable): "
                        + ", ".join(SCENARIOS))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--workdir", default=None, help="where the temporary stores go (default: temp dir)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    try:
        rows = run(args.scenario, quick=args.quick, seed=args.seed, workdir=args.workdir,
                   progress=None if args.quiet else progress)
    except PagedKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
