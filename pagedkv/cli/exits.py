"""Exit codes, and the click group that turns every failure of a command into one.

A failure is one escaped ``Error: ...`` line on stderr, and with ``--json`` also
an error object on stdout; the table of codes is ``EXIT_CODES_HELP``, the epilog
of every command's help.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, NoReturn

import click

from . import text as clitext
from ..demo.kvgen import DemoFailed
from ..errors import PagedKVError, SequenceNotFound, StoreLocked
from ..inspection import report as inspector

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE, EXIT_LOCKED, EXIT_NOT_STORE = 0, 1, 2, 3, 4
EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PIPE = 70, 130, 141
JSON_SCHEMA = 1  # bumped when a key of any --json output changes meaning or goes away

# click 8.2+ raises this for a group run without a command (8.1 printed the help itself).
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())

EXIT_CODES_HELP = """\b
Exit codes:
  0    ok
  1    damage found (verify: a damaged page, record or metadata, or a store
       too damaged to open)
  2    usage error: a bad option or argument, or an id that names nothing
  3    locked: a writer holds the store, or beside a live writer no
       consistent snapshot could be taken (try again)
  4    not a pagedkv store, or it cannot be opened or operated on (an I/O
       error, a full disk, a newer format)
  70   internal error (a bug in pagedkv)
  130  interrupted (Ctrl-C)
With --json, an error is also printed on stdout as
{"schema": 1, "error": {"kind", "message", "exit_code"}}.
"""


class _BrokenPipe(Exception):
    """stdout's reader went away while a command wrote to it."""


class CommandFailed(Exception):
    """A failure with its exit code decided by the command that saw it."""

    def __init__(self, kind: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.kind, self.message, self.exit_code = kind, message, exit_code


def _wants_json(args: list[str]) -> bool:
    """Whether ``--json`` is among the options (before a ``--`` that ends them)."""
    options = args[:args.index("--")] if "--" in args else args
    return "--json" in options


def fail(kind: str, message: str, code: int, as_json: bool) -> NoReturn:
    """Exit ``code`` after one escaped ``Error: message`` line on stderr (and an error object on stdout)."""
    line = clitext.one_line(message)
    if as_json:
        echo_out(clitext.to_json({"schema": JSON_SCHEMA,
                                  "error": {"kind": kind, "message": message, "exit_code": code}}))
    click.echo(f"Error: {line}", err=True)
    sys.exit(code)


def echo_out(text: str) -> None:
    """Print ``text`` on stdout, the characters its encoding cannot hold escaped."""
    click.echo(clitext.fit_encoding(text, getattr(sys.stdout, "encoding", None)))


def classify(exc: BaseException) -> tuple[str, str, int]:
    """(kind, message, exit code) of an error a command raised."""
    if isinstance(exc, CommandFailed):
        return exc.kind, exc.message, exc.exit_code
    kind = type(exc).__name__
    message = str(exc) or kind
    if isinstance(exc, StoreLocked):
        return kind, message, EXIT_LOCKED
    if isinstance(exc, SequenceNotFound | inspector.PageNotFound):
        return kind, message, EXIT_USAGE  # an argument that names nothing in the store
    if isinstance(exc, DemoFailed):
        return kind, message, EXIT_DAMAGE
    if isinstance(exc, PagedKVError):
        return kind, message, EXIT_NOT_STORE
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return kind, f"{where}{exc.strerror or exc}", EXIT_NOT_STORE
    return "InternalError", f"unexpected {kind}: {exc}", EXIT_INTERNAL


class PagedKVGroup(click.Group):
    """A group whose every failure, usage errors included, is one escaped line on stderr.

    With ``--json`` anywhere among the options the failure is also an error object
    on stdout, so a script parsing stdout always gets JSON.
    """

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        as_json = _wants_json(argv)
        try:
            code = super().main(argv, prog_name, complete_var, False, **extra)
            sys.stdout.flush()  # here, so that a reader gone away (``| head``) is seen below
        except _NO_ARGS_IS_HELP as exc:  # bare ``pagedkv``: help, as --help does
            click.echo(exc.ctx.get_help() if exc.ctx else self.get_help(click.Context(self)))
            sys.exit(EXIT_OK)
        except click.UsageError as exc:
            hint = f"see '{exc.ctx.command_path} --help'" if exc.ctx else ""
            if isinstance(exc, click.NoSuchOption):
                hint += "; put '--' before a path that starts with '-'"
            fail("UsageError", exc.format_message().rstrip(".") + (f" ({hint})" if hint else ""),
                  EXIT_USAGE, as_json)
        except click.FileError as exc:
            fail("FileError", exc.format_message(), EXIT_NOT_STORE, as_json)
        except click.ClickException as exc:
            fail("UsageError", exc.format_message(), EXIT_USAGE, as_json)
        except (click.Abort, KeyboardInterrupt):
            fail("Interrupted", "interrupted", EXIT_INTERRUPTED, as_json)
        except Exception as exc:  # noqa: BLE001 - the one place that turns errors into exit codes
            self._report(exc, as_json)
        sys.exit(code if isinstance(code, int) else EXIT_OK)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a broken pipe leaves here as ``_BrokenPipe`` (click would make it exit 1)."""
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise _BrokenPipe() from exc
            raise

    @staticmethod
    def _report(exc: Exception, as_json: bool) -> NoReturn:
        if os.environ.get("PAGEDKV_DEBUG"):
            raise exc
        if isinstance(exc, _BrokenPipe) or isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            # The reader went away (``| head``): say nothing, as a tool killed by SIGPIPE
            # would, and point stdout at /dev/null so the interpreter's last flush is quiet.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, AttributeError, ValueError):
                pass  # not a real stream (a test runner's): nothing will flush to a pipe
            sys.exit(EXIT_PIPE)
        fail(*classify(exc), as_json=as_json)
