"""Helpers of the fault-injection, corruption and hygiene tests (T5-T13, T15).

* ``in_child(fn, ...)``: run crash-prone work in a forked child and get back its
  result, its signal or its timeout (never a hang of the test process).
* ``Peer``: a forked child that talks with the parent over pipes, for locking and
  stale-reader tests (synchronisation by messages, never by sleeps).
* ``Injector``: the I/O fault seam of ``pagedkv.faults`` as a counter that fails op k
  once or forever.
* file pokes (``flip_bit``, ``poke``, ``store_bytes``), the raw LMDB spill env
  (``spill_env``), the pool header codec, and /proc counters for hygiene tests.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lmdb
import pytest
import xxhash

import pagedkv
from pagedkv import faults

POOL, SPILL, LOCK = "pool.bin", "spill", "LOCK"
DATA_MDB, LOCK_MDB = os.path.join(SPILL, "data.mdb"), os.path.join(SPILL, "lock.mdb")
TYPED_IO = (pagedkv.StoreIOError, pagedkv.StoreFull)


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, for outcome tables and failure messages."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


# -- child processes ------------------------------------------------------------------


@dataclass
class ChildResult:
    """What became of a forked child: its returned value, an exception, a signal or a timeout."""

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


def _read_until(fd: int, deadline: float) -> tuple[bytes, bool]:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 30.0, **kwargs: Any) -> ChildResult:
    """Run ``fn(*args, **kwargs)`` in a forked child; return its value, signal or timeout.

    The child leaves with ``os._exit`` so that nothing of the parent (pytest, open
    files) runs twice. A child still running after ``timeout`` seconds is SIGKILLed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            faulthandler.disable()  # a crash here is the parent's finding, not a traceback dump
            os.close(read_fd)
            try:
                payload = ("ok", fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                payload = ("raised", describe(exc) + "\n" + traceback.format_exc())
            data = pickle.dumps(payload)
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view):]
        except BaseException:  # noqa: BLE001
            code = 70
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        data, finished = _read_until(read_fd, started + timeout)
    finally:
        os.close(read_fd)
    elapsed = time.monotonic() - started
    if not finished:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return ChildResult("timeout", elapsed=elapsed)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return ChildResult("signal", signal=os.WTERMSIG(status), elapsed=elapsed)
    if not data:
        return ChildResult("exit", exitcode=os.WEXITSTATUS(status), elapsed=elapsed)
    kind, value = pickle.loads(data)
    return ChildResult(kind, value, exitcode=os.WEXITSTATUS(status), elapsed=elapsed)


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
        peer = Peer(_serve_items, fn, items, start)
        index = start
        try:
            while index < len(items):
                began = time.monotonic()
                try:
                    kind, at, value = peer.recv(timeout=timeout)
                except (TimeoutError, EOFError) as exc:
                    hung = isinstance(exc, TimeoutError)
                    if hung:
                        peer.kill()
                    status = peer.wait()
                    if hung:
                        results[index] = ChildResult("timeout", elapsed=time.monotonic() - began)
                    elif os.WIFSIGNALED(status):
                        results[index] = ChildResult("signal", signal=os.WTERMSIG(status))
                    else:
                        results[index] = ChildResult("exit", exitcode=os.WEXITSTATUS(status))
                    break
                assert at == index, (at, index)
                results[index] = ChildResult(kind, value, elapsed=time.monotonic() - began)
                index += 1
        finally:
            if index >= len(items):
                peer.send(None)
                peer.wait()
            else:
                peer.kill()
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


class Channel:
    """Length-prefixed pickled messages over a pair of pipe fds."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd

    def send(self, message: Any) -> None:
        data = pickle.dumps(message)
        view = memoryview(struct.pack("<I", len(data)) + data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def recv(self, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        head = self._exactly(4, deadline)
        return pickle.loads(self._exactly(struct.unpack("<I", head)[0], deadline))

    def _exactly(self, count: int, deadline: float) -> bytes:
        buf = b""
        while len(buf) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message within the timeout ({len(buf)}/{count} bytes)")
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if ready:
                chunk = os.read(self.read_fd, count - len(buf))
                if not chunk:
                    raise EOFError("the peer closed its end")
                buf += chunk
        return buf

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class Peer:
    """A forked child running ``fn(channel, *args)``; the parent talks to it through ``self``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                faulthandler.disable()
                os.close(down_w)
                os.close(up_r)
                chan = Channel(down_r, up_w)
                try:
                    fn(chan, *args)
                except BaseException as exc:  # noqa: BLE001
                    try:
                        chan.send(("crashed", describe(exc), traceback.format_exc()))
                    except BaseException:  # noqa: BLE001
                        pass
                    code = 71
            finally:
                os._exit(code)
        os.close(down_r)
        os.close(up_w)
        self.chan = Channel(up_r, down_w)
        self.status: int | None = None

    def send(self, message: Any) -> None:
        self.chan.send(message)

    def recv(self, timeout: float = 30.0) -> Any:
        return self.chan.recv(timeout)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def wait(self, timeout: float = 30.0) -> int:
        """Reap the child (SIGKILL after ``timeout``); return its wait status."""
        if self.status is None:
            deadline = time.monotonic() + timeout
            while True:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.status = status
                    break
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    _, self.status = os.waitpid(self.pid, 0)
                    break
                select.select([self.chan.read_fd], [], [], 0.05)  # wake on its exit (EOF)
            self.chan.close()
        return self.status

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.status is None:
            self.kill()


# -- injected I/O faults ---------------------------------------------------------------


