"""Real Redis servers for the remote-tier tests: one server, a replica, a 3-node cluster.

Each server is a ``redis-server`` process on a free loopback port with its own
temporary directory, no persistence and a unix socket beside the TCP port. A
server is ready when its log says so (read from its stdout: waiting on the
process, not on a clock) and it answers ``PING``. Everything started here is
torn down by ``stop()`` (the fixtures call it).

Without ``redis-server`` on the PATH the tests skip with a clear reason, unless
``CI`` is set: there a missing server is a failure (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

READY_LINE = b"Ready to accept connections"
CLUSTER_OK = b"cluster_state:ok"
START_TIMEOUT = 20.0  # seconds for a server to log that it is ready


def redis_binaries() -> tuple[str, str] | None:
    """Paths of ``redis-server`` and ``redis-cli``, or None when either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def require_redis() -> tuple[str, str]:
    """The binaries; skip the test without them (fail instead when ``CI`` is set)."""
    found = redis_binaries()
    if found is None:
        reason = "redis-server/redis-cli not installed (apt-get install -y redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the remote-tier tests")
        pytest.skip(reason)
    return found


def free_port(avoid: frozenset[int] = frozenset(), bus: bool = False) -> int:
    """A loopback TCP port free now (and ``port + 10000`` too for a cluster node's bus)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port in avoid or (bus and port + 10000 > 65535):
            continue
        if bus:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
        return port


class RedisServer:
    """One ``redis-server`` process; ``url`` and ``unix_url`` reach it."""

    def __init__(self, root: Path, name: str = "redis", args: tuple[str, ...] = (),
                 cluster: bool = False, password: str | None = None) -> None:
        self.server_bin, self.cli_bin = require_redis()
        self.password = password  # requirepass, and what cli() and client() authenticate with
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.cluster = cluster
        self.port = free_port(bus=cluster)
        self.socket_path = str(self.dir / "redis.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: list[bytes] = []
        self.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<dir>/redis.sock?db=0``."""
        return f"unix://{self.socket_path}?db=0"

    def command_line(self) -> list[str]:
        """The ``redis-server`` argv for this server."""
        argv = [self.server_bin, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--logfile", "", "--daemonize", "no",
                "--unixsocket", self.socket_path, "--unixsocketperm", "700",
                "--enable-debug-command", "local"]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-node-timeout", "2000"]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + list(self.args)

    def start(self) -> None:
        """Start the process (again, after ``kill``) and wait until it accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(self.command_line(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self._wait_ready()
        if self.cli("PING").strip() != "PONG":
            raise RuntimeError(f"redis-server on port {self.port} does not answer PING")

    def _wait_ready(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        pending = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise RuntimeError(f"redis-server did not get ready: {b''.join(self.log)[-2000:]!r}")
                if not sel.select(left):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"redis-server exited ({self.proc.wait()}): "
                                       f"{b''.join(self.log)[-2000:]!r}")
                self.log.append(chunk)
                pending += chunk
                if READY_LINE in pending:
                    break
                pending = pending[-len(READY_LINE):]
        # The log pipe must keep draining, or a chatty server would block on a full pipe.
        self._drain = _Drain(self.proc, self.log)

    def cli(self, *args: str, check: bool = True) -> str:
        """Run ``redis-cli -p <port> <args>`` and return its output."""
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        done = subprocess.run([self.cli_bin, "-h", "127.0.0.1", "-p", str(self.port), *auth, *args],
                              capture_output=True, timeout=30)
        if check and done.returncode:
            raise RuntimeError(f"redis-cli {args}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode(errors="replace")

    def client(self, **kwargs: Any) -> Any:
        """A plain redis-py client of this server (for the tests' own pokes)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kwargs)

    def kill(self) -> None:
        """SIGKILL the process and wait for it (its data is gone: no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """Terminate the process and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class _Drain:
    """Reads a server's log pipe in a daemon thread, so the server never blocks writing it."""

    def __init__(self, proc: subprocess.Popen[bytes], log: list[bytes]) -> None:
        import threading

        self.thread = threading.Thread(target=self._run, args=(proc, log), daemon=True)
        self.thread.start()

    @staticmethod
    def _run(proc: subprocess.Popen[bytes], log: list[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if len(log) < 10000:
                log.append(line)


class RedisCluster:
    """Three cluster-enabled masters on loopback, joined by ``redis-cli --cluster create``."""

    def __init__(self, root: Path, nodes: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for index in range(nodes):
                self.nodes.append(RedisServer(root, f"node{index}", cluster=True))
            cli = self.nodes[0].cli_bin
            addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
            done = subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                                   "--cluster-yes"], capture_output=True, timeout=60)
            if done.returncode:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]!r}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self) -> None:
        """Until every node reports ``cluster_state:ok`` (Redis has no event for it: polled)."""
        deadline = time.monotonic() + START_TIMEOUT
        for node in self.nodes:
            while CLUSTER_OK not in node.cli("CLUSTER", "INFO").encode():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {node.port} never reached cluster_state:ok")
                time.sleep(0.05)

    @property
    def url(self) -> str:
        """``redis+cluster://h1:p1,h2:p2,h3:p3``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def client(self) -> Any:
        """A redis-py cluster client (for the tests' own pokes)."""
        from redis.cluster import ClusterNode, RedisCluster as Client

        return Client(startup_nodes=[ClusterNode("127.0.0.1", node.port) for node in self.nodes])

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()


def replica_of(root: Path, master: RedisServer, name: str = "replica") -> RedisServer:
    """A read-only replica of ``master``, synced (its writes answer ``READONLY``)."""
    replica = RedisServer(root, name, args=("--replicaof", "127.0.0.1", str(master.port),
                                            "--replica-read-only", "yes"))
    deadline = time.monotonic() + START_TIMEOUT
    while "master_link_status:up" not in replica.cli("INFO", "replication"):
        if time.monotonic() > deadline:
            replica.stop()
            raise RuntimeError("the replica never linked to its master")
        time.sleep(0.05)
    return replica


# -- pytest fixtures (import them into a test module) -------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One redis-server for a test module; emptied before each test by ``redis_clean``."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_clean(redis_server: RedisServer) -> RedisServer:
    """The module's server, restarted if a test killed it, emptied and reset."""
    redis_server.start()
    redis_server.cli("CONFIG", "SET", "maxmemory", "0")
    redis_server.cli("FLUSHALL")
    return redis_server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 3-node Redis Cluster on loopback for a test module."""
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()
