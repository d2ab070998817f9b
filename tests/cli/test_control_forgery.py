"""The job's control state cannot be forged, with real agents: a two-node job over
``aelastic serve`` (with a token), Redis or etcd while a client that holds the store's
credentials but is not a member forges, at each attempt, everything an older aelastic
trusted or could be asked:

* in the members' store (which every token holder can write): a health record that sets a
  member's host aside and blames it for a made-up incident of round 10^6 with a spent
  restart budget, rank assignments giving group rank 1's worker ``RANK 0`` and a master
  address of the forger's choosing for this round and the next ones, and the exit
  barrier's "all done" for them;
* through the rendezvous: a failure report, a quarantine, a "done", a leave and a
  keep-alive naming each member without its secret, and a stranger's failure report and
  "done".

None of it changes anything: the ranks and the master address are the rendezvous's, the one
real failure costs one restart of a budget of one and is the root cause, nobody is set
aside, and the node that finishes first waits at the exit barrier for its peer's worker.
"""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic import RendezvousParameters
from aelastic.backends.registry import create_backend
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.state import NodeDesc, Op, Outcome, Request

from ._proc import Cli, run_cli

pytestmark = pytest.mark.timeout(240)

TOKEN = "control-forgery-token-0123456789"
FORGED = "f0" * 16

WORKER = """
import os, pathlib, sys, time
here = pathlib.Path(os.environ["FORGE_DIR"])
# Phase 0 until the real failure, 1 after it (a peer's restart re-forms the group: the
# other node's worker starts again too, without a restart of its own).
rank, phase = int(os.environ["RANK"]), int((here / "failed").exists())
print(f"worker rank {rank} of {os.environ['WORLD_SIZE']} group {os.environ['GROUP_RANK']} "
      f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} phase {phase}",
      flush=True)
(here / f"started-{phase}-{os.environ['GROUP_RANK']}").touch()
while not (here / f"forged-{phase}").exists():
    time.sleep(0.05)
if phase == 0 and rank == 1:
    print("failing for real", flush=True)
    (here / "failed").touch()
    sys.exit(7)
if rank == 0:
    time.sleep(3)  # the slow one: its peer waits for it at the exit barrier
print(f"rank {rank} finished", flush=True)
"""


def _old_health(host: str) -> bytes:
    """What an older aelastic kept in the store and trusted: a forged incident."""
    root = {
        "time": 0.0, "host": host, "node": f"{host}_1_0", "node_rank": 0, "rank": 0,
        "local_rank": 0, "exitcode": 1, "message": "forged root cause", "round": 10**6,
        "stalled": False, "secondary": False,
    }  # fmt: skip
    incident = {"round": 10**6, "streak": 5, "root": root}
    doc = {
        "format": "aelastic.job.health/1", "incidents_total": 99, "incidents": [incident],
        "quarantined": {host: "forged"}, "lost": {host: [9, 10**6]},
    }  # fmt: skip
    return json.dumps(doc).encode()


def _assignment(rank: int) -> bytes:
    doc = {
        "format": "aelastic.agent.assignment/1", "ranks": [rank, 2, rank], "role_world_size": 2,
        "local_world_size": 1, "master": ["10.66.6.6", 1],
    }  # fmt: skip
    return json.dumps(doc).encode()


async def _forge(backend_name: str, endpoint: str, run_id: str) -> list[str]:
    """Every forgery once; what the rendezvous answered to the checked ones."""
    conf = {"token": TOKEN} if backend_name == "http" else {}
    params = RendezvousParameters(backend_name, endpoint, run_id, 1, 2, **conf)
    backend = create_backend(params)
    answers = []
    try:
        snapshot = await backend.snapshot()
        assert snapshot is not None and snapshot.rules is not None and snapshot.status.complete
        rules, round_ = snapshot.rules, snapshot.status.round
        members = [e.node for e in snapshot.participants]
        await backend.kv_set("job/health", _old_health(members[0].addr))
        for ahead in range(round_, round_ + 4):
            for group_rank in range(2):
                await backend.kv_set(f"r{ahead}/agent/assignment/{group_rank}", _assignment(0))
            await backend.kv_set(f"r{ahead}/agent/all-done", b"1")
            await backend.kv_set(f"r{ahead}/agent/finished", b"2")
        failure = NodeReport(
            failure=FailureReport(time=0.0, rank=0, local_rank=0, exitcode=1, message="forged")
        )
        quarantine = NodeReport(quarantine="forged")
        stranger = NodeDesc("10.66.6.6", 666, 0)
        requests = [
            Request(op, node, rules, secret=FORGED, report=report)
            for node in members
            for op, report in [
                (Op.REPORT, failure), (Op.REPORT, quarantine), (Op.DONE, None),
                (Op.LEAVE, None), (Op.KEEP_ALIVE, None),
            ]
        ] + [
            Request(Op.REPORT, stranger, rules, secret=FORGED, report=failure),
            Request(Op.REPORT, stranger, rules, secret=FORGED, report=quarantine),
            Request(Op.DONE, stranger, rules, secret=FORGED),
        ]  # fmt: skip
        for request in requests:
            reply = await backend.apply(request)
            answers.append(f"{request.op.value} {request.node}: {reply.outcome.value}")
            assert reply.outcome in (Outcome.ERROR_FORBIDDEN, Outcome.FINISH), answers[-1]
            assert not reply.known and reply.transition.value in ("none", "prune"), answers[-1]
    finally:
        await backend.aclose()
    return answers


