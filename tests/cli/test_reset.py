"""Starting over: a finished job's id, ``aelastic status --reset`` and each backend's ``reset``."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from aelastic import RendezvousParameters
from aelastic.backends.registry import create_backend
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from tests._rendezvous_helpers import SECRET

from ._proc import cli_env, run_cli

# One write: under ``python -u`` each of print's pieces is a write of its own, and the
# agent's lines on the same pipe can come between them.
HELLO = "import os\nos.write(1, f\"hello rank {os.environ['RANK']}\\n\".encode())\n"


@pytest.fixture(params=["redis", "http", "etcd"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(backend, endpoint) of a real server of the test alone."""
    if request.param == "etcd":
        from tests._etcd_server import EtcdServer

        with EtcdServer() as etcd_server:
            yield "etcd", etcd_server.endpoint
    elif request.param == "redis":
        pytest.importorskip("redis")
        from tests._redis_server import RedisServer

        with RedisServer() as redis_server:
            yield "redis", redis_server.url
    else:
        pytest.importorskip("aiohttp")
        from tests._http_server import HttpServer

        with HttpServer() as http_server:
            yield "http", http_server.endpoint


def _cli_with_input(args: list[str], cwd: Path, text: str) -> tuple[int, str]:
    """``python -m aelastic <args>`` with ``text`` on its stdin; (exit code, output)."""
    done = subprocess.run(
        [sys.executable, "-m", "aelastic", *args],
        cwd=cwd,
        env=cli_env(),
        input=text,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_finished_jobs_run_is_deleted_by_reset_after_a_question(
    server: tuple[str, str], tmp_path: Path, run_id: str
) -> None:
    backend, endpoint = server
    (tmp_path / "hello.py").write_text(HELLO)
    job = ["run", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    # A 90 s heartbeat window: the closed run stays closed for 180 s, the whole test.
    job += ["--rdzv-conf", "keep_alive_interval=30", "--local-addr", "127.0.0.1", "hello.py"]
    code, out = run_cli(job, tmp_path, timeout=90)
    assert code == 0, out
    status = ["status", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint]
    reset = [*status, "--rdzv-id", run_id, "--reset"]

    # It shows the run, asks, and a "no" keeps it.
    code, out = _cli_with_input(reset, tmp_path, "n\n")
    assert code == 1, out
    assert re.search(rf"job '{re.escape(run_id)}' at \S+: round \d+, closed", out), out
    assert "delete its rendezvous state and store? [y/N]" in out and "nothing deleted" in out
    # No answer at all (no terminal, nothing on its input): it says what it needs.
    code, out = _cli_with_input(reset, tmp_path, "")
    assert code == 1 and "nothing deleted: no answer came" in out and "--yes" in out, out

    # A "yes" deletes it; the id works again at once (no waiting for it).
    code, out = _cli_with_input(reset, tmp_path, "y\n")
    assert code == 0, out
    assert "deleted the rendezvous state and store of job" in out, out
    code, out = run_cli(job, tmp_path, timeout=90)
    assert code == 0 and "waiting for the job id" not in out, out
    assert "hello rank 0" in out

    # --yes skips the question; an id with nothing stored has nothing to delete.
    code, out = run_cli([*status, "--rdzv-id", f"{run_id}-unused", "--reset", "--yes"], tmp_path)
    assert code == 0, out
    assert "no rendezvous state" in out and "had nothing to delete" in out, out


def test_the_same_job_run_again_at_once_waits_for_its_id_and_runs(
    server: tuple[str, str], tmp_path: Path, run_id: str
) -> None:
    """The everyday re-run (accelerate's fixed id ``none``): a job with a finished job's id,
    started at once, waits for the rest of the grace saying so, then runs."""
    backend, endpoint = server
    (tmp_path / "hello.py").write_text(HELLO)
    job = ["run", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    job += ["--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=3"]  # a 3 s window
    job += ["--local-addr", "127.0.0.1", "hello.py"]
    code, out = run_cli(job, tmp_path, timeout=90)
    assert code == 0, out
    code, out = run_cli(job, tmp_path, timeout=90)
    assert code == 0, out
    waited = re.search(r"waiting for the job id: .* free again in (\d+) s", out)
    assert waited is not None and 0 < int(waited.group(1)) <= 6, out
    assert "hello rank 0" in out


def test_close_closes_the_run_for_its_operator(
    server: tuple[str, str], tmp_path: Path, run_id: str
) -> None:
    backend, endpoint = server
    status = ["status", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint]
    status += ["--rdzv-id", run_id]
    code, out = run_cli([*status, "--close", "--yes"], tmp_path)
    assert code == 1 and "nothing to close" in out, out

    async def join() -> None:
        async with _backend(backend, endpoint, run_id) as b:
            await b.apply(_join(0))

    asyncio.run(join())
    code, out = _cli_with_input([*status, "--close"], tmp_path, "n\n")
    assert code == 1 and "nothing closed" in out, out
    code, out = run_cli([*status, "--close", "--yes"], tmp_path)
    assert code == 0 and f"closed job '{run_id}'" in out, out
    code, out = run_cli(status, tmp_path)
    assert code == 0 and "closed" in out.splitlines()[0], out
    code, out = run_cli([*status, "--close", "--yes"], tmp_path)
    assert code == 0 and "closed already" in out, out


def test_reset_flags_that_do_not_go_together(tmp_path: Path) -> None:
    args = ["status", "--rdzv-backend", "http", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id"]
    code, out = run_cli([*args, "j", "--reset", "--watch"], tmp_path)
    assert code == 2 and "--reset cannot be combined" in out, out


# -- each backend's reset(), against real servers --------------------------------------


@pytest.fixture(params=["memory", "redis", "http"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if request.param == "memory":
        yield "memory", "reset-tests"
    elif request.param == "redis":
        pytest.importorskip("redis")
        from tests._redis_server import RedisServer

        with RedisServer() as redis_server:
            yield "redis", redis_server.url
    else:
        pytest.importorskip("aiohttp")
        from tests._http_server import HttpServer

        with HttpServer() as http_server:
            yield "http", http_server.endpoint


def _join(index: int) -> Request:
    return Request(
        Op.JOIN, NodeDesc("10.1.2.3", 500 + index, 0), Rules(2, 2, 60_000, 60_000), secret=SECRET
    )


@asynccontextmanager
async def _backend(kind: str, where: str, run_id: str) -> AsyncIterator[Any]:
    backend = create_backend(RendezvousParameters(kind, where, run_id, 1, 1, read_timeout=30))
    try:
        yield backend
    finally:
        await backend.aclose()


@pytest.mark.anyio
async def test_backend_reset_forgets_one_run_and_wakes_its_waiters(
    endpoint: tuple[str, str], run_id: str
) -> None:
    kind, where = endpoint
    # Glob characters in the id: Redis's SCAN pattern must take them literally, and not
    # delete the neighbour whose id the unescaped pattern would match.
    run, neighbour_run = f"{run_id}*[1]?", f"{run_id}XX1Z"
    async with (
        _backend(kind, where, run) as backend,
        _backend(kind, where, run) as other_node,
        _backend(kind, where, neighbour_run) as neighbour,
    ):
        assert all(hasattr(b, "reset") for b in (backend, other_node, neighbour))
        reply = await backend.apply(_join(0))
        token = reply.status.token
        await backend.kv_set("key", b"value")
        await backend.kv_add("counter", 2)
        await neighbour.apply(_join(1))
        await neighbour.kv_set("key", b"kept")

        waiting = asyncio.ensure_future(other_node.wait_for_change(token, 60))
        await asyncio.sleep(0)
        assert await backend.reset() is True
        await asyncio.wait_for(waiting, 30)  # woken by the reset, not by its timeout

        assert await other_node.snapshot() is None
        assert await backend.kv_get(["key", "counter"]) == [None, None]
        assert await backend.reset() is False
        again = await backend.apply(_join(0))
        assert again.status.token.split(".")[0] != token.split(".")[0]  # a new epoch
        snapshot = await other_node.snapshot()
        assert snapshot is not None and len(snapshot.participants) == 1

        neighbour_state = await neighbour.snapshot()
        assert neighbour_state is not None and len(neighbour_state.participants) == 1
        assert await neighbour.kv_get(["key"]) == [b"kept"]
