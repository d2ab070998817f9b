"""A worker whose script raised tells its agent before its interpreter's teardown.

Real parts: child interpreters started with aelastic's bootstrap first on ``PYTHONPATH`` (as
the agent starts every worker, no torch), the agent's in-place channel (its Unix socket).
Each child's teardown is made slow (an ``atexit`` handler that sleeps, as torch's can take
seconds), so the news must come before the exit to be seen at all.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aelastic.agent._inplace import InPlaceChannel
from aelastic.worker._inplace import ENV_SOCKET
from aelastic.worker._site import _aelastic_worker
from tests.agent.test_bootstrap import child_env

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: What gloo raises when a peer's process died (the message torch 2.x prints).
_GLOO = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
    "by peer [127.0.0.1]:41234"
)


def _start(
    tmp_path: Path, name: str, error: str, socket_path: str, linger: float = 30.0
) -> subprocess.Popen[str]:
    script = tmp_path / f"{name}.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import atexit, time
            atexit.register(time.sleep, {linger})  # a teardown that takes long
            def all_reduce():
                raise RuntimeError({error!r})
            all_reduce()
            """
        )
    )
    env = child_env({ENV_SOCKET: socket_path})
    return subprocess.Popen(
        [sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
    )


async def _until(check: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "never"
        await asyncio.sleep(0.02)


def test_the_bootstraps_socket_variable_is_the_agents() -> None:
    assert _aelastic_worker.ENV_AGENT_SOCKET == ENV_SOCKET


async def test_a_script_that_raised_in_a_collective_is_known_before_it_exits(
    tmp_path: Path,
) -> None:
    channel = InPlaceChannel()
    await channel.start()
    path = channel.env()[ENV_SOCKET]
    collective = _start(tmp_path, "collective", _GLOO.removeprefix("RuntimeError: "), path)
    own = _start(tmp_path, "own", "the shard is corrupt", path)
    children = [collective, own]
    processes: Any = [SimpleNamespace(pid=c.pid) for c in children]
    try:
        await _until(lambda: channel.raised_in_collective(processes) == [collective.pid])
        assert collective.poll() is None  # still in its teardown
        await _until(lambda: own.pid in channel._raised)
        assert channel.raised_in_collective(processes) == [collective.pid]  # not its own error
        assert "the shard is corrupt" in channel._raised[own.pid]
        # A pid that is not one of the attempt's workers is not listed; a new attempt forgets.
        assert channel.raised_in_collective([SimpleNamespace(pid=1)]) == []  # type: ignore[list-item]
        channel.forget()
        assert channel.raised_in_collective(processes) == []
    finally:
        for child in children:
            child.kill()
            _, stderr = child.communicate()
        await channel.aclose()
    assert "the shard is corrupt" in stderr  # the traceback printed as before


async def test_without_an_agent_socket_a_script_raises_as_before(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-agent" / "s")
    child = _start(tmp_path, "alone", "boom", missing, linger=0.0)
    try:
        _, stderr = child.communicate(timeout=45)
    finally:
        child.kill()
    assert child.returncode == 1
    assert "RuntimeError: boom" in stderr
    assert "aelastic" not in stderr  # nothing of the failed telling shows
