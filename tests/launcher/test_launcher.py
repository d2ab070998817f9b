"""aelastic.launcher: torch-written launch code with only the import changed.

Each test is the code a torch user writes for ``torch.distributed.launcher.api`` (a
``LaunchConfig``, ``elastic_launch(config, fn)(*args)``, ``except ChildFailedError``), with
``from aelastic.launcher import ...`` instead; workers are real processes, the rendezvous a
real backend (in-process memory, a real redis-server).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed.elastic.multiprocessing.errors as torch_errors

from aelastic.launcher import LaunchConfig, elastic_launch, launch_agent_async
from tests._redis_server import RedisServer, redis_server_fixture
from tests.launcher import _fns

redis_server = redis_server_fixture()

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> Iterator[str]:
    yield f"launcher-{request.node.name}-{os.getpid()}"


def _config(run_id: str, **kwargs: object) -> LaunchConfig:
    settings: dict[str, object] = {"max_restarts": 0, "monitor_interval": 0.1, "run_id": run_id}
    settings.update(kwargs)
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, **settings)  # type: ignore[arg-type]


def test_gloo_all_reduce_returns_each_ranks_value_in_memory(run_id: str) -> None:
    outputs = elastic_launch(_config(run_id), _fns.all_reduce_rank)()
    assert outputs == {0: 3.0, 1: 3.0}


def test_gloo_all_reduce_over_redis(redis_server: RedisServer, run_id: str) -> None:
    config = _config(run_id, rdzv_backend="redis", rdzv_endpoint=redis_server.url)
    assert elastic_launch(config, _fns.all_reduce_rank)() == {0: 3.0, 1: 3.0}


def test_a_failure_is_torchs_child_failed_error(run_id: str) -> None:
    with pytest.raises(torch_errors.ChildFailedError) as caught:
        elastic_launch(_config(run_id), _fns.fail_on_rank_one)("rank one gives up")
    error = caught.value
    assert error.name == "fail_on_rank_one"
    rank, failure = error.get_first_failure()
    assert rank == 1 and list(error.failures) == [1]
    assert failure.local_rank == 1 and failure.exitcode == 1 and failure.pid > 0
    assert failure.message["message"] == "ValueError: rank one gives up"
    assert "fail_on_rank_one" in failure.message["extraInfo"]["py_callstack"]
    assert os.path.isfile(failure.error_file)  # kept for @record, as torch keeps it
    text = str(error)
    assert "fail_on_rank_one FAILED" in text and "Root Cause (first observed failure)" in text
    assert "rank      : 1 (local_rank: 1)" in text and "ValueError: rank one gives up" in text
    assert "aelastic" not in failure.message["extraInfo"]["py_callstack"]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_an_mp_queue_passes_to_spawned_workers(run_id: str, method: str) -> None:
    queue = multiprocessing.get_context(method).Queue()
    outputs = elastic_launch(_config(run_id, start_method=method), _fns.put_rank)(queue, "q")
    assert outputs == {0: "q", 1: "q"}
    assert sorted([queue.get(timeout=30), queue.get(timeout=30)]) == [("q", 0), ("q", 1)]


def test_a_lambda_is_refused_under_spawn_as_multiprocessing_refuses_it(run_id: str) -> None:
    with pytest.raises((pickle.PicklingError, AttributeError), match=r"pickle"):
        elastic_launch(_config(run_id, start_method="spawn"), lambda: 1)()


# A notebook's or stdin's code: the function lives in __main__, which a spawned worker
# cannot import; under fork it is inherited, as with torch.
STDIN_PROGRAM = """
import multiprocessing, os, sys
from aelastic.launcher import LaunchConfig, elastic_launch

def train(scale):
    return scale * (int(os.environ["RANK"]) + 1)

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="stdin",
                      max_restarts=0, start_method="fork")
