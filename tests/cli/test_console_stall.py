"""A console that stops reading never stalls the agent: it keeps beating and answering.

Node A tees a chatty worker to its stdout, a pipe this test does not read for 20 s (full
after a few milliseconds); node B, a peer on the same rendezvous server, must not lose A
(heartbeats every 0.5 s, a 1.5 s window), and A's health check must answer all along. Once
the test reads again, A says how many lines it dropped, and both nodes finish.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests._ports import free_port

from ._proc import Cli, cli_env

pytest.importorskip("aiohttp")

# Prints 200-byte lines as fast as it can (about 1 MB/s) until the stop file exists.
CHATTY = """
import os, sys, time
print(f"worker rank={os.environ['RANK']} up", flush=True)
while not os.path.exists(sys.argv[1]):
    print(("x" * 199 + "\\n") * 50, end="", flush=True)
    time.sleep(0.01)
"""

QUIET = """
import os, sys, time
print(f"worker rank={os.environ['RANK']} up", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""

STALL = 20.0


def _health(port: int, timeout: float = 5.0) -> dict[str, object]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return dict(json.loads(answer.split(b"\r\n\r\n", 1)[1]))


def test_a_frozen_console_costs_lines_never_a_heartbeat_or_a_health_check(
    tmp_path: Path,
) -> None:
    from tests._http_server import HttpServer

    (tmp_path / "chatty.py").write_text(textwrap.dedent(CHATTY))
    (tmp_path / "quiet.py").write_text(textwrap.dedent(QUIET))
    stop = str(tmp_path / "stop")
    health = free_port()
    with HttpServer() as server:
        common = [
            "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "http",
            "--rdzv-endpoint", server.endpoint, "--rdzv-id", "stall",
            "--rdzv-conf", "keep_alive_interval=0.5,keep_alive_max_attempt=3",
        ]  # fmt: skip
        # A: its stdout and stderr are one pipe that nobody reads for now.
        a = subprocess.Popen(
            [sys.executable, "-m", "aelastic", *common, "--tee", "3",
             "--log-dir", str(tmp_path / "logs"), "chatty.py", stop],
            cwd=tmp_path,
            env=cli_env({"TORCHELASTIC_HEALTH_CHECK_PORT": str(health)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            with Cli([*common, "quiet.py", stop], tmp_path) as b:
                b.wait_for(lambda lines: any("worker rank=" in x for x in lines), 120)
                deadline = time.monotonic() + 60
                while _health(health).get("state") != "HEALTHY":
                    assert time.monotonic() < deadline, "node A never started its worker"
                    time.sleep(0.2)
                # The stall: A's console is full; every probe must still be answered.
                stalled_until = time.monotonic() + STALL
                probes = 0
                while time.monotonic() < stalled_until:
                    started = time.monotonic()
                    assert _health(health)["state"] == "HEALTHY"
                    assert time.monotonic() - started < 5.0
                    probes += 1
                    time.sleep(0.5)
                assert probes >= 10
                assert a.poll() is None
                # B never lost A: no change of the group, its worker still the first one.
                assert not [x for x in b.lines if "the group changed" in x], b.output
                # Read A again, then finish the job.
                out: list[bytes] = []
                assert a.stdout is not None
                reader = threading.Thread(target=lambda: out.append(a.stdout.read()))  # type: ignore[union-attr]
                reader.start()
                Path(stop).touch()
                assert b.wait(60) == 0, b.output
                assert a.wait(60) == 0
                reader.join(30)
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()
            assert a.stdout is not None
            a.stdout.close()
    shown = b"".join(out).decode(errors="replace")
    assert "the console is not reading:" in shown and "line(s) dropped" in shown
    assert "all workers of this node succeeded" in shown
    assert not [x for x in b.lines if "the group changed" in x], b.output
    # The log file has every line the console missed.
    logs = list((tmp_path / "logs").rglob("stdout.log"))
    assert len(logs) == 1 and os.path.getsize(logs[0]) > 4 * 1024 * 1024
