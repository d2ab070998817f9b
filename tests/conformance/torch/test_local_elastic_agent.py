"""torch's ``test/distributed/elastic/agent/server/test/local_elastic_agent_test.py``: the
agent with real workers (return values, environment, failures, restarts, several agents,
the exit barrier), against aelastic's :class:`~aelastic.agent.ElasticAgent`.

torch runs each scenario on ``c10d``, ``etcd`` and ``etcd-v2``. Here the scenarios of
several agents run on each backend, the agents in the test's event loop; those of one agent
run on the memory backend (a one-node rendezvous is the same on every backend); killing an
agent needs agent processes: ``test_local_elastic_agent_processes.py``.

Ported: 23 of the file's 28 scenarios (each run by torch on several backends), as 14 test
functions: ``run_happy_function``, ``run_function_with_return_value`` (which
also stands for ``dummy_compute``: torch's returns tensors, the same path for any picklable
value), ``check_master_addr_port_override``, ``run_check_env_function``,
``run_check_nccl_async_error_handling_env`` and ``..._default``, ``run_agent_local_watchdog_
setup_enabled``/``disabled``, ``run_agent_healthcheck_setup_enabled``/``disabled``,
``run_sad_function``, ``run_bipolar_function``, ``fail_rank_one_once``,
``run_with_custom_log_lines``, ``run_distributed_sum_homogeneous`` (the ranks; torch's
workers all-reduce them with gloo, which ``tests/launcher/test_launcher.py`` does through
aelastic's launcher: torch's import in every worker would cost seconds per backend here),
``simple_dist_sum`` (the same), ``run_distributed_sum_heterogeneous`` with
``correct_rank_assignment_heterogeneous``/``homogeneous`` (fewer workers: two roles of
mixed sizes), ``no_exit_barrier_on_failure``, ``workers_drift_success``/``fail``.
Not ported: ``torch_rpc`` (torch's RPC in the workers: nothing of the agent beyond the
environment already tested), ``barrier_failed`` and ``shutdown_called`` (mocks of torch's
``store.barrier`` and ``start_processes``).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from aelastic import RendezvousError
from aelastic.agent import ElasticAgent, RunResult, Std, WorkerState
from tests._ports import free_port

from . import _functions
from ._agents import command_spec, function_spec, worker_envs
from .conftest import HandlerFactory

pytestmark = pytest.mark.anyio

RUN = 60.0

TORCH_ENV = (
    "RANK",
    "LOCAL_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


async def _run(agent: ElasticAgent) -> RunResult:
    return await asyncio.wait_for(agent.run(), RUN)


# -- one agent ------------------------------------------------------------------------------


async def test_run_happy_function(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    (handler,) = solo_handlers(1, 1, 1)
    result = await _run(ElasticAgent(function_spec(handler, tmp_path, _functions.happy_function)))
    assert not result.is_failed()
    assert result.return_values == {0: None, 1: None}


async def test_run_function_with_return_value(
    solo_handlers: HandlerFactory, tmp_path: Path
) -> None:
    (handler,) = solo_handlers(1, 1, 1)
    spec = function_spec(handler, tmp_path, _functions.echo, "foo")
    result = await _run(ElasticAgent(spec))
    assert not result.is_failed()
    assert result.return_values == {0: "foo", 1: "foo"}


async def test_check_master_addr_port_override(
    solo_handlers: HandlerFactory, tmp_path: Path
) -> None:
    (handler,) = solo_handlers(1, 1, 1)
    spec = command_spec(handler, tmp_path, nproc=1, master_addr="test_host", master_port=42)
    result = await _run(ElasticAgent(spec))
    assert not result.is_failed()
    env = worker_envs(tmp_path)[0]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("test_host", "42")


async def test_run_check_env_function(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    (handler,) = solo_handlers(1, 1, 1)
    result = await _run(ElasticAgent(command_spec(handler, tmp_path, nproc=1)))
    assert not result.is_failed()
    env = worker_envs(tmp_path)[0]
    assert [name for name in TORCH_ENV if name not in env] == []


@pytest.mark.parametrize(("given", "expected"), [("0", "0"), (None, "1")], ids=["set", "default"])
async def test_run_check_nccl_async_error_handling_env(
    solo_handlers: HandlerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    given: str | None,
    expected: str,
) -> None:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` of the agent's environment is honoured; ``1``
    when unset."""
    if given is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", given)
    (handler,) = solo_handlers(1, 1, 1)
    result = await _run(ElasticAgent(command_spec(handler, tmp_path, nproc=1)))
    assert not result.is_failed()
    assert worker_envs(tmp_path)[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == expected


@pytest.mark.parametrize("name", ["TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT"])
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
async def test_run_agent_local_watchdog_and_healthcheck_setup(
    solo_handlers: HandlerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    enabled: bool,
) -> None:
    """``run_agent_local_watchdog_setup_*`` and ``run_agent_healthcheck_setup_*``: the
    variable set for the agent reaches its workers; unset, the workers have none."""
    if enabled:
        value = str(tmp_path / "watchdog_timer") if "TIMER" in name else str(free_port())
        monkeypatch.setenv(name, value)
    else:
        monkeypatch.delenv(name, raising=False)
    (handler,) = solo_handlers(1, 1, 1)
    result = await _run(ElasticAgent(command_spec(handler, tmp_path, nproc=1, max_restarts=2)))
    assert not result.is_failed()
    assert (name in worker_envs(tmp_path)[0]) is enabled


async def test_run_sad_function(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Error propagation: both workers raise; the first failure is rank 0 or 1, exit code 1,
    with the message of the error file its worker wrote."""
    (handler,) = solo_handlers(1, 1, 1)
    result = await _run(ElasticAgent(function_spec(handler, tmp_path, _functions.sad_function)))
    assert result.is_failed()
    failure = result.root_cause
    assert failure is not None
    assert failure.global_rank in {0, 1} and failure.local_rank in {0, 1}
    assert failure.exitcode == 1
    assert "sad because i throw" in failure.message
    data = failure.error_file_data["message"]
    assert "sad because i throw" in data["message"]
    assert int(data["extraInfo"]["timestamp"]) > 0


async def test_run_bipolar_function(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Odd ranks fail every time: the restarts are spent, the group FAILED."""
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, "fail_odd", nproc=4, max_restarts=2))
    result = await _run(agent)
    assert result.is_failed()
    assert agent.restart_count == 2
    assert agent.get_worker_group().state is WorkerState.FAILED


