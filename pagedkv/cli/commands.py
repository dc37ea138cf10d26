"""The ``pagedkv`` command line: a thin click shell over demo, inspector, compact and the store.

Exit codes (the same table is in the README and in every command's help):
0 ok; 1 damage found (``verify``); 2 usage error; 3 locked (or no consistent
snapshot beside a live writer); 4 not a store, or it cannot be opened or
operated on; 70 an internal error (a bug); 130 interrupted (Ctrl-C); 141 the
reader of stdout went away. Every error is one ``Error: ...`` line on stderr,
and with ``--json`` also an error object on stdout (set ``PAGEDKV_DEBUG=1`` to
see the traceback instead).

The group is assembled here, the console entry point: ``storecommands`` holds
inspect, verify, stats, gc and compact, ``runcommands`` demo and bench. Exit
codes and the handling of failures are in ``exits``, what the commands share in
``options``, and what they print in ``text``, ``storetext`` and ``demotext``.
"""

from __future__ import annotations

import click

from .. import __version__
from .exits import EXIT_CODES_HELP, PagedKVGroup
from .runcommands import bench, demo
from .storecommands import compact, gc, inspect, stats, verify


@click.group(cls=PagedKVGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_CODES_HELP)
@click.version_option(version=__version__, prog_name="pagedkv")
def cli() -> None:
    """pagedkv: a persistent, paged KV-cache store for LLM inference.

    \b
    Example:
        pagedkv demo                 # run a serving workload into ./demo.kv
        pagedkv inspect demo.kv      # look inside it (read-only)
        pagedkv verify demo.kv       # check every page checksum
        pagedkv stats demo.kv        # counters and occupancy
        pagedkv gc demo.kv           # drop cached prefix pages
        pagedkv compact demo.kv      # give LMDB's free pages back to the disk
        pagedkv bench --quick        # the benchmark suite, small
    """


for _each in (demo, inspect, verify, gc, stats, compact, bench):
    cli.add_command(_each)
