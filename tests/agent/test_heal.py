"""A job that heals itself, with real worker processes (no torch; the gloo runs are in
test_gloo_heal.py): a hung worker found and named, the job's root cause the same on every
node, a flapping host quarantined, a job-wide restart budget, a bound on unkillable workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aelastic.agent import (
    ElasticAgent,
    JobFailure,
    NodeQuarantined,
    RunResult,
    WorkerSpec,
    WorkerStalled,
    WorkerState,
)
from aelastic.agent.health.check import PORT_VAR
from aelastic.cli.event_log import event_record
from aelastic.cli.status import format_health, read_health
from aelastic.core.errors import RendezvousClosedError
from aelastic.core.events import Event
from aelastic.core.health import FailureRecord
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._ports import free_port

from .helpers import make_handler
from .test_health import probe

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

HEAL_WORKER = str(Path(__file__).with_name("heal_worker.py"))
STUCK_LINE = next(
    n
    for n, line in enumerate(Path(HEAL_WORKER).read_text().splitlines(), 1)
    if "stuck line" in line
)


def heal_spec(
    handler: DynamicRendezvousHandler, tmp_path: Path, mode: str, *args: str, **kw: Any
) -> WorkerSpec:
    kw.setdefault("stop_grace_period", 5.0)
    env = {"HEAL_DIR": str(tmp_path), **kw.pop("env", {})}
    return WorkerSpec(
        "trainer",
        kw.pop("nproc", 1),
        handler,
        sys.executable,
        (HEAL_WORKER, mode, *args),
        env=env,
        **kw,
    )


def recorder(agent: ElasticAgent) -> list[Event]:
    events: list[Event] = []
    agent.add_listener(events.append)
    return events


@contextlib.asynccontextmanager
async def started(*agents: ElasticAgent) -> AsyncIterator[list[asyncio.Task[RunResult]]]:
    tasks = [asyncio.ensure_future(a.run()) for a in agents]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_hung_worker_is_named_with_its_stuck_line_and_the_group_restarts(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv(PORT_VAR, str(port))
    handler = make_handler(run_id)
    timeout = 1.0
    spec = heal_spec(
        handler,
        tmp_path,
        "hang",
        "1",
        nproc=2,
        stall_timeout=timeout,
        max_restarts=1,
        log_dir=str(tmp_path / "logs"),
    )
    agent = ElasticAgent(spec)
    events = recorder(agent)
    probes: list[asyncio.Task[bytes]] = []
    agent.add_listener(
        lambda e: (
            probes.append(asyncio.ensure_future(probe(port)))
            if isinstance(e, WorkerStalled)
            else None
        )
    )
    result = await asyncio.wait_for(agent.run(), 60)
    assert result.state is WorkerState.SUCCEEDED and agent.restart_count == 1
    [stalled] = [e for e in events if isinstance(e, WorkerStalled)]
    assert stalled.global_rank == 1 and stalled.host == handler.node.addr
    assert stalled.where == f"{HEAL_WORKER}:{STUCK_LINE} in stuck_in_step" and stalled.steps == 5
    hung_at = float((tmp_path / "hang").read_text())
    assert timeout - 0.2 <= stalled.at - hung_at < timeout + 5.0
    stacks = Path(stalled.stacks_file).read_text()  # noqa: ASYNC240 - a small local file
    assert "hung: no progress" in stacks and "in stuck_in_step" in stacks
    assert stalled.stacks_file.startswith(str(tmp_path / "logs"))
    logged = json.loads(json.dumps(event_record(stalled)))  # what --event-log writes
    assert logged["kind"] == "worker_stalled" and "in stuck_in_step" in logged["stacks"]
    answer = await probes[0]
    assert answer.startswith(b"HTTP/1.1 503") and b'"alive": false' in answer
    [failure] = [e for e in events if isinstance(e, JobFailure)]
    root = FailureRecord.from_json(dict(failure.root))
    assert root.stalled and root.rank == 1 and "stuck at" in root.summary()
    assert (await read_health(handler.backend))[0] == agent.job_health


async def test_every_node_reads_the_same_root_cause_and_status_shows_it(
    run_id: str, tmp_path: Path
) -> None:
    """Node 1's worker raises ValueError without @record: node 0 (whose worker did nothing
    wrong) shows that message, node 1's host and rank; so does ``aelastic status``."""
    a = ElasticAgent(
        heal_spec(make_handler(run_id, 2, 2, local_addr="127.0.0.1"), tmp_path, "until_alone")
    )
    b = ElasticAgent(
        heal_spec(make_handler(run_id, 2, 2, local_addr="127.0.0.2"), tmp_path, "raise")
    )
    events_a = recorder(a)
    async with started(a, b) as (task_a, task_b):
        assert (await task_b).is_failed()
        with pytest.raises(RendezvousClosedError):
            await task_a
    [seen] = [e for e in events_a if isinstance(e, JobFailure)]
    root = FailureRecord.from_json(dict(seen.root))
    assert (root.host, root.rank, root.node_rank) == ("127.0.0.2", 1, 1)
    assert "ValueError: the data shard of rank 1 is corrupt" in root.summary()
    assert seen.failed_nodes == 1
    health, failed = await read_health(a.spec.rdzv_handler.backend)
    text = format_health(health, failed)
    assert (
        "rank 1 (local rank 0) on host 127.0.0.2 (node rank 1) failed with exit code 1: "
        "ValueError: the data shard of rank 1 is corrupt" in text
    )
    assert "Traceback (most recent call last)" in text  # the message follows


