"""`aelastic run` on etcd: jobs that train to the end, Kubeflow's names, a leader killed.

Real launcher processes whose workers all-reduce over gloo, on a real etcd: one member, or a
3-member cluster whose leader is SIGKILLed while a round forms and again while three nodes
train. The job keeps its round (or forms it again once), spends no restart, and nothing
hangs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._etcd_server import EtcdCluster, EtcdServer

from ._proc import Cli, cli_env

pytest.importorskip("torch.distributed")

# A gloo all-reduce loop: every step all-reduces a 1 (the sum is the world size) and whether
# the file "stop" exists (the ranks stop at the same step once it does).
WORKER = """
import os, time, datetime
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"start rank={rank} world={world} restart={restart}", flush=True)
step = 0
while True:
    one = torch.tensor([1.0])
    dist.all_reduce(one)
    assert one.item() == world, one
    step += 1
    print(f"step {step} rank={rank} restart={restart}", flush=True)
    done = os.path.exists("stop") or step >= int(os.environ.get("STEPS", "1000000"))
    stop = torch.tensor([1.0 if done else 0.0])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item():
        break
    time.sleep(0.1)
dist.destroy_process_group()
print(f"done rank={rank} steps={step}", flush=True)
"""

CONF = "last_call_timeout=0.5,keep_alive_interval=0.5,keep_alive_max_attempt=4,read_timeout=30"


def _node(tmp_path: Path, endpoint: str, run_id: str, nnodes: int, env: dict[str, str]) -> Cli:
    return Cli(
        [
            "run",
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=etcd",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={CONF}",
            "--local-addr=127.0.0.1",
            "--max-restarts=3",
            "worker.py",
        ],
        tmp_path,
        env=env,
    )


def _has(pattern: str):  # type: ignore[no-untyped-def]
    return lambda lines: any(re.search(pattern, line) for line in lines)


def _steps_after(node: Cli, count: int):  # type: ignore[no-untyped-def]
    seen = sum(1 for line in node.lines if re.search(r"step \d+ rank=", line))
    return lambda lines: (
        sum(1 for line in lines if re.search(r"step \d+ rank=", line)) >= (seen + count)
    )


def _participants(etcd: EtcdServer, run_id: str) -> int:
    return len(etcd.keys(f"/aelastic/{run_id}/p/"))


def _wait(check, what: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _status(endpoint: str, run_id: str, tmp_path: Path, backend: str = "etcd") -> str:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "aelastic", "status", f"--rdzv-backend={backend}"),
            *(f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"),
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_two_nodes_train_to_the_end_and_status_reads_the_run(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    with EtcdServer() as etcd:
        env: dict[str, str] = {}
        with (
            _node(tmp_path, etcd.endpoint, run_id, 2, env) as a,
            _node(tmp_path, etcd.endpoint, run_id, 2, env) as b,
        ):
            a.wait_for(_has(r"step 1 rank="), timeout=120)
            status = _status(etcd.endpoint, run_id, tmp_path, backend="etcd-v2")
            (tmp_path / "stop").write_text("")  # the job trains until status has read it
            assert a.wait(120) == 0, a.output
            assert b.wait(120) == 0, b.output
    assert re.search(rf"job '{re.escape(run_id)}': round \d+, complete", status), status
    assert "participants (2)" in status, status
    for node in (a, b):
        assert re.search(r"done rank=\d steps=\d+", node.output), node.output


def test_kubeflow_etcd_v2_job_trains_to_the_end(tmp_path: Path, run_id: str) -> None:
    """Kubeflow's PyTorchJob passes rdzvBackend etcd-v2 as PET_RDZV_BACKEND."""
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    with EtcdServer() as etcd:
        env = {
            "STEPS": "3",
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_RDZV_BACKEND": "etcd-v2",
            "PET_RDZV_ENDPOINT": etcd.endpoint,
            "PET_RDZV_ID": run_id,
            "PET_RDZV_CONF": "last_call_timeout=0.5",
        }
        pods = [Cli(["run", "--local-addr=127.0.0.1", "worker.py"], tmp_path, env=env)]
        pods.append(Cli(["run", "--local-addr=127.0.0.1", "worker.py"], tmp_path, env=env))
        with pods[0] as a, pods[1] as b:
            assert a.wait(120) == 0, a.output
            assert b.wait(120) == 0, b.output
    outputs = a.output + b.output
    assert "start rank=0 world=2" in outputs and "start rank=1 world=2" in outputs, outputs


