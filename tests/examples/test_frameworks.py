"""Real third-party clients under aelastic: PyTorch Lightning's ``Trainer(strategy="ddp")``
and Hugging Face accelerate's ``Accelerator`` training under ``aelastic run`` on CPU (the
examples the README shows), and torch's own ``elastic_launch`` with aelastic's Redis
rendezvous (``rdzv_backend="aelastic-redis"``). tests/run.sh installs lightning and
accelerate (about 20 s; pinned to the torch already installed)."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from tests._redis_server import RedisServer, redis_server_fixture
from tests.examples._run import run

redis_server = redis_server_fixture()

#: Importing lightning takes 5 s on a quiet 2-core machine, 25 s under load.
TIMEOUT = 110


def _fitted(out: str, tag: str) -> list[str]:
    return re.findall(rf"\[{tag}\] rank (\d) of 2[^\n\[]*?: (y = -?[0-9.]+\*x [-+][0-9.]+)", out)


@pytest.mark.timeout(TIMEOUT + 10)
def test_lightning_ddp_trainer_under_aelastic_run() -> None:
    pytest.importorskip("lightning")
    code, out = run(
        [
            "-m",
            "aelastic",
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/lightning_ddp.py",
        ],
        timeout=TIMEOUT,
    )
    assert code == 0, out
    fitted = _fitted(out, "lightning")
    assert sorted(rank for rank, _ in fitted) == ["0", "1"], out
    assert fitted[0][1] == fitted[1][1]  # DDP kept both replicas equal
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out


@pytest.mark.timeout(TIMEOUT + 10)
def test_accelerate_training_under_aelastic_run() -> None:
    pytest.importorskip("accelerate")
    code, out = run(
        [
            "-m",
            "aelastic",
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/accelerate_train.py",
        ],
        timeout=TIMEOUT,
    )
    assert code == 0, out
    fitted = _fitted(out, "accelerate")
    assert sorted(rank for rank, _ in fitted) == ["0", "1"], out
    assert fitted[0][1] == fitted[1][1]
    assert "MULTI_CPU" in out


TORCH_LAUNCH = """
import os, sys
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from tests.launcher._fns import all_reduce_rank

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="torch-launch",
                      rdzv_backend="aelastic-redis", rdzv_endpoint=sys.argv[1],
                      max_restarts=0, monitor_interval=0.1)
print("outputs", elastic_launch(config, all_reduce_rank)())
"""


def test_torchs_own_elastic_launch_on_aelastic_redis(redis_server: RedisServer) -> None:
    code, out = run(["-c", textwrap.dedent(TORCH_LAUNCH), redis_server.url], timeout=TIMEOUT)
    assert code == 0, out
    # torch's agent fills its dict as its workers exit: compare it, not its order.
    found = re.search(r"^outputs (\{.*\})$", out, re.M)
    assert found is not None and ast.literal_eval(found.group(1)) == {0: 3.0, 1: 3.0}, out
