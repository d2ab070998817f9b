"""A member whose process dies is known lost well before the heartbeat window ends; a member
that pauses, or whose connection is cut and comes back, is not dropped.

Real processes: two nodes of a ``2:2`` round on a real rendezvous server, each in a
process of its own, with a 10 s heartbeat window (2 s beats, 5 missed). The machine's grace
for a node whose connection ended is then 1 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests._http_server import HttpServer
from tests._tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
NODE = str(Path(__file__).with_name("_watching_node.py"))
CONF = {"keep_alive_interval": "2", "keep_alive_max_attempt": "5", "last_call_timeout": "1"}
WINDOW = 10.0
#: A loss seen this long after the kill is "well before the window ends" (grace: 1 s).
FAST = 6.0
_runs = iter(range(1_000_000))


class Node:
    """One node process and the lines it prints."""

    def __init__(self, backend: str, endpoint: str, run_id: str) -> None:
        args = [sys.executable, NODE, backend, endpoint, run_id]
        args += [f"{k}={v}" for k, v in CONF.items()]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT
        )

    def line(self, timeout: float) -> dict[str, Any] | None:
        """The next line it prints within ``timeout`` seconds, or ``None``."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        text = self.proc.stdout.readline()
        return json.loads(text) if text else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@contextmanager
def two_nodes(backend: str, endpoint: str, second: str | None = None) -> Iterator[list[Node]]:
    """Two nodes in a complete round (the second through ``second`` if given)."""
    run_id = f"depart-{os.getpid()}-{next(_runs)}"
    nodes = [Node(backend, endpoint, run_id), Node(backend, second or endpoint, run_id)]
    try:
        for node in nodes:
            ready = node.line(60.0)
            assert ready is not None and ready["event"] == "ready", ready
        yield nodes
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.proc.pid, signal.SIGCONT)
            node.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[HttpServer]:
    with HttpServer() as server:
        yield server


def test_a_killed_member_is_lost_long_before_the_window(http: HttpServer) -> None:
    with two_nodes("http", http.endpoint) as (survivor, victim):
        killed = time.time()
        victim.proc.kill()
        change = survivor.line(WINDOW + 5.0)
        assert change is not None and change["lost"] == 1, change
        assert change["at"] - killed < FAST


def test_a_paused_member_is_not_dropped(http: HttpServer) -> None:
    with two_nodes("http", http.endpoint) as (survivor, paused):
        os.kill(paused.proc.pid, signal.SIGSTOP)
        try:
            assert survivor.line(4.0) is None  # four times the grace, less than the window
        finally:
            os.kill(paused.proc.pid, signal.SIGCONT)
        assert survivor.line(2.0) is None and paused.line(2.0) is None


def test_a_member_whose_connection_is_cut_and_restored_is_not_dropped(http: HttpServer) -> None:
    proxy = TcpProxy(http.port)
    try:
        with two_nodes("http", http.endpoint, second=proxy.endpoint) as (survivor, cut):
            proxy.restart(down_for=0.2)
            assert survivor.line(4.0) is None and cut.line(0.1) is None
            proxy.restart(down_for=0.0)
            assert survivor.line(3.0) is None and cut.line(0.1) is None
    finally:
        proxy.close()


def test_a_member_whose_connection_is_cut_for_good_is_lost_long_before_the_window(
    http: HttpServer,
) -> None:
    proxy = TcpProxy(http.port)
    try:
        with two_nodes("http", http.endpoint, second=proxy.endpoint) as (survivor, _):
            cut = time.time()
            proxy.cut()
            change = survivor.line(WINDOW + 5.0)
            assert change is not None and change["lost"] == 1, change
            assert change["at"] - cut < FAST
    finally:
        proxy.close()