def test_etcd_down_at_start_is_one_clear_line(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    etcd = EtcdServer()  # never started: nothing listens on its port
    try:
        conf = "read_timeout=1,join_timeout=5"
        args = ["run", "--nnodes=1", "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoint}"]
        args += [f"--rdzv-id={run_id}", f"--rdzv-conf={conf}", "worker.py"]
        with Cli(args, tmp_path) as node:
            assert node.wait(60) != 0, node.output
    finally:
        etcd.close()
    errors = [line for line in node.output.splitlines() if "could not be reached" in line]
    assert errors and etcd.endpoint in errors[0], node.output
    assert "Traceback" not in node.output, node.output


def test_training_survives_leader_kills(tmp_path: Path, run_id: str) -> None:
    """Three nodes on a 3-member cluster; its leader is SIGKILLed while a round forms, and
    the new leader while they train: the job finishes, re-forming at most once."""
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    with EtcdCluster(3) as cluster:
        endpoint = cluster.endpoint
        env: dict[str, str] = {}
        with _node(tmp_path, endpoint, run_id, 3, env) as a:
            # Mid-rendezvous: A joined and waits for two more.
            _wait(lambda: _participants(cluster.leader(), run_id) == 1, "node A joined")
            cluster.leader().kill()
            with (
                _node(tmp_path, endpoint, run_id, 3, env) as b,
                _node(tmp_path, endpoint, run_id, 3, env) as c,
            ):
                for node in (a, b, c):
                    node.wait_for(_has(r"step \d+ rank="), timeout=120)
                killed = [m for m in cluster.members if not m.running]
                for member in killed:  # back, so that the cluster can lose another
                    member.start()
                a.wait_for(_steps_after(a, 3), timeout=60)
                # Mid-training.
                cluster.leader().kill()
                for node in (a, b, c):
                    node.wait_for(_steps_after(node, 10), timeout=120)
                (tmp_path / "stop").write_text("")
                for node in (a, b, c):
                    assert node.wait(120) == 0, node.output
    for node in (a, b, c):
        starts = re.findall(r"start rank=\d world=3 restart=(\d+)", node.output)
        assert 1 <= len(starts) <= 2, node.output  # the first start, at most one re-form
        assert set(starts) == {"0"}, node.output  # no restart spent
        assert re.search(r"done rank=\d steps=\d+", node.output), node.output


# A worker that needs no torch: it prints what the launcher gave it.
ENV_WORKER = """
import os
line = " ".join(f"{k}={os.environ[k]}" for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
os.write(1, f"env {line}\\n".encode())  # one write
"""


def test_a_job_trains_over_https_with_torchs_tls_keys(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(ENV_WORKER))
    with EtcdServer(tls=True, client_auth=True) as etcd:
        cert, key = etcd.client_cert("launcher")
        tls = f"protocol=https,cacert={etcd.ca_file},cert={cert},key={key}"
        args = ["run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=etcd"]
        args += [f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}"]
        args += [f"--rdzv-conf={CONF},{tls}", "--local-addr=127.0.0.1", "worker.py"]
        with Cli(args, tmp_path) as a, Cli(args, tmp_path) as b:
            assert a.wait(120) == 0, a.output
            assert b.wait(120) == 0, b.output
    ranks = sorted(re.findall(r"env RANK=(\d) WORLD_SIZE=2", a.output + b.output))
    assert ranks == ["0", "1"], a.output + b.output


def test_a_wrong_ca_is_one_clear_line(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(ENV_WORKER))
    with EtcdServer(tls=True) as etcd, EtcdServer(tls=True) as other:
        conf = f"protocol=https,cacert={other.ca_file},read_timeout=30"
        args = ["run", "--nnodes=1", "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoint}"]
        args += [f"--rdzv-id={run_id}", f"--rdzv-conf={conf}", "worker.py"]
        with Cli(args, tmp_path) as node:
            assert node.wait(60) != 0, node.output
    errors = [line for line in node.output.splitlines() if "certificate is not trusted" in line]
    assert errors and "cacert" in errors[0] and etcd.endpoint in errors[0], node.output
    assert "Traceback" not in node.output, node.output