async def test_a_host_that_keeps_failing_is_quarantined_while_the_others_go_on(
    run_id: str, tmp_path: Path
) -> None:
    conf = {"last_call_timeout": 2.0}
    good = ElasticAgent(
        heal_spec(
            make_handler(run_id, 1, 2, local_addr="127.0.0.1", **conf),
            tmp_path,
            "until_alone",
            max_restarts=5,
            quarantine_after=2,
        )
    )
    bad = ElasticAgent(
        heal_spec(
            make_handler(run_id, 1, 2, local_addr="127.0.0.2", **conf),
            tmp_path,
            "raise",
            max_restarts=5,
            quarantine_after=2,
        )
    )
    events = recorder(bad)
    async with started(good, bad) as (task_good, task_bad):
        with pytest.raises(NodeQuarantined, match=r"127\.0\.0\.2 is quarantined: the job's root"):
            await task_bad
        result = await task_good
    assert result.state is WorkerState.SUCCEEDED
    assert bad.restart_count == 1  # failed twice: restarted once, then set aside
    health = good.job_health or bad.job_health
    assert health is not None and dict(health.quarantined) == {
        "127.0.0.2": "the job's root cause 2 times in a row"
    }
    assert [e.kind.value for e in events if e.kind.value == "quarantined"] == ["quarantined"]
    status = format_health(*await read_health(good.spec.rdzv_handler.backend))
    assert "quarantined (1):\n  127.0.0.2: the job's root cause 2 times in a row" in status


async def test_two_nodes_failing_in_turn_stop_at_the_job_wide_budget(
    run_id: str, tmp_path: Path
) -> None:
    conf = {"last_call_timeout": 2.0}
    nodes = [
        ElasticAgent(
            heal_spec(
                make_handler(run_id, 2, 2, local_addr=f"127.0.0.{i + 1}", **conf),
                tmp_path,
                "turns",
                str(i),
                max_restarts=10,
                job_max_restarts=3,
            )
        )
        for i in range(2)
    ]
    events = [recorder(n) for n in nodes]
    async with started(*nodes) as tasks:
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    made = list(tmp_path.glob("failed.*"))  # noqa: ASYNC240 - the run is over
    assert len(made) == 4  # 3 restarts, then the stop
    failed = [o for o in outcomes if isinstance(o, RunResult)]
    closed = [o for o in outcomes if isinstance(o, RendezvousClosedError)]
    assert len(failed) == 1 and failed[0].is_failed() and len(closed) == 1, outcomes
    assert all(n.restart_count <= 2 for n in nodes)  # no node spent its own budget
    spent = [e for ev in events for e in ev if isinstance(e, JobFailure) and e.budget_spent]
    assert {e.node for e in spent} == {str(n.spec.rdzv_handler.node) for n in nodes}
    assert all(e.incidents == 4 and e.job_max_restarts == 3 for e in spent)  # every node says


