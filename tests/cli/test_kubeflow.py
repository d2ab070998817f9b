"""Kubeflow-shaped jobs: nodes started with only ``PET_*`` variables and the script.

A non-elastic PyTorchJob gives each pod ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (torch's static rendezvous);
an elastic one ``PET_RDZV_BACKEND=c10d`` and ``PET_RDZV_ENDPOINT`` (torch's c10d). Both run
here as two real ``aelastic run`` processes whose workers do a gloo all-reduce.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest

from tests._ports import free_port

from ._proc import Cli, alive

pytest.importorskip("torch")

ALL_REDUCE = """
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={value.item()} "
      f"group={os.environ['GROUP_RANK']}", flush=True)
dist.destroy_process_group()
"""

# Prints its world; exits 0 once the world has the size given as argument, else waits.
WAITER = """
import os, sys, time
print(f"worker pid={os.getpid()} world={os.environ['WORLD_SIZE']}", flush=True)
if int(os.environ["WORLD_SIZE"]) != int(sys.argv[1]):
    time.sleep(120)
"""


# Says its node's rank, then stays until the file given as argument exists.
STAY = """
import os, sys, time
print(f"worker group={os.environ['GROUP_RANK']}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def _pod(tmp_path: Path, env: dict[str, str], *args: str) -> Cli:
    return Cli([*args], tmp_path, env={"PET_NPROC_PER_NODE": "1", **env})


def _script(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(text))
    return name


def test_static_job_from_pet_variables(tmp_path: Path) -> None:
    script = _script(tmp_path, "train.py", ALL_REDUCE)
    master = {"PET_NNODES": "2", "PET_MASTER_ADDR": "127.0.0.1"}
    master["PET_MASTER_PORT"] = str(free_port())
    # The worker pod comes first: it waits for the master's rendezvous to appear.
    with (
        _pod(tmp_path, {**master, "PET_NODE_RANK": "1"}, "run", script) as one,
        _pod(tmp_path, {**master, "PET_NODE_RANK": "0"}, "run", script) as zero,
    ):
        assert zero.wait(120) == 0, zero.output
        assert one.wait(120) == 0, one.output
    # Ranks follow the node ranks, as torch's static rendezvous gives them.
    assert "rank=0 world=2 sum=3.0 group=0" in zero.output, zero.output
    assert "rank=1 world=2 sum=3.0 group=1" in one.output, one.output


def test_c10d_job_from_pet_variables(tmp_path: Path) -> None:
    script = _script(tmp_path, "train.py", ALL_REDUCE)
    env = {
        "PET_NNODES": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "PET_RDZV_ID": "kubeflow-job",
    }
    with _pod(tmp_path, env, "run", script) as a, _pod(tmp_path, env, "run", script) as b:
        assert a.wait(120) == 0, a.output
        assert b.wait(120) == 0, b.output
    outputs = a.output + b.output
    assert "world=2 sum=3.0" in a.output and "world=2 sum=3.0" in b.output, outputs
    assert "rank=0 " in outputs and "rank=1 " in outputs


def test_elastic_c10d_survivor_reforms_alone(tmp_path: Path) -> None:
    script = _script(tmp_path, "worker.py", WAITER)
    env = {
        "PET_NNODES": "1:2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "PET_RDZV_ID": "kubeflow-elastic",
        "PET_RDZV_CONF": "last_call_timeout=10,keep_alive_interval=0.5,keep_alive_max_attempt=3",
        "PET_MAX_RESTARTS": "3",
    }
    port = int(env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[1])
    with _pod(tmp_path, env, "run", script, "1") as host:
        _wait_listening(port)  # the first node hosts the rendezvous
        with _pod(tmp_path, env, "run", script, "1") as guest:
            # Within the last call (10 s: a loaded machine starts the guest slowly): one
            # round of two, whose workers wait.
            host.wait_for(lambda lines: any("world=2" in x for x in lines), 60)
            guest.wait_for(lambda lines: any("world=2" in x for x in lines), 60)
            children = _children(guest.proc.pid)
            for pid in [guest.proc.pid, *children]:  # the guest's pod is deleted
                os.kill(pid, signal.SIGKILL)
            guest.wait(30)
        assert host.wait(60) == 0, host.output
    assert "world=1" in host.output.split("world=2", 1)[1], host.output
    assert not [pid for pid in children if alive(pid)]


def test_static_node_whose_master_never_comes_fails_naming_it(tmp_path: Path) -> None:
    script = _script(tmp_path, "train.py", ALL_REDUCE)
    port = free_port()
    env = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "PET_RDZV_CONF": "join_timeout=2",
    }
    with _pod(tmp_path, env, "run", script) as one:
        assert one.wait(60) == 1, one.output
    errors = [line for line in one.output.splitlines() if "could not be reached" in line]
    assert errors and f"127.0.0.1:{port}" in errors[0], one.output
    assert "Traceback" not in one.output


def test_two_static_nodes_with_one_node_rank_are_told(tmp_path: Path) -> None:
    # The workers only wait: the node ranks are what is tested (no torch to import).
    script = _script(tmp_path, "worker.py", STAY)
    never = str(tmp_path / "never")
    env = {
        "PET_NNODES": "3",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
        "PET_RDZV_CONF": "join_timeout=30,keep_alive_interval=0.5",
    }
    with _pod(tmp_path, {**env, "PET_NODE_RANK": "0"}, "run", script, never) as zero:
        zero.wait_for(lambda lines: any("launching" in x for x in lines))
        # A second node rank 0 cannot host: the master's port is taken.
        with _pod(tmp_path, {**env, "PET_NODE_RANK": "0"}, "run", script, never) as again:
            assert again.wait(60) == 1, again.output
        assert "cannot host the static rendezvous" in again.output, again.output
        # Two nodes rank 1: the round completes with three nodes, one of them is told.
        with (
            _pod(tmp_path, {**env, "PET_NODE_RANK": "1"}, "run", script, never) as a,
            _pod(tmp_path, {**env, "PET_NODE_RANK": "1"}, "run", script, never) as b,
        ):
            # Both fail, each with the line: the first to take the rank learns it at its
            # next join (the other never beats: the round loses it).
            told = "two nodes were started with node rank 1"
            assert a.wait(60) == 1, a.output
            assert b.wait(60) == 1, b.output
            for pod in (a, b):
                assert [x for x in pod.lines if told in x and "error:" in x], pod.output
                assert "Traceback" not in pod.output


