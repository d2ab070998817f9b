"""torch's file-timer protocol served on the agent's loop: requests from torch's own client,
expiry, who gets reaped, and the named pipe's lifetime."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from aelastic.agent.processes.timer import FILE_VAR, FileTimerServer, parse_request

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the loop run (the server reads when the pipe is readable) until ``predicate``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never met"
        await asyncio.sleep(0.01)


@pytest.fixture
def owned() -> list[int]:
    """The pids the test server counts as its workers'."""
    return []


@pytest.fixture
async def server(owned: list[int]) -> AsyncIterator[FileTimerServer]:
    watchdog = FileTimerServer(lambda pid: pid in owned, env={})
    watchdog.start()
    try:
        yield watchdog
    finally:
        watchdog.close()


@pytest.fixture
def sleeper() -> Any:
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def state(path: Path) -> str:
    """What is at ``path``: ``fifo <mode>``, ``dir``, ``missing`` or ``other``."""
    if not path.exists():
        return "missing"
    if path.is_fifo():
        return f"fifo {oct(path.stat().st_mode & 0o777)}"
    return "dir" if path.is_dir() else "other"


def client(path: str, sig: int = signal.SIGKILL) -> Any:
    timer = pytest.importorskip("torch.distributed.elastic.timer")
    return timer.FileTimerClient(path, sig)


def test_requests_decode_as_torch_writes_them() -> None:
    timer = pytest.importorskip("torch.distributed.elastic.timer")
    line = timer.FileTimerRequest(123, "train.py#10", 1.5e9, signal.SIGKILL).to_json()
    request = parse_request(line.encode())
    assert (request.pid, request.scope_id, request.expiration_time, request.signal) == (
        123,
        "train.py#10",
        1.5e9,
        signal.SIGKILL,
    )
    release = timer.FileTimerRequest(123, "train.py#10", -1, 0).to_json()
    assert parse_request(release.encode()).is_release


@pytest.mark.parametrize(
    "line",
    [b"not json", b"[1]", b'{"pid": 1}', b'{"pid": "1", "scope_id": "s", "expiration_time": 1}'],
)
def test_bad_requests_are_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_request(line)


async def test_torchs_client_acquires_and_releases(server: FileTimerServer) -> None:
    timers = client(server.path)
    timers.acquire("step", time.time() + 600)
    await until(lambda: (os.getpid(), "step") in server.timers)
    timers.release("step")
    await until(lambda: not server.timers)


async def test_a_bad_line_does_not_stop_the_server(server: FileTimerServer) -> None:
    fd = os.open(server.path, os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, b"garbage\n")
    os.close(fd)
    client(server.path).acquire("after", time.time() + 600)
    await until(lambda: (os.getpid(), "after") in server.timers)


async def test_an_expired_timer_kills_its_worker_with_its_signal(
    server: FileTimerServer, owned: list[int], sleeper: Any
) -> None:
    worker = sleeper()
    owned.append(worker.pid)
    request = {"version": 1, "pid": worker.pid, "scope_id": "s", "expiration_time": time.time()}
    request["signal"] = int(signal.SIGKILL)
    server.handle(json.dumps(request).encode())
    assert await asyncio.to_thread(worker.wait, 30) == -signal.SIGKILL
    assert server.reaped == {worker.pid: "s"} and not server.timers


async def test_an_expiry_fires_at_its_time_without_polling(
    server: FileTimerServer, owned: list[int], sleeper: Any
) -> None:
    worker = sleeper()
    owned.append(worker.pid)
    acquired = time.time()
    line = {"pid": worker.pid, "scope_id": "s", "expiration_time": acquired + 0.3, "signal": 9}
    server.handle(json.dumps(line).encode())
    await asyncio.to_thread(worker.wait, 30)
    assert time.time() - acquired >= 0.3


async def test_no_signal_or_a_foreign_pid_is_not_reaped(
    server: FileTimerServer, owned: list[int], sleeper: Any
) -> None:
    mine, foreign = sleeper(), sleeper()
    owned.append(mine.pid)
    past = time.time() - 1
    for pid, sig in ((mine.pid, 0), (foreign.pid, int(signal.SIGKILL))):
        line = {"pid": pid, "scope_id": "s", "expiration_time": past, "signal": sig}
        server.handle(json.dumps(line).encode())
    await until(lambda: not server.timers)  # expired and dropped...
    assert not server.reaped  # ...and nobody killed
    assert mine.poll() is None and foreign.poll() is None


async def test_the_pipe_and_its_directory_are_removed_on_close() -> None:
    watchdog = FileTimerServer(lambda pid: False, env={})
    watchdog.start()
    path = Path(watchdog.path)
    assert state(path) == "fifo 0o600" and state(path.parent) == "dir"
    watchdog.close()
    assert state(path) == state(path.parent) == "missing"


async def test_the_agents_timer_file_is_used_when_given(tmp_path: Path) -> None:
    given = tmp_path / "timer"
    given.write_text("stale")  # torch removes whatever is there
    watchdog = FileTimerServer(lambda pid: False, env={FILE_VAR: str(given)})
    watchdog.start()
    assert watchdog.path == str(given) and state(given) == "fifo 0o600"
    watchdog.close()
    assert state(given) == "missing" and state(tmp_path) == "dir"


def test_enabled_only_by_1() -> None:
    assert FileTimerServer.enabled({"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    assert not FileTimerServer.enabled({"TORCHELASTIC_ENABLE_FILE_TIMER": "true"})
    assert not FileTimerServer.enabled({})