async def test_rank_restart_after_failure(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """``fail_rank_one_once``: rank 1 is killed (SIGKILL) once; the restart succeeds."""
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, "kill_rank1_once", max_restarts=3))
    result = await _run(agent)
    assert not result.is_failed()
    assert agent.restart_count == 1


async def test_run_with_custom_log_lines(
    solo_handlers: HandlerFactory, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``log_line_prefix_template`` prefixes each teed line of the workers."""
    (handler,) = solo_handlers(1, 1, 1)
    spec = command_spec(
        handler,
        tmp_path,
        "print",
        role="sum",
        tee=Std.ALL,
        log_line_prefix_template="[${role_name}-${local_rank}:${rank}]:",
    )
    result = await _run(ElasticAgent(spec))
    assert not result.is_failed()
    out = capfd.readouterr().out
    for rank in (0, 1):
        assert re.search(rf"^\[sum-{rank}:{rank}\]:\s?creating {rank}$", out, re.M), out


# -- several agents, on each backend ---------------------------------------------------------


async def _job(
    handlers: HandlerFactory, tmp_path: Path, nodes: list[dict[str, Any]], **conf: Any
) -> list[tuple[RunResult, dict[int, dict[str, str]]]]:
    """One agent per entry of ``nodes`` (``command_spec`` arguments), run together."""
    made = handlers(len(nodes), len(nodes), len(nodes), **conf)
    agents = []
    for index, (handler, node) in enumerate(zip(made, nodes, strict=True)):
        out = tmp_path / str(index)
        out.mkdir()
        node = dict(node)
        mode = node.pop("mode", "ok")
        args = node.pop("args", ())
        agents.append((ElasticAgent(command_spec(handler, out, mode, *args, **node)), out))
    results = await asyncio.wait_for(asyncio.gather(*(a.run() for a, _ in agents)), RUN)
    return [(result, worker_envs(out)) for result, (_, out) in zip(results, agents, strict=True)]


async def test_run_distributed_sum_homogeneous(
    agent_handlers: HandlerFactory, tmp_path: Path
) -> None:
    """Two agents of two workers: ranks 0..3, one world."""
    done = await _job(agent_handlers, tmp_path, [{"role": "sum"}, {"role": "sum"}])
    ranks: set[int] = set()
    for result, envs in done:
        assert not result.is_failed()
        assert {env["WORLD_SIZE"] for env in envs.values()} == {"4"}
        ranks |= set(envs)
    assert ranks == set(range(4))


async def test_correct_rank_assignment_heterogeneous(
    agent_handlers: HandlerFactory, tmp_path: Path
) -> None:
    """Also ``run_distributed_sum_heterogeneous``: agents of different sizes and roles; the
    global ranks are 0..n-1, each role's ranks 0..m-1, an agent's ranks consecutive."""
    nodes = [
        {"role": "master", "nproc": 2},
        {"role": "trainer", "nproc": 1},
        {"role": "trainer", "nproc": 3},
        {"role": "ps", "nproc": 1},
    ]
    done = await _job(agent_handlers, tmp_path, nodes)
    role_sizes = {"master": 2, "trainer": 4, "ps": 1}
    ranks: list[int] = []
    role_ranks: dict[str, list[int]] = {}
    for (result, envs), node in zip(done, nodes, strict=True):
        assert not result.is_failed()
        role = node["role"]
        mine = sorted((int(env["RANK"]), int(env["ROLE_RANK"])) for env in envs.values())
        for env in envs.values():
            assert env["ROLE_NAME"] == role
            assert int(env["WORLD_SIZE"]) == sum(role_sizes.values())
            assert int(env["ROLE_WORLD_SIZE"]) == role_sizes[role]
        for column in (0, 1):
            values = [pair[column] for pair in mine]
            assert values == list(range(values[0], values[0] + len(values)))
        ranks += [pair[0] for pair in mine]
        role_ranks.setdefault(role, []).extend(pair[1] for pair in mine)
    assert sorted(ranks) == list(range(sum(role_sizes.values())))
    for role, size in role_sizes.items():
        assert sorted(role_ranks[role]) == list(range(size))


async def test_no_exit_barrier_on_failure(agent_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Odd ranks fail while even ones sleep 20 s; with no restarts, both agents end at once
    (torch: both raise ``ChildFailedError``) instead of waiting at the exit barrier (300 s).
    An agent here ends with its FAILED result, or with the ``RendezvousError`` of a run the
    other agent's failure closed, when that close reached it before its own worker's exit."""
    made = agent_handlers(2, 2, 2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    agents = []
    for index, handler in enumerate(made):
        out = tmp_path / str(index)
        out.mkdir()
        spec = command_spec(handler, out, "fail_odd", "20", exit_barrier_timeout=300.0)
        agents.append(ElasticAgent(spec))
    ends = await asyncio.wait_for(
        asyncio.gather(*(a.run() for a in agents), return_exceptions=True), RUN
    )
    for end in ends:
        assert isinstance(end, RendezvousError) or (isinstance(end, RunResult) and end.is_failed())
    assert any(isinstance(end, RunResult) for end in ends)
    assert loop.time() - started < 15


@pytest.mark.parametrize("barrier", [4.0, 0.0], ids=["workers_drift_success", "workers_drift_fail"])
async def test_workers_drift(
    agent_handlers: HandlerFactory, tmp_path: Path, barrier: float
) -> None:
    """Two agents whose workers end a second apart both succeed, whether the exit barrier
    waits for the other (4 s) or not at all (0 s: the barrier's timeout never fails the job)."""
    nodes = [
        {"nproc": 1, "mode": "sleep", "args": ("0",), "exit_barrier_timeout": barrier},
        {"nproc": 1, "mode": "sleep", "args": ("1",), "exit_barrier_timeout": barrier},
    ]
    done = await _job(agent_handlers, tmp_path, nodes)
    assert [result.state for result, _ in done] == [WorkerState.SUCCEEDED] * 2