print("main", elastic_launch(config, train)(10))
offset = 5
config.run_id = "stdin-lambda"
print("lambda", elastic_launch(config, lambda: offset + int(os.environ["RANK"]))())
queue = multiprocessing.get_context("fork").Queue()
config.run_id = "stdin-queue"
elastic_launch(config, lambda q: q.put(os.environ["RANK"]))(queue)
print("queue", sorted([queue.get(timeout=30), queue.get(timeout=30)]))
print("torch imported:", "torch" in sys.modules)
print("children left:", multiprocessing.active_children())
"""


def test_main_functions_and_lambdas_run_under_fork() -> None:
    out = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_PROGRAM,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "main {0: 10, 1: 20}" in lines
    assert "lambda {0: 5, 1: 6}" in lines
    assert "queue ['0', '1']" in lines
    assert "torch imported: False" in lines  # the launcher's path never imports torch
    assert "children left: []" in lines


def test_fork_workers_are_supervised_like_any(run_id: str, tmp_path: Path) -> None:
    # A forked worker that hangs is stopped by the agent (SIGTERM to its process group,
    # grace, SIGKILL) when its peer fails; nothing is left behind.
    marker = tmp_path / "pids"
    program = textwrap.dedent(
        f"""
        import multiprocessing, os, signal, sys, time
        from aelastic.launcher import LaunchConfig, elastic_launch

        hanging = multiprocessing.get_context("fork").Event()

        def work():
            with open({str(marker)!r}, "a") as f:
                f.write(f"{{os.getpid()}} {{os.getpgid(0)}}\\n")
            if os.environ["RANK"] == "0":
                hanging.wait(60)
                raise RuntimeError("rank 0 fails")
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            hanging.set()
            time.sleep(60)

        config = LaunchConfig(1, 1, 2, run_id="hang", max_restarts=0, start_method="fork",
                              shutdown_timeout=1)
        try:
            elastic_launch(config, work)()
        except Exception as exc:
            print(type(exc).__name__)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.stdout.strip() == "ChildFailedError", out.stderr
    pids = [line.split() for line in marker.read_text().splitlines()]
    assert len(pids) == 2
    for pid, pgid in pids:
        assert pid == pgid  # each worker leads its own process group
        assert not Path(f"/proc/{pid}").exists()


@pytest.mark.anyio
async def test_asyncio_callers_await_the_launch(run_id: str) -> None:
    outputs = await launch_agent_async(_config(run_id), _fns.rank_times, [7])
    assert outputs == {0: 0, 1: 7}


def test_c10d_at_localhost_port_zero_runs_one_node(run_id: str) -> None:
    config = _config(run_id, rdzv_backend="c10d", rdzv_endpoint="localhost:0")
    assert elastic_launch(config, _fns.rank_times)(3) == {0: 0, 1: 3}


def test_c10d_at_port_zero_refuses_several_nodes(run_id: str) -> None:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=1,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
    )
    with pytest.raises(ValueError, match=r"port 0.*for one node"):
        elastic_launch(config, _fns.rank_times)(1)


def test_torchs_launch_config_defaults_and_rules() -> None:
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

    ours, theirs = LaunchConfig(1, 2, 4), TorchLaunchConfig(1, 2, 4)
    for name in (
        "run_id",
        "role",
        "rdzv_endpoint",
        "rdzv_configs",
        "rdzv_timeout",
        "max_restarts",
        "monitor_interval",
        "start_method",
        "log_line_prefix_template",
        "metrics_cfg",
        "local_addr",
        "event_log_handler",
        "signals_to_handle",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
        "virtual_local_rank",
        "shutdown_timeout",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.rdzv_backend == "memory" and theirs.rdzv_backend == "etcd"
    assert LaunchConfig(1, 1, 1, rdzv_timeout=30).rdzv_configs == {"timeout": 30}
    with pytest.raises(ValueError, match="shutdown_timeout"):
        LaunchConfig(1, 1, 1, shutdown_timeout=-1)


def test_a_single_process_backend_refuses_to_wait_for_other_nodes(run_id: str) -> None:
    with pytest.raises(ValueError, match="cannot wait for 2 nodes"):
        elastic_launch(LaunchConfig(2, 2, 1, run_id=run_id), _fns.rank_times)(1)