class Injector:
    """Counts ``faults.io`` ops; fails op ``fail_at`` once, or it and every later op."""

    def __init__(self, fail_at: int | None = None, forever: bool = False, code: int = errno.EIO) -> None:
        self.fail_at = fail_at
        self.forever = forever
        self.code = code
        self.count = 0
        self.names: list[str] = []
        self.fired: tuple[int, str] | None = None

    def __call__(self, op: str) -> None:
        self.count += 1
        self.names.append(op)
        if self.fail_at is None or self.count < self.fail_at:
            return
        if self.count == self.fail_at or self.forever:
            if self.fired is None:
                self.fired = (self.count, op)
            raise OSError(self.code, f"injected {os.strerror(self.code)} at op {self.count} ({op})")

    def __enter__(self) -> Injector:
        faults.set_injector(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        faults.set_injector(None)


# -- files ------------------------------------------------------------------------------


def copy_store(src: str | Path, dst: str | Path) -> Path:
    """Copy a closed store directory (modes kept, symlinks not followed)."""
    shutil.copytree(src, dst, symlinks=True)
    return Path(dst)


def store_bytes(path: str | Path, names: tuple[str, ...] = (POOL, DATA_MDB)) -> dict[str, bytes | None]:
    """The bytes of a store's data files (not LOCK or lock.mdb, which every open rewrites)."""
    out: dict[str, bytes | None] = {}
    for name in names:
        full = os.path.join(path, name)
        out[name] = Path(full).read_bytes() if os.path.isfile(full) else None
    return out


def flip_bit(path: str | Path, offset: int, bit: int) -> None:
    """Flip one bit of a file in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def poke(path: str | Path, offset: int, data: bytes) -> bytes:
    """Overwrite bytes of a file in place; return what was there."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(len(data))
        fh.seek(offset)
        fh.write(data)
    return old


def resize(path: str | Path, size: int) -> None:
    """Truncate or extend (with zeros) a file to ``size`` bytes."""
    os.truncate(path, size)


# -- the pool.bin header (format 1), rebuilt here so tests can forge valid checksums -----

HEADER_NBYTES = 4096
HEADER = struct.Struct("<8sI16sIIII16sQQ")
HEADER_FIELDS = ("magic", "version", "uuid", "layers", "kv_heads", "head_dim", "page_size", "dtype",
                 "pool_pages", "page_nbytes")


def read_header(path: str | Path) -> dict[str, Any]:
    raw = Path(path, POOL).read_bytes()[:HEADER_NBYTES]
    return dict(zip(HEADER_FIELDS, HEADER.unpack_from(raw, 0)))


def write_header(path: str | Path, fields: dict[str, Any]) -> None:
    """Write the header page with ``fields`` and a correct xxh3-64 checksum."""
    body = HEADER.pack(*(fields[name] for name in HEADER_FIELDS)).ljust(HEADER_NBYTES - 8, b"\x00")
    poke(Path(path, POOL), 0, body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


# -- the raw LMDB spill environment (only while the store is closed) -----------------------


def spill_env(path: str | Path, **kwargs: Any) -> lmdb.Environment:
    """Open a store's spill environment directly (the store must be closed in this process)."""
    options = dict(subdir=True, max_dbs=5, sync=False, metasync=False, create=False, max_readers=126)
    options.update(kwargs)
    return lmdb.open(os.path.join(path, SPILL), **options)


def spill_dbs(env: lmdb.Environment) -> dict[str, Any]:
    return {name: env.open_db(name.encode(), create=False)
            for name in ("meta", "seqs", "dir", "pages", "tokens")}


# -- /proc counters -----------------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def maps_count(under: str | os.PathLike | None = None) -> int:
    """Mappings of this process; with ``under``, only those of files below that directory."""
    with open("/proc/self/maps", "rb") as fh:
        if under is None:
            return sum(1 for _ in fh)
        prefix = os.fsencode(os.path.realpath(under)) + b"/"
        return sum(1 for line in fh if line.rstrip(b"\n").split(b" ")[-1].startswith(prefix))


def proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def soak() -> bool:
    return os.environ.get("PAGEDKV_SOAK", "") not in ("", "0")


@dataclass
class Tally:
    """Outcome counts plus the first few examples of each outcome."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, outcome: str, example: str = "") -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if example and len(self.examples.setdefault(outcome, [])) < 5:
            self.examples[outcome].append(example)

    def __str__(self) -> str:
        lines = [f"{name}: {count}" for name, count in sorted(self.counts.items())]
        for name, examples in sorted(self.examples.items()):
            lines += [f"  e.g. [{name}] {text}" for text in examples]
        return "\n".join(lines)


def _tmpfs_base() -> str | None:
    base = "/dev/shm"
    try:
        with open("/proc/self/mounts") as fh:
            mounts = {line.split()[1]: line.split()[2] for line in fh if len(line.split()) > 2}
    except OSError:
        return None
    if mounts.get(base) == "tmpfs" and os.access(base, os.W_OK):
        return base
    return None


@pytest.fixture
def fast_tmp(tmp_path: Path):
    """A scratch directory on tmpfs when there is one (fsync is free there), else ``tmp_path``.

    For loops that create hundreds of stores: the fault semantics under test do not depend
    on the filesystem, only their cost does.
    """
    base = _tmpfs_base()
    if base is None:
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="pagedkv-test-", dir=base)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def scales() -> list[Any]:
    """``ci`` and ``soak`` parameters for a scalable test: the soak variant is marked ``soak``
    and runs only with ``PAGEDKV_SOAK=1`` (``PAGEDKV_SOAK=1 pytest -m soak``), without a timeout."""
    return [
        pytest.param("ci", id="ci"),
        pytest.param("soak", id="soak", marks=[
            pytest.mark.soak, pytest.mark.timeout(0),
            pytest.mark.skipif(not soak(), reason="soak size: PAGEDKV_SOAK=1 pytest -m soak")]),
    ]