# A callable under fork (torch's start method): the forked worker counts its progress too.
FORK_PROGRAM = """
import os, time
import aelastic.worker
from aelastic.launcher import LaunchConfig, elastic_launch

def stuck_in_step():
    time.sleep(600)

def train():
    for _ in range(3):
        aelastic.worker.progress()
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        stuck_in_step()
    return int(os.environ["RANK"])

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="fork-hang",
                      max_restarts=1, start_method="fork", stall_timeout=1.0)
print("returned", elastic_launch(config, train)())
"""


def test_a_callable_forked_from_the_launcher_is_watched_too(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-"],
        input=FORK_PROGRAM,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "returned {0: 0, 1: 1}" in done.stdout
    assert "worker rank 1 on " in done.stderr and "in stuck_in_step" in done.stderr


async def test_a_node_waiting_in_a_collective_lets_the_hung_peer_act_first(
    run_id: str, tmp_path: Path
) -> None:
    """Node A's worker waits in a collective for node B's, which hangs by itself: B is named
    and restarts (a restart spent); A waits one more timeout, sees B go, and re-forms
    without spending one."""
    fake = tmp_path / "torch" / "distributed" / "c10d.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import time\ndef all_reduce():\n    time.sleep(600)\n")
    conf = {"last_call_timeout": 1.0}
    # B hangs a second after A: A sees its stall first (2 s), then waits 2 s more, while
    # B's stall (3 s) is acted on.
    env = {"HEAL_COLLECTIVE": str(fake), "HEAL_LATER": "1.0"}
    common: dict[str, Any] = {"stall_timeout": 2.0, "max_restarts": 1, "env": env}
    waiting = ElasticAgent(
        heal_spec(
            make_handler(run_id, 2, 2, local_addr="127.0.0.1", **conf),
            tmp_path,
            "hang_once",
            "collective",
            **common,
        )
    )
    hung = ElasticAgent(
        heal_spec(
            make_handler(run_id, 2, 2, local_addr="127.0.0.2", **conf),
            tmp_path,
            "hang_once",
            "own",
            **common,
        )
    )
    events_waiting, events_hung = recorder(waiting), recorder(hung)
    async with started(waiting, hung) as tasks:
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(r.state is WorkerState.SUCCEEDED for r in results)
    assert (waiting.restart_count, hung.restart_count) == (0, 1)
    # A's stall, when seen before B's restart reached it (a loaded machine may delay it):
    # named as waiting in a collective, and not acted on.
    for peer in [e for e in events_waiting if isinstance(e, WorkerStalled)]:
        assert peer.in_collective and peer.waiting_for_peer and "in all_reduce" in peer.where
    [culprit] = [e for e in events_hung if isinstance(e, WorkerStalled)]
    assert not culprit.in_collective and "stuck_in_step" in culprit.where
    health = waiting.job_health or hung.job_health
    assert health is not None and health.latest is not None
    assert health.latest.root.host == "127.0.0.2" and health.incidents_total == 1


