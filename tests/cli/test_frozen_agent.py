"""A frozen node's workers stop: two ``aelastic run`` nodes over Redis (a 1.5 s heartbeat
window), node B's agent stopped with SIGSTOP. B's worker, and the process it started, stop
by themselves within the window and a moment, before A says B is lost, so that no rank of
the old group runs beside its replacement; A goes on alone. When B's agent runs again it
finds its worker gone, re-rendezvouses without spending a restart (``--max-restarts 0``:
a failure would end the job) and the job finishes on both nodes."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from ._proc import Cli, alive

pytestmark = pytest.mark.timeout(240)

# Starts a child in its group; in a world of 2 says its pid and its child's in $NODE.pids;
# works until the file "finish" exists.
WORKER = """
import os, subprocess, time
child = subprocess.Popen(["sleep", "600"])
if os.environ["WORLD_SIZE"] == "2":
    with open(os.environ["NODE"] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(os.environ["NODE"] + ".tmp", os.environ["NODE"] + ".pids")
while not os.path.exists("finish"):
    time.sleep(0.05)
child.kill()
print(f"finished in a world of {os.environ['WORLD_SIZE']}", flush=True)
"""

WINDOW = 1.5


def _pids(path: Path, cli: Cli, timeout: float = 90) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert cli.proc.poll() is None, cli.output
        assert time.monotonic() < deadline, f"no {path.name}:\n{cli.output}"
        time.sleep(0.05)
    worker, child = map(int, path.read_text().split())
    return worker, child


def _said(cli: Cli, text: str, within: float) -> bool:
    try:
        cli.wait_for(lambda lines: any(text in x for x in lines), within)
    except AssertionError:
        return False
    return True


def test_a_frozen_agents_worker_stops_itself_before_its_node_is_dropped(
    tmp_path: Path, run_id: str
) -> None:
    pytest.importorskip("redis")
    from tests._redis_server import RedisServer

    (tmp_path / "train.py").write_text(textwrap.dedent(WORKER))
    with RedisServer() as server:
        where = ["--rdzv-backend=redis", f"--rdzv-endpoint={server.url}", f"--rdzv-id={run_id}"]
        conf = "--rdzv-conf=last_call_timeout=3,keep_alive_interval=0.5,keep_alive_max_attempt=3"

        def node(name: str, addr: str) -> Cli:
            args = ["run", "--nnodes=1:2", *where, conf, f"--local-addr={addr}"]
            args += ["--max-restarts=0", "train.py"]
            return Cli(args, tmp_path, env={"NODE": name})

        with node("a", "127.0.0.1") as a, node("b", "127.0.0.2") as b:
            _pids(tmp_path / "a.pids", a)
            worker, child = _pids(tmp_path / "b.pids", b)
            (tmp_path / "b.pids").unlink()
            os.kill(b.proc.pid, signal.SIGSTOP)  # the agent freezes; its worker runs on
            frozen = time.monotonic()
            try:
                while alive(worker) or alive(child):
                    assert time.monotonic() - frozen < WINDOW + 10, "the worker runs on"
                    assert not _said(a, "node(s) lost", 0.02), a.output  # B not dropped yet
                stopped_after = time.monotonic() - frozen
                a.wait_for(lambda lines: any("node(s) lost" in x for x in lines), 30)
                time.sleep(max(3 * WINDOW - (time.monotonic() - frozen), 0))
            finally:
                os.kill(b.proc.pid, signal.SIGCONT)
            # B runs again: it finds its worker gone and joins A again (a world of 2).
            _pids(tmp_path / "b.pids", b)
            (tmp_path / "finish").touch()
            assert b.wait(60) == 0, b.output
            assert a.wait(60) == 0, a.output
    assert stopped_after < WINDOW + 3, stopped_after  # the window, and a loaded machine
    assert "this worker's agent (pid" in b.output and "has not run for" in b.output, b.output
    # Back, it re-forms the group without spending a restart: for its workers that stopped,
    # or for its removal from the round, whichever it sees first.
    assert "this agent was frozen past its heartbeat window" in b.output or (
        "re-forming the group (this node was removed from its round); no restart spent" in b.output
    ), b.output
    assert "restarting the workers" not in b.output and "Traceback" not in b.output
    assert "finished in a world of 2" in a.output and "finished in a world of 2" in b.output
