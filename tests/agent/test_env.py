"""The worker environment contract, as pure functions."""

from __future__ import annotations

import pytest

from aelastic.agent import Std, Worker, WorkerGroup, WorkerSpec
from aelastic.agent.api import std_map
from aelastic.agent.health.progress import BOOTSTRAP_DIR
from aelastic.agent.processes.env import cuda_visible_device, substitute_args, worker_env
from aelastic.rendezvous import RendezvousParameters, create_handler


def group(nproc: int = 2, **kwargs: object) -> WorkerGroup:
    handler = create_handler(RendezvousParameters("memory", "env-tests", "run", 1, 1))
    spec = WorkerSpec("trainer", nproc, handler, "python", **kwargs)  # type: ignore[arg-type]
    wg = WorkerGroup(spec)
    wg.group_rank, wg.group_world_size = 1, 3
    wg.master_addr, wg.master_port = "node0", 29501
    wg.workers = [Worker(i, 10 + i, 4 + i, 12, 8) for i in range(nproc)]
    return wg


def env_of(wg: WorkerGroup, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    return worker_env(
        wg, wg.workers[local_rank], restart_count=2, run_id="run", error_file="/e", base=base
    )


def test_torch_variables() -> None:
    env = env_of(group(max_restarts=5), 1, {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "RANK": "11",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "ROLE_RANK": "5",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "12",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29501",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "run",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": "/e",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": BOOTSTRAP_DIR,  # aelastic's worker bootstrap (it takes itself off)
    }


def test_the_bootstrap_goes_first_on_the_path_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = env_of(group(), 0, {"PYTHONPATH": "/mine:/theirs"})
    assert env["PYTHONPATH"] == f"{BOOTSTRAP_DIR}:/mine:/theirs"
    monkeypatch.setenv("AELASTIC_WORKER_BOOTSTRAP", "0")
    assert env_of(group(), 0, {"PYTHONPATH": "/mine"})["PYTHONPATH"] == "/mine"
    assert "PYTHONPATH" not in env_of(group(), 0, {})


def test_precedence_and_inherited_settings() -> None:
    base = {"OMP_NUM_THREADS": "4", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "RANK": "99"}
    wg = group(env={"EXTRA": "x", "RANK": "7", "OMP_NUM_THREADS": "2"})
    env = env_of(wg, 0, base)
    assert env["RANK"] == "10"  # torch's variables win
    assert env["EXTRA"] == "x"
    assert env["OMP_NUM_THREADS"] == "2"  # the spec's env over the agent's
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert "OMP_NUM_THREADS" not in env_of(group(nproc=1), 0, {})  # only when nproc > 1


def test_cuda_visible_devices_per_local_rank() -> None:
    assert cuda_visible_device(0, None) == "0"
    assert cuda_visible_device(3, None) == "3"
    assert cuda_visible_device(1, "4,5, 6") == "5"
    assert cuda_visible_device(1, "GPU-aa,GPU-bb") == "GPU-bb"
    with pytest.raises(ValueError, match="exceeds available GPUs"):
        cuda_visible_device(2, "0,1")
    wg = group(virtual_local_rank=True)
    env = env_of(wg, 1, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["LOCAL_RANK"] == "0"
    assert env_of(wg, 0, {})["CUDA_VISIBLE_DEVICES"] == "0"
    # Without the assignment, the agent's devices are inherited unchanged (torch's default).
    env = env_of(group(), 1, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["LOCAL_RANK"] == "1"


def test_local_rank_macro() -> None:
    args = ("--rank=${local_rank}", 3, "plain", "${local_rank}/${local_rank}")
    assert substitute_args(args, 2) == ("--rank=2", 3, "plain", "2/2")


def test_group_without_rendezvous_is_refused() -> None:
    wg = group()
    wg.group_rank = None
    with pytest.raises(ValueError, match="rendezvous"):
        env_of(wg, 0, {})


def test_std_settings() -> None:
    assert Std.from_str("3") is Std.ALL
    assert Std.from_str("0:1,1:2") == {0: Std.OUT, 1: Std.ERR}
    assert std_map("0:1,3:3", 4) == {0: Std.OUT, 1: Std.NONE, 2: Std.NONE, 3: Std.ALL}
    assert std_map(Std.ERR, 2) == {0: Std.ERR, 1: Std.ERR}
    assert std_map(1, 1) == {0: Std.OUT}
    for bad in ("4", "0:4", "a", "0:1,"):
        with pytest.raises(ValueError):
            Std.from_str(bad)


def test_spec_validation() -> None:
    handler = create_handler(RendezvousParameters("memory", "env-tests", "run", 1, 1))
    with pytest.raises(ValueError, match="local_world_size"):
        WorkerSpec("t", 0, handler, "python")
    with pytest.raises(ValueError, match="entrypoint"):
        WorkerSpec("t", 1, handler)
    with pytest.raises(ValueError):
        WorkerSpec("t", 1, handler, "python", redirects="9")
    assert WorkerSpec("t", 1, handler, "/usr/bin/python3").get_entrypoint_name() == "python3"
    assert WorkerSpec("t", 1, handler, test_spec_validation).get_entrypoint_name() == (
        "test_spec_validation"
    )
