"""torch's ``test/distributed/elastic/agent/server/test/api_test.py``: the agent's types
and its loop (rendezvous, ranks, start, restart, membership change), against aelastic's
:class:`~aelastic.agent.ElasticAgent` with real worker processes (``_worker.py``).

torch tests its ``SimpleElasticAgent`` with mocked workers and a mocked monitor; here the
same situations come from real workers: a run that stays healthy then succeeds, workers
that fail until the restarts run out, a node joining a running job. The agents run in the
test's event loop. The scenarios of several nodes run on each backend; those of one node
run on the memory backend only (a one-node rendezvous goes the same way on every backend,
and the multi-node scenarios cover each backend's).

Ported (14 scenarios): ``WorkerStateTest`` (1), ``WorkerGroupTest`` (1),
``SimpleElasticAgentTest``: the constructor, ``test_rendezvous`` and its two
``master_addr`` variants (3), ``test_initialize_workers``, ``test_restart_workers``,
``test_run_happy_path``, ``test_run_initialization_failure``,
``test_run_max_retries_exceeded``, ``test_run_membership_change``,
``test_assign_worker_ranks`` (the rendezvous's placements from the members' joins, turned
into workers by :func:`aelastic.agent.loop.ranks.workers_of`, with torch's table),
``test_agent_process_handler_graceful_exception``. Not ported: ``RoleInstanceInfoTest``
(torch's private record and its serialization: aelastic's members say their role and size in
their joins, ``tests/agent/test_ranks.py``),
``test_record_flakiness_metric*``, ``test_record_metrics_*``, ``test_invoke_run``,
``test_get_event``, ``test_get_worker_status_event`` (torch's ``put_metric`` and
``events.record``: aelastic's metrics and events differ, docs/torch-api.md "Events, metrics"),
``test_run_unknown_state`` (a monitor result no real worker gives) and
``test_agent_process_signal_exception`` (the launcher's signals: ``test_launcher_api.py``).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import anyio
import pytest

from aelastic.agent import ElasticAgent, WorkerGroup, WorkerSpec, WorkerState
from aelastic.agent.loop.ranks import workers_of
from aelastic.core.machine import step
from aelastic.core.params import Rules
from aelastic.core.state import Op, Request, RunState
from aelastic.rendezvous import NodeDesc

from ._agents import attempts, command_spec, worker_envs, written
from ._functions import happy_function
from .conftest import HandlerFactory

pytestmark = pytest.mark.anyio

#: A bound for one agent's run of quick workers on a loaded two-core machine.
RUN = 60.0


def test_is_running() -> None:
    for state in WorkerState:
        running = state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)
        assert WorkerState.is_running(state) is running


async def test_worker_group_constructor(solo_handlers: HandlerFactory) -> None:
    (handler,) = solo_handlers(1, 1, 1)
    spec = WorkerSpec(
        role="test_trainer",
        local_world_size=4,
        rdzv_handler=handler,
        entrypoint=happy_function,
        args=(),
        max_restarts=50,
        monitor_interval=0.1,
    )
    group = WorkerGroup(spec)
    assert group.state is WorkerState.INIT
    assert len(group.workers) == 4
    assert {w.local_rank for w in group.workers} == set(range(4))
    for worker in group.workers:
        assert (worker.global_rank, worker.world_size, worker.id) == (-1, -1, None)
    assert group.group_rank is None and group.store is None


async def test_agent_constructor(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, max_restarts=1))
    assert agent.get_worker_group().state is WorkerState.INIT
    assert agent.restart_count == 0  # torch: _remaining_restarts == max_restarts


@pytest.mark.parametrize("local_addr", [None, "127.0.0.1"], ids=["default", "local_addr"])
async def test_rendezvous(
    solo_handlers: HandlerFactory, tmp_path: Path, local_addr: str | None
) -> None:
    """One agent: group rank 0 of 1, MASTER_ADDR its address (the FQDN by default,
    ``test_rendezvous_default_master_addr``; the spec's ``local_addr`` when given,
    ``test_rendezvous_master_addr_with_local_addr``), a port, ranks ``0..n-1``."""
    (handler,) = solo_handlers(1, 1, 1)
    spec = command_spec(handler, tmp_path, nproc=3, local_addr=local_addr)
    result = await asyncio.wait_for(ElasticAgent(spec).run(), RUN)
    assert result.state is WorkerState.SUCCEEDED
    envs = worker_envs(tmp_path)
    assert sorted(envs) == [0, 1, 2]
    expected_addr = local_addr or socket.getfqdn()
    for rank, env in envs.items():
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert (env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), "3")
        assert env["MASTER_ADDR"] == expected_addr
        assert int(env["MASTER_PORT"]) > 0


async def test_initialize_workers(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Once started, the group is HEALTHY and each worker's ``id`` is its process."""
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, "sleep", "1"))
    task = asyncio.ensure_future(agent.run())
    try:
        await written(tmp_path, 2)
        group = agent.get_worker_group()
        assert group.state is WorkerState.HEALTHY
        ids = [w.id for w in group.workers]
        assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == 2
        assert [w.global_rank for w in group.workers] == [0, 1]
        result = await asyncio.wait_for(task, RUN)
        assert result.state is WorkerState.SUCCEEDED
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_restart_workers(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Workers that fail twice are restarted (each time with ranks) and then succeed."""
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, "fail_until", "2", max_restarts=3))
    result = await asyncio.wait_for(agent.run(), RUN)
    assert result.state is WorkerState.SUCCEEDED
    assert agent.restart_count == 2
    assert attempts(tmp_path) == {0, 1, 2}
    assert sorted(worker_envs(tmp_path, 2)) == [0, 1]  # (a failed attempt's may be cut short)


async def test_run_happy_path(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Healthy workers that succeed: no restart spent."""
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, "sleep", "0.3", max_restarts=10))
    result = await asyncio.wait_for(agent.run(), RUN)
    assert result.state is WorkerState.SUCCEEDED and not result.failures
    assert agent.restart_count == 0