def _wait_for(path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.fixture(params=["http", "redis", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(backend, endpoint) of a real server: ``aelastic serve`` with a token, Redis, etcd."""
    if request.param == "http":
        from tests._http_server import HttpServer

        with HttpServer(token=TOKEN) as server:
            yield "http", server.endpoint
    elif request.param == "redis":
        from tests._redis_server import RedisServer

        with RedisServer() as redis_server:
            yield "redis", redis_server.url
    else:
        from tests._etcd_server import EtcdServer

        with EtcdServer() as etcd_server:
            yield "etcd", etcd_server.endpoint


def test_a_token_holder_forges_the_control_state_and_nothing_changes(
    tmp_path: Path, run_id: str, store: tuple[str, str]
) -> None:
    backend_name, endpoint = store
    (tmp_path / "train.py").write_text(textwrap.dedent(WORKER))
    env = {"FORGE_DIR": str(tmp_path), "AELASTIC_HTTP_TOKEN": TOKEN}
    where = [
        f"--rdzv-backend={backend_name}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"
    ]  # fmt: skip

    def node(addr: str) -> Cli:
        args = ["run", "--nnodes=2", *where, f"--local-addr={addr}"]
        args += ["--rdzv-conf=last_call_timeout=0.5,keep_alive_interval=1"]
        args += ["--max-restarts=1", "--job-max-restarts=1", "--quarantine-after=2"]
        return Cli([*args, "train.py"], tmp_path, env)

    with node("127.0.0.2") as first, node("127.0.0.3") as second:
        answers = []
        for attempt in (0, 1):
            _wait_for(tmp_path / f"started-{attempt}-0")
            _wait_for(tmp_path / f"started-{attempt}-1")
            answers += asyncio.run(_forge(backend_name, endpoint, run_id))
            (tmp_path / f"forged-{attempt}").touch()
        assert first.wait(120) == 0, first.output
        assert second.wait(120) == 0, second.output
    code, status = run_cli(["status", *where, "--json"], tmp_path, env)
    out = first.output + "\n" + second.output
    worlds = re.findall(r"worker rank (\d) of 2 group (\d) master (\S+):\d+ phase (\d)", out)
    assert {(r, g, m) for r, g, m, _ in worlds} == {
        ("0", "0", "127.0.0.2"),
        ("1", "1", "127.0.0.2"),
    }, out  # every start of every phase: the rendezvous's ranks, group rank 0's address
    assert out.count("failing for real") == 1
    assert {p for *_, p in worlds} == {"0", "1"}
    assert "rank 0 finished" in first.output and "rank 1 finished" in second.output
    # The node that finished first waited at the exit barrier for its peer's slow worker.
    barrier = re.search(r"every node finished \(exit barrier took ([\d.]+) (ms|s)\)", second.output)
    assert barrier is not None and barrier.group(2) == "s" and float(barrier.group(1)) > 1.5
    assert "forged" not in out and "10.66.6.6" not in out and "quarantined" not in out, out
    assert code == 0, status
    health = json.loads(status)["health"]
    assert health["incidents_total"] == 1 and not health["quarantined"], health
    root = health["incidents"][-1]["root"]
    assert (root["host"], root["rank"], root["exitcode"]) == ("127.0.0.3", 1, 7), root
    assert all(answer.endswith(("error_forbidden", "finish")) for answer in answers)
