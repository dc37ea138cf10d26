"""One child-process harness: fork a child, talk to it over pipes, collect its result, kill it.

* ``Channel``: length-prefixed pickled messages over a pair of pipe fds. A message the
  writer was killed in the middle of is never returned; every wait has a deadline.
* ``Child(fn, *args)``: a forked child running ``fn(channel, *args)``. It never returns
  into the caller (it leaves with ``os._exit``, so nothing of pytest runs twice); an
  exception it raises comes back as a ``("crashed", description, traceback)`` message.
  The parent sends, receives, collects messages until the child ends or is SIGKILLed
  (``collect``), and reaps it (``wait``, on a pidfd: no polling).
* ``in_child(fn, ...)`` / ``in_children(fn, items)``: crash-prone work in forked children;
  each call gives its value, its exception, its signal or its timeout, never a hang.
* ``run_until_killed(body)``: the child runs ``body(ack)``, then waits to be SIGKILLed.
* ``run_python(code, *args)``: a script in a fresh interpreter (another process that
  imports pagedkv itself), its output captured.

Synchronisation is by messages, end of file and pidfds, never by sleeping.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

_LENGTH = struct.Struct("<I")


def describe(exc: BaseException) -> str:
    """``module.Type: message`` of an exception, for outcome tables and failure messages."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


