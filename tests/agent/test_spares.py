"""A node lost mid-training with a hot spare standing by: 3 real nodes (``--nnodes 2:2``)
on a real rendezvous (HTTP, or Redis), a real gloo training loop, one member's agent
SIGKILLed.

In place (``aelastic.worker.InPlace``): the spare takes the lost node's place, the
survivor's worker goes on in the same process, and training ends with the right model; no
restart is spent (``max_restarts=0``: one spent would fail the run). Without the opt-in:
today's path, the survivor's workers restarted from a checkpoint, still without a restart
spent although its collective broke before the rendezvous declared the peer lost.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests._http_server import HttpServer
from tests._redis_server import RedisServer

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
NODE = str(Path(__file__).with_name("_spare_node.py"))
STEPS = 30
CONF = {
    "keep_alive_interval": "0.3",
    "keep_alive_max_attempt": "3",
    "last_call_timeout": "1",
    "join_timeout": "60",
}


class Reports:
    """The UDP socket the training workers report to."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[dict[str, Any]] = []

    def until(self, done: Any, timeout: float = 90.0) -> dict[str, Any]:
        """Reports until one satisfies ``done``; that one."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            report = json.loads(self.sock.recv(4096))
            self.seen.append(report)
            if done(report):
                return report


@contextmanager
def three_nodes(
    mode: str,
    tmp_path: Path,
    conf: dict[str, str] = CONF,
    redis: bool = False,
    linger: float = 0.0,
) -> Iterator[tuple[list[subprocess.Popen[bytes]], Reports]]:
    reports = Reports()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAIN_ADDR": reports.addr}
    env["TRAIN_LINGER"] = str(linger)
    env.update(TRAIN_DIR=str(tmp_path), TRAIN_STEPS=str(STEPS), TRAIN_LOGS=str(tmp_path / "logs"))
    with RedisServer() if redis else HttpServer() as server:
        endpoint = server.url if isinstance(server, RedisServer) else server.endpoint
        args = [sys.executable, NODE, endpoint, f"spare-{mode}", mode]
        args += [f"{k}={v}" for k, v in conf.items()]
        nodes = [subprocess.Popen(args, env=env, cwd=ROOT) for _ in range(3)]
        try:
            yield nodes, reports
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                node.wait()
            reports.sock.close()


def _lose_a_member(
    nodes: list[subprocess.Popen[bytes]], reports: Reports
) -> tuple[subprocess.Popen[bytes], dict[int, dict[str, Any]], float]:
    """Once both members trained a few steps, SIGKILL the agent of global rank 0 (the
    round's store is on its host); the killed node, the last report per rank, the time."""
    last: dict[int, dict[str, Any]] = {}
    reports.until(
        lambda r: (
            r["event"] == "step"
            and last.update({r["rank"]: r}) is None
            and len(last) == 2
            and min(s["step"] for s in last.values()) >= 5
        )
    )
    [victim] = [n for n in nodes if n.pid == last[0]["agent"]]
    killed = time.time()
    victim.send_signal(signal.SIGKILL)
    print(f"{killed:.3f} killed {victim.pid}", file=sys.stderr)
    return victim, last, killed


def _finish(
    nodes: list[subprocess.Popen[bytes]], victim: subprocess.Popen[bytes], reports: Reports
) -> list[dict[str, Any]]:
    done: list[dict[str, Any]] = []
    reports.until(lambda r: r["event"] == "done" and done.append(r) is None and len(done) == 2)
    for node in nodes:
        if node is not victim:
            assert node.wait(60) == 0
    return done


def test_without_opt_in_the_survivor_restarts_from_its_checkpoint_spending_no_restart(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch.distributed")
    with three_nodes("plain", tmp_path) as (nodes, reports):
        victim, before, killed = _lose_a_member(nodes, reports)
        survivor = before[1]
        done = _finish(nodes, victim, reports)
    # (The survivor's first worker may still report a step it finished as the kill came,
    # before its collective broke: the steps of the workers started since are compared.)
    after = [
        r
        for r in reports.seen
        if r["event"] == "step" and r["t"] > killed and r["pid"] != survivor["pid"]
    ]
    assert all(d["ok"] for d in done), done
    finished_by = {d["agent"]: d["pid"] for d in done}
    # Today's path: the survivor's worker restarted, by the same agent.
    assert finished_by[survivor["agent"]] != survivor["pid"], (survivor, done)
    assert survivor["agent"] in {r["agent"] for r in after}
    assert {r["restart"] for r in reports.seen} == {0}  # its broken collective spent none
    assert min(r["step"] for r in after) > 1  # from the checkpoint, not from scratch


@pytest.mark.parametrize("backend", ["http", "redis"])
def test_a_survivor_whose_worker_is_slow_to_exit_goes_on_long_before_the_window_ends(
    tmp_path: Path, backend: str
) -> None:
    """The survivor's worker, its collective broken by the loss of rank 0's node, takes a
    minute to exit (its interpreter's teardown): its agent learns that it raised in a
    collective before that and has the rendezvous report the lost member at once, so the
    new group trains seconds after the kill, long before the 30 s heartbeat window ends
    (over Redis nothing else tells the loss; over HTTP the server's departure would too,
    after its 1 s grace)."""
    pytest.importorskip("torch.distributed")
    window = 30.0
    conf = {**CONF, "keep_alive_interval": "1", "keep_alive_max_attempt": "30"}
    redis = backend == "redis"
    with three_nodes("plain", tmp_path, conf, redis=redis, linger=60.0) as (nodes, reports):
        victim, before, killed = _lose_a_member(nodes, reports)
        resumed = reports.until(
            lambda r: r["event"] == "step" and r["t"] > killed and r["agent"] != victim.pid
            and r["pid"] != before[1]["pid"]
        )  # fmt: skip
        done = _finish(nodes, victim, reports)
    assert resumed["t"] - killed < window / 2, resumed["t"] - killed
    assert all(d["ok"] for d in done), done
    assert {r["restart"] for r in reports.seen} == {0}  # the peer's loss spent no restart


def test_in_place_a_spare_takes_the_lost_nodes_place_and_the_survivor_goes_on(
    tmp_path: Path,
) -> None:
    """Over Redis, with a 12 s heartbeat window: the survivor's broken collective makes its
    agent check the members' named connections, so the group goes on seconds before the
    window ends. (The same over HTTP: ``tests/examples/test_inplace_recovery.py``.)"""
    pytest.importorskip("torch.distributed")
    window = 12.0
    conf = {**CONF, "keep_alive_interval": "2", "keep_alive_max_attempt": "6"}
    with three_nodes("inplace", tmp_path, conf, redis=True) as (nodes, reports):
        victim, before, killed = _lose_a_member(nodes, reports)
        survivor = before[1]
        resumed = reports.until(
            lambda r: (
                r["event"] == "step"
                and r["t"] > killed
                and r["agent"] != victim.pid
                and r["gen"] >= 1
            )
        )
        done = _finish(nodes, victim, reports)
    assert resumed["t"] - killed < window - 4.0, resumed["t"] - killed
    # The killed agent's worker may still report a step in the moment it outlives its agent.
    after = [
        r
        for r in reports.seen
        if r["event"] == "step" and r["t"] > killed and r["agent"] != victim.pid
    ]
    assert all(d["ok"] for d in done), done  # the model of 30 steps, exactly
    assert {d["rank"] for d in done} == {0, 1}
    assert victim.pid not in {d["agent"] for d in done}
    # The survivor's worker is the same process; the spare's is new, on another agent.
    assert survivor["pid"] in {r["pid"] for r in after}
    newcomer = {r["agent"] for r in after} - {survivor["agent"]}
    assert newcomer
    assert {r["world"] for r in after} == {2}
    assert {r["restart"] for r in reports.seen} == {0}  # no restart spent, anywhere
    # Steps go on from where the survivor was (never from 0), each done once after the kill.
    survivor_steps = [r["step"] for r in after if r["pid"] == survivor["pid"]]
    assert survivor_steps[0] <= survivor["step"] + 1 and survivor_steps[-1] == STEPS