def test_a_surplus_static_node_with_a_taken_node_rank_fails(tmp_path: Path) -> None:
    script = _script(tmp_path, "worker.py", STAY)
    stop = tmp_path / "stop"
    env = {
        "PET_NNODES": "2",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
        "PET_RDZV_CONF": "keep_alive_interval=0.5",
    }
    with (
        _pod(tmp_path, {**env, "PET_NODE_RANK": "0"}, "run", script, str(stop)) as zero,
        _pod(tmp_path, {**env, "PET_NODE_RANK": "1"}, "run", script, str(stop)) as one,
    ):
        for pod in (zero, one):
            pod.wait_for(lambda lines: any("worker group=" in x for x in lines), 60)
        # The job runs with node ranks 0 and 1; a third node says it is node rank 1 too.
        with _pod(tmp_path, {**env, "PET_NODE_RANK": "1"}, "run", script, str(stop)) as extra:
            assert extra.wait(60) == 1, extra.output
        stop.touch()
        assert zero.wait(60) == 0, zero.output
        assert one.wait(60) == 0, one.output
    errors = [x for x in extra.lines if "error:" in x]
    assert len(errors) == 1 and "two nodes were started with node rank 1" in errors[0], errors
    assert "worker group=" not in extra.output and "succeeded" not in extra.output


def _static_pair(
    tmp_path: Path, conf: str, zero_args: list[str], one_args: list[str]
) -> tuple[Cli, Cli]:
    """Node rank 0 (in a session of its own: its group is the pod) and node rank 1."""
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
        "PET_RDZV_CONF": conf,
    }
    zero = Cli(["run", *zero_args], tmp_path, {**env, "PET_NODE_RANK": "0"}, session=True)
    one = Cli(["run", *one_args], tmp_path, {**env, "PET_NODE_RANK": "1"})
    return zero, one


def _retries(event_log: Path) -> list[float]:
    if not event_log.exists():
        return []
    events = [json.loads(line) for line in event_log.read_text().splitlines()]
    return [e["retry_for"] for e in events if e["kind"] == "backend_retry"]


def test_a_static_job_whose_host_dies_mid_training_ends_within_read_timeout(
    tmp_path: Path,
) -> None:
    script = _script(tmp_path, "worker.py", STAY)
    stop = str(tmp_path / "never")
    conf = "read_timeout=3,keep_alive_interval=0.5"
    log = tmp_path / "events.jsonl"
    zero, one = _static_pair(
        tmp_path, conf, [script, stop], ["--event-log", str(log), script, stop]
    )
    with zero, one:
        for pod in (zero, one):
            pod.wait_for(lambda lines: any("worker group=" in x for x in lines), 60)
        before = len(_retries(log))
        os.killpg(zero.proc.pid, signal.SIGKILL)  # the master pod is deleted
        killed = time.monotonic()
        zero.wait(30)
        assert one.wait(60) == 1, one.output
        took = time.monotonic() - killed
    assert took < 3 + 20, took  # read_timeout, then the worker's stop (generous)
    errors = [x for x in one.lines if "error:" in x]
    assert len(errors) == 1, one.output
    assert "RendezvousLostError" in errors[0] and "host 127.0.0.1:" in errors[0], errors
    assert "is gone: no answer for 3 s (read_timeout)" in errors[0], errors
    # The countdown of the retries ran once: it never started again.
    countdown = _retries(log)[before:]
    assert countdown and countdown == sorted(countdown, reverse=True), countdown
    assert not [x for x in one.lines if x.rstrip().endswith(":")], one.output  # reasons given
    assert "Traceback" not in one.output
    assert not [pid for pid in _children(one.proc.pid) if alive(pid)]


def test_a_finished_static_node_leaves_within_the_exit_barrier_when_the_host_dies(
    tmp_path: Path,
) -> None:
    stay = _script(tmp_path, "worker.py", STAY)
    done = _script(
        tmp_path, "done.py", "import os\nprint('worker group=' + os.environ['GROUP_RANK'])\n"
    )
    stop = str(tmp_path / "never")
    zero, one = _static_pair(
        tmp_path, "keep_alive_interval=0.5", [stay, stop], ["--exit-barrier-timeout", "5", done]
    )
    with zero, one:
        one.wait_for(lambda lines: any("worker rank 1" in x and "finished" in x for x in lines))
        zero.wait_for(lambda lines: any("worker group=" in x for x in lines), 60)
        os.killpg(zero.proc.pid, signal.SIGKILL)  # while node 1 waits at the exit barrier
        killed = time.monotonic()
        zero.wait(30)
        assert one.wait(60) == 0, one.output  # its own workers succeeded, as torch's
        took = time.monotonic() - killed
    assert took < 5 + 15, took  # the exit barrier's timeout, then a few seconds
    assert "gave up waiting for the other nodes" in one.output, one.output
    assert "Traceback" not in one.output


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fp:
            return [int(p) for p in fp.read().split()]
    except OSError:
        return []