class Channel:
    """Length-prefixed pickled messages over a pair of pipe fds (either may be -1: one-way)."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.buffer = bytearray()
        self.at_eof = False

    def send(self, message: Any) -> None:
        """Write one message (blocks while the pipe is full)."""
        data = pickle.dumps(message)
        view = memoryview(_LENGTH.pack(len(data)) + data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def fill(self) -> bool:
        """Read what the pipe holds now into the buffer (one read); False at end of file."""
        chunk = os.read(self.read_fd, 1 << 16)
        if not chunk:
            self.at_eof = True
        self.buffer += chunk
        return bool(chunk)

    def take(self) -> tuple[bool, Any]:
        """``(True, message)`` for a complete message in the buffer, else ``(False, None)``."""
        if len(self.buffer) < _LENGTH.size:
            return False, None
        (size,) = _LENGTH.unpack_from(self.buffer)
        if len(self.buffer) < _LENGTH.size + size:
            return False, None
        message = pickle.loads(bytes(self.buffer[_LENGTH.size:_LENGTH.size + size]))
        del self.buffer[:_LENGTH.size + size]
        return True, message

    def recv(self, timeout: float | None = 30.0) -> Any:
        """The next message. TimeoutError after ``timeout`` seconds (None: wait for ever),
        EOFError when the other end closed (a torn last message is dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready, message = self.take()
            if ready:
                return message
            if self.at_eof:
                raise EOFError("the peer closed its end")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no message within {timeout} s ({len(self.buffer)} bytes pending)")
            if select.select([self.read_fd], [], [], left)[0]:
                self.fill()

    def close(self) -> None:
        """Close both fds (either may be closed already)."""
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.read_fd = self.write_fd = -1


class Child:
    """A forked child running ``fn(channel, *args)``; the parent talks to it through ``self``.

    ``own_group`` puts the child in its own process group, so that a kill ends whatever it
    forked too; ``output`` sends its stdout and stderr to that file.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any, own_group: bool = False,
                 output: str | None = None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        self.own_group = own_group
        self.started = time.monotonic()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child, never returns
            code = 0
            try:
                faulthandler.disable()  # a crash here is the parent's finding, not a traceback dump
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.close(down_w)
                os.close(up_r)
                if own_group:
                    os.setpgid(0, 0)
                if output is not None:
                    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                chan = Channel(down_r, up_w)
                try:
                    fn(chan, *args)
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    code = 71
                    try:
                        chan.send(("crashed", describe(exc), traceback.format_exc()))
                    except BaseException:  # noqa: BLE001 - the pipe is gone: the exit code says it
                        pass
            finally:
                os._exit(code)
        os.close(down_r)
        os.close(up_w)
        if own_group:
            try:
                os.setpgid(self.pid, self.pid)
            except OSError:
                pass  # it did so itself already, or has exited
        self.pidfd = os.pidfd_open(self.pid)
        self.chan = Channel(up_r, down_w)
        self.status: int | None = None
        self.killed = False  # SIGKILLed by this side

    def send(self, message: Any) -> None:
        """A message to the child."""
        self.chan.send(message)

    def recv(self, timeout: float | None = 30.0) -> Any:
        """The child's next message (see ``Channel.recv``)."""
        return self.chan.recv(timeout)

    def collect(self, kill_after_s: float | None = None, kill_after: int | None = None,
                extra_s: float = 0.0, safety_s: float = 60.0) -> list[Any]:
        """Every message until the child's end of the pipe closes.

        The child is SIGKILLed ``kill_after_s`` seconds after the fork, or ``extra_s`` after
        its ``kill_after``-th message, and in any case ``safety_s`` after the fork.
        """
        messages: list[Any] = []
        deadline = self.started + (kill_after_s if kill_after_s is not None else safety_s)
        while True:
            now = time.monotonic()
            if not self.killed and now >= deadline:
                self.kill(reap=False)
            try:
                message = self.chan.recv(None if self.killed else deadline - now)
            except TimeoutError:
                continue
            except EOFError:
                return messages
            messages.append(message)
            if kill_after is not None and not self.killed and len(messages) == kill_after:
                deadline = min(deadline, time.monotonic() + extra_s)

    def kill(self, reap: bool = True) -> None:
        """SIGKILL the child (its whole group with ``own_group``); reap it unless told not to."""
        if self.status is None:
            self._signal(signal.SIGKILL)
            self.killed = True
            if reap:
                self.wait()

    def _signal(self, signum: int) -> None:
        try:
            if self.own_group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # a group with no member left (or a reaped pid): nothing to end

    def wait(self, timeout: float = 30.0) -> int:
        """Reap the child (SIGKILL after ``timeout`` seconds); its wait status."""
        if self.status is None:
            if not select.select([self.pidfd], [], [], timeout)[0]:
                self.kill(reap=False)
            _, self.status = os.waitpid(self.pid, 0)
            if self.own_group and self.killed:
                self._signal(signal.SIGKILL)  # anything it forked and left behind shares its group
            os.close(self.pidfd)
            self.chan.close()
        return self.status

    @property
    def signalled(self) -> int | None:
        """The signal that ended the child, if one did (after ``wait``)."""
        status = self.status
        return os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None

    @property
    def exit_code(self) -> int | None:
        """The child's exit code, if it exited (after ``wait``)."""
        status = self.status
        return os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.status is None:
            self.kill()


# -- a call in a child ---------------------------------------------------------------------


@dataclass
class ChildResult:
    """What became of a forked call: its returned value, an exception, a signal or a timeout."""

    status: str  # "ok" | "raised" | "signal" | "exit" | "timeout"
    value: Any = None
    signal: int | None = None
    exitcode: int | None = None
    elapsed: float = 0.0

    def __str__(self) -> str:
        if self.status == "signal":
            return f"killed by {signal.Signals(self.signal).name}"
        if self.status == "exit":
            return f"exited {self.exitcode} without a result"
        if self.status == "timeout":
            return f"hung for more than {self.elapsed:.1f} s"
        return f"{self.status}: {self.value!r}"


def _call(chan: Channel, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        payload = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        payload = ("raised", describe(exc) + "\n" + traceback.format_exc())
    chan.send(payload)


def _ended(child: Child, began: float) -> ChildResult:
    """How a child that sent no result ended."""
    child.wait()
    if child.signalled is not None:
        return ChildResult("signal", signal=child.signalled, elapsed=time.monotonic() - began)
    return ChildResult("exit", exitcode=child.exit_code, elapsed=time.monotonic() - began)


def _result(message: Any, child: Child, began: float) -> ChildResult:
    """The result a child's message reports (a crash of the harness itself reads as raised)."""
    child.wait()
    elapsed = time.monotonic() - began
    if child.signalled is not None:
        return ChildResult("signal", signal=child.signalled, elapsed=elapsed)
    if message[0] == "crashed":
        return ChildResult("raised", f"{message[1]}\n{message[2]}", exitcode=child.exit_code, elapsed=elapsed)
    return ChildResult(message[0], message[1], exitcode=child.exit_code, elapsed=elapsed)


def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 30.0, **kwargs: Any) -> ChildResult:
    """Run ``fn(*args, **kwargs)`` in a forked child; its value, exception, signal or timeout.

    A child still running after ``timeout`` seconds is SIGKILLed.
    """
    began = time.monotonic()
    child = Child(_call, fn, args, kwargs)
    try:
        message = child.recv(timeout)
    except TimeoutError:
        child.kill()
        return ChildResult("timeout", elapsed=time.monotonic() - began)
    except EOFError:
        return _ended(child, began)
    return _result(message, child, began)


def in_children(fn: Callable[..., Any], items: list[Any], timeout: float = 5.0) -> list[ChildResult]:
    """``fn(item)`` for every item, in forked children, one child for many items.

    A child runs items in order and reports each result; when it dies (a signal) or
    hangs (no result within ``timeout`` seconds of starting an item), that item gets
    the signal or the timeout, and a fresh child resumes with the next item. An item
    that crashed a child is run again alone, so a crash is never blamed on the item
    that merely came after damage done by an earlier one: ``value`` of such an item
    says whether the crash reproduced alone.
    """
    results: list[ChildResult | None] = [None] * len(items)
    start = 0
    while start < len(items):
        child = Child(_serve_items, fn, items, start)
        index = start
        try:
            while index < len(items):
                began = time.monotonic()
                try:
                    kind, at, value = child.recv(timeout=timeout)
                except TimeoutError:
                    child.kill()
                    results[index] = ChildResult("timeout", elapsed=time.monotonic() - began)
                    break
                except EOFError:
                    results[index] = _ended(child, began)
                    break
                assert at == index, (at, index)
                results[index] = ChildResult(kind, value, elapsed=time.monotonic() - began)
                index += 1
        finally:
            if index >= len(items):
                child.send(None)
                child.wait()
            else:
                child.kill()
        crashed = results[index] if index < len(items) else None
        if crashed is not None and crashed.status in ("signal", "exit"):
            alone = in_child(fn, items[index], timeout=timeout)
            if alone.status not in ("signal", "exit"):
                crashed.value = f"did not reproduce alone: {alone}"
        start = index + 1
    return [r for r in results if r is not None]


def _serve_items(chan: Channel, fn: Callable[..., Any], items: list[Any], start: int) -> None:
    for index in range(start, len(items)):
        try:
            chan.send(("ok", index, fn(items[index])))
        except BaseException as exc:  # noqa: BLE001
            chan.send(("raised", index, describe(exc)))
    chan.recv(timeout=60)  # wait for the parent's goodbye so the last message is read


# -- a child that is killed once it is ready ---------------------------------------------------


def _ack_then_hold(chan: Channel, body: Callable[[Callable[[str], None]], None]) -> None:
    body(lambda text: chan.send(("ack", text)))
    chan.send(("ready", ""))
    chan.recv(timeout=None)  # blocks: the parent SIGKILLs this process


def run_until_killed(body: Callable[[Callable[[str], None]], None], timeout: float = 120.0) -> list[str]:
    """Fork; the child runs ``body(ack)`` then waits until the parent SIGKILLs it.

    ``ack(text)`` sends one line to the parent; the acks are returned. Any exception in
    the child fails the test with the child's traceback.
    """
    acks: list[str] = []
    with Child(_ack_then_hold, body) as child:
        while True:
            try:
                message = child.recv(timeout)
            except EOFError:
                child.wait()
                raise AssertionError(f"the child died before it was ready: {acks}, status {child.status}") from None
            if message[0] == "crashed":
                raise AssertionError(f"the child raised {message[1]}\n{message[2]}")
            if message[0] == "ready":
                break
            acks.append(message[1])
        child.kill()
        assert child.signalled == signal.SIGKILL, child.status
    return acks


# -- a script in a fresh interpreter -----------------------------------------------------------


def run_python(code: str, *args: str, timeout: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` with its output captured as text (``kwargs``: env, cwd...)."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