@pytest.mark.parametrize("timeout", [1.0, 3.0])
async def test_a_stopped_rank_is_the_root_cause_never_the_peer_waiting_for_it(
    run_id: str, tmp_path: Path, timeout: float
) -> None:
    """Node B's worker stops itself (SIGSTOP: no stacks can be taken from it) a step after
    node A's began to wait for it in a collective, so A's stall is seen first. Whatever the
    stall timeout (shorter than the 5 s a dump may take, or not), B is the suspect: its
    worker is stopped at once and named the job's root cause; A's waits for it."""
    fake = tmp_path / "torch" / "distributed" / "c10d.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import time\ndef all_reduce():\n    time.sleep(600)\n")
    conf = {"last_call_timeout": 1.0}
    env = {"HEAL_COLLECTIVE": str(fake), "HEAL_LATER": "0.5"}
    common: dict[str, Any] = {"stall_timeout": timeout, "max_restarts": 1, "env": env}
    waiting = ElasticAgent(
        heal_spec(
            make_handler(run_id, 2, 2, local_addr="127.0.0.1", **conf),
            tmp_path,
            "hang_once",
            "collective",
            **common,
        )
    )
    frozen = ElasticAgent(
        heal_spec(
            make_handler(run_id, 2, 2, local_addr="127.0.0.2", **conf),
            tmp_path,
            "hang_once",
            "stopped",
            **common,
        )
    )
    events_waiting, events_frozen = recorder(waiting), recorder(frozen)
    async with started(waiting, frozen) as tasks:
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(r.state is WorkerState.SUCCEEDED for r in results)
    assert (waiting.restart_count, frozen.restart_count) == (0, 1)
    [culprit] = [e for e in events_frozen if isinstance(e, WorkerStalled)]
    assert culprit.stopped and not culprit.stacks and not culprit.waiting_for_peer
    assert timeout <= culprit.idle < timeout + 4.0  # not the 5 s a dump may be given
    for peer in [e for e in events_waiting if isinstance(e, WorkerStalled)]:
        assert peer.in_collective and peer.waiting_for_peer and not peer.stopped
    assert frozen.job_health is not None  # A read it too if it had a failure of its own
    for health in filter(None, (waiting.job_health, frozen.job_health)):
        assert health.latest is not None
        root = health.latest.root
        assert (root.host, root.stalled, root.secondary) == ("127.0.0.2", True, False)
        assert "the process is stopped" in root.message and health.incidents_total == 1


@pytest.mark.parametrize("busy", [0.0, 2.0])
async def test_workers_stopped_together_for_a_stall_are_all_failures_the_stuck_one_first(
    run_id: str, tmp_path: Path, busy: float
) -> None:
    """Local rank 0 waits in a collective for local rank 1, which hangs by itself a moment
    later: rank 0 is seen first and waited on (it waits for a peer), then both are stopped
    together, both are failures of the attempt, and the root cause is rank 1. Also when
    rank 1 went on making progress for longer than rank 0's wait for its peer (``busy``: a
    worker late to start on a loaded machine): rank 1's own deadline is awaited."""
    fake = tmp_path / "torch" / "distributed" / "c10d.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import time\ndef all_reduce():\n    time.sleep(600)\n")
    spec = heal_spec(
        make_handler(run_id),
        tmp_path,
        "hang_pair",
        nproc=2,
        stall_timeout=1.5,
        max_restarts=1,
        env={"HEAL_COLLECTIVE": str(fake), "HEAL_PAIR_BUSY": str(busy)},
    )
    agent = ElasticAgent(spec)
    events = recorder(agent)
    result = await asyncio.wait_for(agent.run(), 60)
    assert result.state is WorkerState.SUCCEEDED and agent.restart_count == 1
    exited = [e.global_rank for e in events if e.kind.value == "worker_exited" and e.attempt == 0]
    assert sorted(exited) == [0, 1]  # both reaped before the decision
    stalls = [e for e in events if isinstance(e, WorkerStalled)]
    assert [(e.global_rank, e.waiting_for_peer) for e in stalls] == [
        (0, True),
        (0, False),
        (1, False),
    ]
    [failure] = [e for e in events if isinstance(e, JobFailure)]
    assert failure.root["rank"] == 1 and "stuck_in_step" in failure.root["message"]
