"""`aelastic run` over Redis Sentinel: two nodes training with gloo live through failovers.

One primary, one replica and three sentinels (:mod:`tests._redis_ha`), two launcher
processes doing a gloo all-reduce loop. The primary is SIGKILLed while the first node waits
for the second (mid-rendezvous) and again while both train: after each failover the job
re-forms at most once and finishes with exit 0, and ``aelastic status`` through the
sentinels shows the round.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ._proc import Cli, cli_env

pytest.importorskip("redis")
pytest.importorskip("torch.distributed")

from tests._redis_ha import SentinelGroup, wait_until

PASSWORD = "data-pa55word"
SENTINEL_PASSWORD = "sentinel-pa55word"

# A gloo all-reduce loop. Every step all-reduces a 1 (the sum must be the world size) and
# whether the file "stop" exists (the ranks stop at the same step once it does).
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
    stop = torch.tensor([1.0 if os.path.exists("stop") else 0.0])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item():
        break
    time.sleep(0.1)
dist.destroy_process_group()
print(f"done rank={rank} steps={step}", flush=True)
"""


def _node(tmp_path: Path, endpoint: str, run_id: str) -> Cli:
    return Cli(
        [
            "run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=redis",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            "--rdzv-conf=last_call_timeout=0.5,keep_alive_interval=0.5,keep_alive_max_attempt=20",
            "--local-addr=127.0.0.1",
            "--max-restarts=3",
            "worker.py",
        ],
        tmp_path,
        env={
            "AELASTIC_REDIS_PASSWORD": PASSWORD,
            "AELASTIC_REDIS_SENTINEL_PASSWORD": SENTINEL_PASSWORD,
        },
    )


def _participants(ha: SentinelGroup, run_id: str) -> int:
    """Participants of the run's round, as the primary holds them."""
    with ha.client() as client:
        keys = client.keys(f"*{run_id}*:p")
        return sum(int(client.zcard(key)) for key in keys)


def _has(pattern: str):  # type: ignore[no-untyped-def]
    return lambda lines: any(re.search(pattern, line) for line in lines)


def _steps_after(node: Cli, count: int):  # type: ignore[no-untyped-def]
    """Predicate: ``count`` more steps than the node has printed so far."""
    seen = sum(1 for line in node.lines if re.search(r"step \d+ rank=", line))
    return lambda lines: (
        sum(1 for line in lines if re.search(r"step \d+ rank=", line)) >= (seen + count)
    )


def _status(endpoint: str, run_id: str, tmp_path: Path) -> str:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "aelastic", "status", "--rdzv-backend=redis"),
            *(f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"),
        ],
        cwd=tmp_path,
        env=cli_env(
            {
                "AELASTIC_REDIS_PASSWORD": PASSWORD,
                "AELASTIC_REDIS_SENTINEL_PASSWORD": SENTINEL_PASSWORD,
            }
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_training_job_survives_primary_failovers(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    group = SentinelGroup(password=PASSWORD, sentinel_password=SENTINEL_PASSWORD)
    with group as ha, _node(tmp_path, ha.endpoint, run_id) as a:
        # Mid-rendezvous: A has joined and waits for a second node.
        wait_until(lambda: _participants(ha, run_id) == 1, "node A joined", 60)
        old = ha.kill_primary()
        with _node(tmp_path, ha.endpoint, run_id) as b:
            a.wait_for(_has(r"^.*step \d+ rank="), timeout=120)
            b.wait_for(_has(r"^.*step \d+ rank="), timeout=120)
            # A replica again, so that the sentinels have one to promote.
            ha.rejoin(old)
            a.wait_for(_steps_after(a, 3), timeout=60)
            # Mid-training.
            ha.kill_primary()
            a.wait_for(_steps_after(a, 5), timeout=120)
            b.wait_for(_steps_after(b, 5), timeout=120)
            status = _status(ha.endpoint, run_id, tmp_path)
            (tmp_path / "stop").write_text("")
            assert a.wait(120) == 0, a.output
            assert b.wait(120) == 0, b.output
    assert re.search(rf"job '{re.escape(run_id)}': round \d+, complete", status), status
    assert "participants (2)" in status, status
    assert "rank   0" in status and "rank   1" in status, status
    for node in (a, b):
        starts = re.findall(r"start rank=\d world=2 restart=\d+", node.output)
        assert 1 <= len(starts) <= 2, node.output  # the first start, at most one restart
        assert re.search(r"done rank=\d steps=\d+", node.output), node.output
