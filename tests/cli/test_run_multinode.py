"""`aelastic run` on several nodes (launcher processes) over Redis and HTTP, without torch.

A node that dies (SIGKILL to its launcher and worker) makes the survivor re-form the group
alone; a node that arrives late makes the running one re-form a bigger group. The workers
finish as soon as they see the world size the test waits for.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._proc import Cli, alive

# Prints its world; exits 0 once the world has the size given as argument, else waits.
WORKER = """
import os, sys, time
world = int(os.environ["WORLD_SIZE"])
print(f"worker pid={os.getpid()} world={world} rank={os.environ['RANK']}", flush=True)
if world != int(sys.argv[1]):
    time.sleep(120)
"""

# Meets its peer at MASTER_ADDR:MASTER_PORT, as a collective would: rank 1 retries until rank 0
# listens (a dead rank 0 keeps it there until its agent re-forms the group).
PEERS = """
import os, socket, time
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
print(f"worker pid={os.getpid()} world={world} rank={rank}", flush=True)
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    server = socket.create_server((addr, port))
    server.settimeout(120)
    server.accept()[0].recv(1)
else:
    while True:
        try:
            socket.create_connection((addr, port), timeout=1).sendall(b"x")
            break
        except OSError:
            time.sleep(0.1)
print("met my peer", flush=True)
"""


@pytest.fixture(params=["http", "redis"])
def rendezvous(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if request.param == "http":
        pytest.importorskip("aiohttp")
        from tests._http_server import HttpServer

        with HttpServer() as server:
            yield "http", server.endpoint
    else:
        pytest.importorskip("redis")
        from tests._redis_server import RedisServer

        with RedisServer() as server:
            yield "redis", server.url


def _node(
    tmp_path: Path,
    rendezvous: tuple[str, str],
    run_id: str,
    want_world: int,
    last_call: float = 0.5,
) -> Cli:
    backend, endpoint = rendezvous
    return Cli(
        [
            "run",
            "--nnodes=1:2",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf=last_call_timeout={last_call:g},keep_alive_interval=0.3,"
            "keep_alive_max_attempt=3",
            "--local-addr=127.0.0.1",
            "--max-restarts=3",
            "worker.py",
            str(want_world),
        ],
        tmp_path,
    )


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fp:
            return [int(p) for p in fp.read().split()]
    except OSError:
        return []


def _has(text: str):  # type: ignore[no-untyped-def]
    return lambda lines: any(text in line for line in lines)


def test_survivor_reforms_the_group(
    tmp_path: Path, rendezvous: tuple[str, str], run_id: str
) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    # Both start together and form one round: a node alone would end at once (its worker
    # wants a world of 1), so the last call leaves room for a loaded machine's slow start.
    with (
        _node(tmp_path, rendezvous, run_id, 1, last_call=4) as a,
        _node(tmp_path, rendezvous, run_id, 1, last_call=4) as b,
    ):
        a.wait_for(_has("world=2"))
        b.wait_for(_has("world=2"))
        worker_b = _children(b.proc.pid)
        for pid in [b.proc.pid, *worker_b]:  # node B loses power
            os.kill(pid, signal.SIGKILL)
        b.wait(30)
        assert a.wait(60) == 0, a.output
    assert "node(s) lost" in a.output
    assert re.search(r"world=1 rank=0", a.output)
    assert not [pid for pid in worker_b if alive(pid)]


def test_late_node_scales_the_group_up(
    tmp_path: Path, rendezvous: tuple[str, str], run_id: str
) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    with _node(tmp_path, rendezvous, run_id, 2) as a:
        a.wait_for(_has("world=1"))
        with _node(tmp_path, rendezvous, run_id, 2) as b:
            assert b.wait(60) == 0, b.output
            assert a.wait(60) == 0, a.output
    assert "node(s) waiting to join" in a.output or "rescaling" in a.output, a.output
    assert "world=2" in a.output and "world=2" in b.output


def test_a_member_stopped_as_the_round_completes_then_killed_never_hangs_the_others(
    tmp_path: Path, rendezvous: tuple[str, str], run_id: str
) -> None:
    """The lower-pid node is frozen (SIGSTOP) just before the last call ends, so the round
    completes with it, then it is killed: the survivor learns its rank from its own join,
    sees the frozen member lost within the heartbeat window, and forms a group with a new
    node. Nothing waits for the dead member's store keys past that."""
    import asyncio
    import time

    from aelastic import RendezvousParameters
    from aelastic.backends import create_backend

    backend_name, endpoint = rendezvous
    (tmp_path / "worker.py").write_text(textwrap.dedent(PEERS))
    conf = "--rdzv-conf=last_call_timeout=3,keep_alive_interval=0.5,keep_alive_max_attempt=3"

    def node() -> Cli:
        return Cli(
            [
                "run", "--nnodes=2:3", f"--rdzv-backend={backend_name}",
                f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", conf,
                "--local-addr=127.0.0.1", "--max-restarts=3", "worker.py", "2",
            ],
            tmp_path,
        )  # fmt: skip

    async def last_call_left() -> float:
        params = RendezvousParameters(backend_name, endpoint, run_id, 2, 3)
        backend = create_backend(params)
        try:
            for _ in range(600):
                snap = await backend.snapshot()
                if snap is not None and snap.status.deadline_ms is not None:
                    return (snap.status.deadline_ms - snap.status.now_ms) / 1000
                await asyncio.sleep(0.02)
            raise AssertionError("the last call never started")
        finally:
            await backend.aclose()

    with node() as a, node() as b:
        left = asyncio.run(last_call_left())
        time.sleep(max(left - 0.3, 0.0))
        frozen, survivor = (a, b) if a.proc.pid < b.proc.pid else (b, a)
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        time.sleep(0.5)  # the round completes with the frozen node in it
        for pid in [frozen.proc.pid, *_children(frozen.proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        frozen.wait(30)
        started = time.monotonic()
        with node() as c:
            assert survivor.wait(60) == 0, survivor.output
            assert c.wait(60) == 0, c.output
        # heartbeat window (1.5 s) + last call (3 s), with room for a loaded machine
        assert time.monotonic() - started < 40
    assert "world=2" in survivor.output and "world=2" in c.output
    assert "met my peer" in survivor.output and "met my peer" in c.output


def test_nodes_with_other_keep_alive_settings_get_a_clear_error_not_a_livelock(
    tmp_path: Path, rendezvous: tuple[str, str], run_id: str
) -> None:
    """One agent with 1 s keep-alives made the run; one with 5 s joins it: it exits at once
    naming both windows (they once evicted each other forever), and the first node's group
    never re-forms because of it."""
    backend, endpoint = rendezvous
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))

    def node(interval: int) -> Cli:
        return Cli(
            [
                "run", "--nnodes=1:2", f"--rdzv-backend={backend}",
                f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
                f"--rdzv-conf=last_call_timeout=0.5,keep_alive_interval={interval}",
                "--local-addr=127.0.0.1", "--max-restarts=3", "worker.py", "2",
            ],
            tmp_path,
        )  # fmt: skip

    with node(1) as first:
        first.wait_for(_has("world=1"))
        with node(5) as other:
            assert other.wait(60) != 0, other.output
        first.kill()
    assert "heartbeat window is 15 s (keep_alive_interval 5 x keep_alive_max_attempt 3)" in (
        other.output
    )
    assert f"run '{run_id}' was created with 3 s" in other.output
    assert first.output.count("world=") == 1, first.output  # never re-formed