async def test_run_initialization_failure(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Workers that cannot be started: the agent's ``run`` raises."""
    (handler,) = solo_handlers(1, 1, 1)
    spec = command_spec(handler, tmp_path)
    spec.entrypoint = str(tmp_path / "no-such-program")
    agent = ElasticAgent(spec)
    with pytest.raises(OSError):
        await asyncio.wait_for(agent.run(), RUN)


async def test_run_max_retries_exceeded(solo_handlers: HandlerFactory, tmp_path: Path) -> None:
    """Workers that always fail: started ``max_restarts + 1`` times, then FAILED."""
    (handler,) = solo_handlers(1, 1, 1)
    agent = ElasticAgent(command_spec(handler, tmp_path, "fail_odd", max_restarts=3))
    result = await asyncio.wait_for(agent.run(), RUN)
    assert result.state is WorkerState.FAILED and result.is_failed()
    assert agent.get_worker_group().state is WorkerState.FAILED
    assert agent.restart_count == 3
    assert attempts(tmp_path) == {0, 1, 2, 3}


async def test_run_membership_change(agent_handlers: HandlerFactory, tmp_path: Path) -> None:
    """A node waiting to join (``num_nodes_waiting() > 0``) restarts the running workers
    into a bigger group without spending a restart; all succeed."""
    first, second = agent_handlers(2, 1, 2, last_call_timeout=0.1)
    out1, out2 = tmp_path / "first", tmp_path / "second"
    out1.mkdir(), out2.mkdir()
    spec = command_spec(first, out1, "sleep_alone", "60", nproc=1, max_restarts=1)
    running = ElasticAgent(spec)
    task = asyncio.ensure_future(running.run())
    try:
        assert (await written(out1, 1))[0]["WORLD_SIZE"] == "1"
        joining = ElasticAgent(command_spec(second, out2, "ok", nproc=1, max_restarts=1))
        joined = await asyncio.wait_for(joining.run(), RUN)
        result = await asyncio.wait_for(task, RUN)
        assert result.state is joined.state is WorkerState.SUCCEEDED
        assert {env["WORLD_SIZE"] for env in worker_envs(out1).values()} == {"2"}
        assert running.restart_count == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_assign_worker_ranks() -> None:
    """torch's table: five agents of two roles, their workers' local, role and global ranks
    and world sizes."""
    roles = [("parameter_server", 4), ("trainer", 1), ("trainer", 2), ("trainer", 3)]
    roles.append(("parameter_server", 5))
    state, rules = RunState("e"), Rules(len(roles), len(roles), 1, 60_000)
    placements = {}
    for i, (role, size) in enumerate(roles):  # host0 ... host4: ranks 0 ... 4
        node, secret = NodeDesc(f"host{i}", 1, 0), f"{i:032d}"
        join = Request(Op.JOIN, node, rules, secret=secret, role=role, local_world_size=size)
        step(state, join, 1_000)
    for i in range(len(roles)):
        node, secret = NodeDesc(f"host{i}", 1, 0), f"{i:032d}"
        reply = step(state, Request(Op.JOIN, node, rules, secret=secret), 1_001)
        assert reply.rank == i and reply.placement is not None
        placements[i] = reply.placement
    out = [
        [
            (w.local_rank, w.role_rank, w.global_rank, w.world_size, w.role_world_size)
            for w in workers_of(placements[group_rank], roles[group_rank][1])
        ]
        for group_rank in range(len(roles))
    ]
    assert out == [
        [(0, 0, 0, 15, 9), (1, 1, 1, 15, 9), (2, 2, 2, 15, 9), (3, 3, 3, 15, 9)],
        [(0, 0, 4, 15, 6)],
        [(0, 1, 5, 15, 6), (1, 2, 6, 15, 6)],
        [(0, 3, 7, 15, 6), (1, 4, 8, 15, 6), (2, 5, 9, 15, 6)],
        [
            *[(0, 4, 10, 15, 9), (1, 5, 11, 15, 9), (2, 6, 12, 15, 9), (3, 7, 13, 15, 9)],
            (4, 8, 14, 15, 9),
        ],
    ]


async def test_agent_process_handler_graceful_exception(
    agent_handlers: HandlerFactory, tmp_path: Path
) -> None:
    """An agent whose node stood by as redundant when the run closed returns (the
    rendezvous' graceful exit), it does not raise."""
    member, spare = agent_handlers(2, 1, 1)
    await member.next_rendezvous()
    out = tmp_path / "spare"
    out.mkdir()
    agent = ElasticAgent(command_spec(spare, out))
    task = asyncio.ensure_future(agent.run())
    with anyio.fail_after(RUN):
        while True:
            snapshot = await member.backend.snapshot()
            if snapshot is not None and snapshot.redundancy_list:
                break
            await anyio.sleep(0.02)
    await member.set_closed()
    result = await asyncio.wait_for(task, RUN)
    assert result.state is WorkerState.SUCCEEDED and not worker_envs(out)
