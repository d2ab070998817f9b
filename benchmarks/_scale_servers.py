"""Servers under test for ``rdzv_scale.py``, each with its traffic counters.

* :class:`RedisUnderTest`: a real ``redis-server`` (``tests/_redis_server.py``) on a free
  loopback port, with room for thousands of clients. Counters from ``INFO stats``
  (``total_commands_processed``, ``total_net_output_bytes``, ``total_connections_received``),
  read over a raw socket so that the benchmark's own ``INFO`` calls (one command and the
  reply's exact bytes each) are subtracted.
* :class:`HttpUnderTest`: aelastic's HTTP server app in its own process with a counting
  middleware (``benchmarks/_counting_http_server.py``).
* :class:`EtcdUnderTest`: a real ``etcd`` (``tests/_etcd_server.py``); counters from its
  ``/metrics`` (plain HTTP, not counted itself): ``grpc_server_msg_received_total`` (every
  request message: each JSON request of the gateway is one, a watch's one too) and
  ``etcd_network_client_grpc_sent_bytes_total`` (the answers as protobuf: the JSON the
  gateway sends is larger, by about half again); connections are not counted (-1).
* :class:`TorchStoreUnderTest`: torch's ``TCPStore`` server behind a byte-counting TCP
  proxy, in one process (``benchmarks/_scale_torch.py host``).

``snapshot()`` gives cumulative :class:`Counters`; a phase's traffic is the difference of two.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = [
    "Counters",
    "EtcdUnderTest",
    "HttpUnderTest",
    "RedisUnderTest",
    "ServerUnderTest",
    "TorchStoreUnderTest",
    "cpu_seconds",
    "rss_bytes",
]

_TICK = 1.0 / os.sysconf("SC_CLK_TCK")
_START_TIMEOUT = 30.0
#: Seconds the HTTP server gets to answer the benchmark's counters.
_SNAPSHOT_TIMEOUT = 300.0


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS``), in bytes; -1 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return -1


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK


@dataclass(frozen=True)
class Counters:
    """Cumulative server-side counts (``commands`` is -1 where it cannot be counted)."""

    commands: int
    bytes_out: int
    connections: int
    cpu: float
    #: Redis: every command the server ran, those inside scripts included (``commands`` are
    #: the ones clients sent); -1 where it is not counted.
    operations: int = -1
    #: Redis: calls of aelastic's scripts (``EVALSHA``/``EVAL``) and the microseconds Redis
    #: spent in them (``INFO commandstats``); -1 where not counted.
    script_calls: int = -1
    script_usec: int = -1
    #: The server's memory (Redis: ``used_memory``; others: the process's RSS), in bytes. A
    #: level, not a count: a difference keeps the later value.
    memory: int = -1

    def __sub__(self, before: Counters) -> Counters:
        def delta(now: int, then: int) -> int:
            return -1 if now < 0 or then < 0 else now - then

        return Counters(
            delta(self.commands, before.commands),
            self.bytes_out - before.bytes_out,
            self.connections - before.connections,
            self.cpu - before.cpu,
            delta(self.operations, before.operations),
            delta(self.script_calls, before.script_calls),
            delta(self.script_usec, before.script_usec),
            self.memory,
        )


#: The loopback addresses a server under test listens on: each node process reaches it at
#: one of them (its index modulo their number). With every client on one address, 16,384
#: connections from 127.0.0.1 to one address and port nearly use up the kernel's ephemeral
#: ports for that destination (28,232 in the default range; those of timed-out attempts
#: linger in TIME_WAIT): each ``connect()`` then searches long in the kernel (measured: 69%
#: of both cores in system time, and connections timing out, at 16,384 Redis nodes). Real
#: nodes come from as many addresses as there are machines; ports are allocated per
#: destination, so 16 addresses give each one its own ports.
LOOPBACKS = tuple(f"127.0.0.{i}" for i in range(1, 17))


class ServerUnderTest(Protocol):
    endpoint: str
    #: The same server at each of its addresses (at least ``endpoint``).
    endpoints: list[str]
    pid: int

    def snapshot(self) -> Counters: ...

    def close(self) -> None: ...


def _ready_line(process: subprocess.Popen[str], prefix: str, what: str) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(prefix):
        process.kill()
        raise RuntimeError(f"{what} did not start: {line!r}")
    return line[len(prefix) :].strip()


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: Commands aelastic's clients send to Redis (every other one runs inside its scripts):
#: what a node asks of the server, one round trip each.
_CLIENT_COMMANDS = frozenset(
    {"evalsha", "eval", "script", "subscribe", "unsubscribe", "ping", "exists", "scan",
     "unlink", "client", "hello", "auth", "select"}
)  # fmt: skip


class RedisUnderTest:
    """A ``redis-server`` on loopback, its counters read with ``INFO stats``."""

    def __init__(self) -> None:
        from tests._redis_server import RedisServer

        self._server = RedisServer(
            extra_args=("--maxclients", "19000", "--tcp-backlog", "4096", "--bind", *LOOPBACKS)
        ).start()
        assert self._server.process is not None
        self.pid = self._server.process.pid
        self.endpoint = self._server.url
        port = self._server.port
        self.endpoints = [f"redis://{address}:{port}/0" for address in LOOPBACKS]
        self._sock = socket.create_connection(("127.0.0.1", self._server.port))
        self._reader = self._sock.makefile("rb")
        self._own_commands = 0
        self._own_bytes = 0

    def _info(self, section: bytes = b"stats") -> tuple[dict[str, str], int]:
        self._sock.sendall(b"*2\r\n$4\r\nINFO\r\n$%d\r\n%s\r\n" % (len(section), section))
        header = self._reader.readline()
        if not header.startswith(b"$"):
            raise RuntimeError(f"unexpected INFO reply: {header!r}")
        size = int(header[1:])
        body = self._reader.read(size + 2)
        fields = dict(line.split(":", 1) for line in body.decode().splitlines() if ":" in line)
        return fields, len(header) + size + 2

    def snapshot(self) -> Counters:
        """Counters so far, without the benchmark's own INFO calls.

        An INFO reply reports the counts before that INFO itself ran and was answered, so
        every earlier INFO (one command, its reply's bytes) is subtracted.
        """
        stats, stats_bytes = self._info(b"commandstats")
        self._own_commands += 1
        self._own_bytes += stats_bytes
        memory, memory_bytes = self._info(b"memory")
        self._own_commands += 1
        self._own_bytes += memory_bytes
        fields, reply_bytes = self._info()
        sent = calls = usec = 0
        for name, value in stats.items():
            command = name.removeprefix("cmdstat_").split("|")[0]
            counts = dict(part.split("=", 1) for part in value.split(","))
            if command in _CLIENT_COMMANDS:
                sent += int(counts["calls"])
            if command in ("evalsha", "eval"):
                calls += int(counts["calls"])
                usec += int(counts["usec"])
        counters = Counters(
            sent,
            int(fields["total_net_output_bytes"]) - self._own_bytes,
            int(fields["total_connections_received"]) - 1,  # this socket
            cpu_seconds(self.pid),
            int(fields["total_commands_processed"]) - self._own_commands,
            calls,
            usec,
            int(memory["used_memory"]),
        )
        self._own_commands += 1
        self._own_bytes += reply_bytes
        return counters

    def close(self) -> None:
        self._reader.close()
        self._sock.close()
        self._server.close()


class HttpUnderTest:
    """aelastic's HTTP server (with counters) in its own process."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", "benchmarks._counting_http_server", "--port", "0"]
        self._process = subprocess.Popen(
            [*command, "--also", *LOOPBACKS[1:]],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self._process.pid
        self.endpoint = _ready_line(self._process, "listening on ", "the HTTP server")
        port = self.endpoint.rsplit(":", 1)[1]
        self.endpoints = [f"http://{address}:{port}" for address in LOOPBACKS]

    def snapshot(self) -> Counters:
        url = f"{self.endpoint}/_bench/stats"
        # (A server busy with thousands of channels may take long to answer it.)
        with urllib.request.urlopen(url, timeout=_SNAPSHOT_TIMEOUT) as answer:
            doc = json.load(answer)
        return Counters(
            doc["requests"],
            doc["bytes_out"],
            doc["connections"],
            cpu_seconds(self.pid),
            memory=rss_bytes(self.pid),
        )

    def close(self) -> None:
        _stop(self._process)


class EtcdUnderTest:
    """An ``etcd`` member on loopback, its counters read from ``/metrics``."""

    def __init__(self) -> None:
        from tests._etcd_server import EtcdServer

        self._server = EtcdServer().start()
        assert self._server.process is not None
        self.pid = self._server.process.pid
        self.endpoint = self._server.endpoint
        self.endpoints = [self.endpoint]

    def snapshot(self) -> Counters:
        with urllib.request.urlopen(self._server.url + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
        received = sent = 0.0
        for line in text.splitlines():
            if line.startswith("grpc_server_msg_received_total{"):
                received += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_network_client_grpc_sent_bytes_total"):
                sent += float(line.rsplit(" ", 1)[1])
        return Counters(
            int(received), int(sent), -1, cpu_seconds(self.pid), memory=rss_bytes(self.pid)
        )

    def close(self) -> None:
        self._server.close()


class TorchStoreUnderTest:
    """torch's TCPStore server behind a byte-counting proxy, in one process."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._scale_torch", "host"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
        )
        self.pid = self._process.pid
        self.endpoint = _ready_line(self._process, "proxy on ", "the TCPStore host")
        self.endpoints = [self.endpoint]

    def snapshot(self) -> Counters:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write("stats\n")
        self._process.stdin.flush()
        doc = json.loads(self._process.stdout.readline())
        return Counters(-1, doc["bytes_out"], doc["connections"], cpu_seconds(self.pid))

    def close(self) -> None:
        _stop(self._process)
