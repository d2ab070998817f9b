"""The signal that stops an agent reaches its workers as that same signal (torchrun's
forwarding): ``forward_signal`` for embedders, handlers in ``run_sync`` only."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aelastic.agent import ElasticAgent

from ..cli._proc import cli_env, signals_as
from .helpers import WORKER, WorkerHub, make_handler, running, worker_spec

pytestmark = pytest.mark.timeout(120)

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def recorded(directory: Path, nproc: int) -> list[str]:
    return [(directory / str(rank)).read_text() for rank in range(nproc)]


@pytest.mark.anyio
async def test_an_embedded_run_installs_no_handler_and_forwards_what_it_is_told(
    run_id: str, tmp_path: Path
) -> None:
    before = {sig: signal.getsignal(sig) for sig in HANDLED}
    async with WorkerHub() as hub:
        spec = worker_spec(make_handler(run_id), hub, "record_signal", 2, str(tmp_path))
        agent = ElasticAgent(spec)
        async with running(agent) as task:
            await hub.gather(2)
            assert {sig: signal.getsignal(sig) for sig in HANDLED} == before
            agent.forward_signal(signal.SIGHUP)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert recorded(tmp_path, 2) == ["SIGHUP", "SIGHUP"]


SCRIPT = """
import os, signal, sys
from aelastic.agent import ElasticAgent, SignalException, WorkerSpec
from aelastic.rendezvous import RendezvousParameters, create_handler

handler = create_handler(RendezvousParameters("memory", "sync", "sync-run", 1, 1))
spec = WorkerSpec("w", 2, handler, sys.executable, ({worker!r}, "record_signal", {dir!r}),
                  env={{"AELASTIC_TEST_HUB": sys.argv[1]}}, stop_grace_period=30)
{own}
try:
    ElasticAgent(spec).run_sync()
except SignalException as exc:
    print("SignalException", exc.sigval.name, flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


async def _run_sync_stopped_by(
    sigs: list[signal.Signals], tmp_path: Path, own: str = "", env: dict[str, str] | None = None
) -> list[str]:
    """Run SCRIPT, send ``sigs`` once its workers are up (each after the previous one's
    line, if it prints one), and return its output lines."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(SCRIPT).format(worker=WORKER, dir=str(tmp_path), own=own))
    lines: list[str] = []
    async with WorkerHub() as hub:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            hub.env["AELASTIC_TEST_HUB"],
            stdout=subprocess.PIPE,
            env=cli_env(env),
            preexec_fn=signals_as(),  # the stop signals at their default, whatever ours are
        )
        assert proc.stdout is not None
        try:
            await hub.gather(2)
            for index, sig in enumerate(sigs):
                proc.send_signal(sig)
                if index < len(sigs) - 1:
                    lines.append((await asyncio.wait_for(proc.stdout.readline(), 60)).decode())
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return [line.strip() for line in [*lines, *out.decode().splitlines()] if line.strip()]


@pytest.mark.anyio
@pytest.mark.parametrize("sig", HANDLED, ids=lambda s: s.name)
async def test_run_sync_forwards_the_signal_it_received(
    tmp_path: Path, sig: signal.Signals
) -> None:
    out = await _run_sync_stopped_by([sig], tmp_path)
    assert out == ["KeyboardInterrupt" if sig == signal.SIGINT else f"SignalException {sig.name}"]
    assert recorded(tmp_path, 2) == [sig.name, sig.name]


@pytest.mark.anyio
async def test_run_sync_handles_the_signals_it_is_told(tmp_path: Path) -> None:
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGHUP,SIGUSR1"}
    assert await _run_sync_stopped_by([signal.SIGUSR1], tmp_path, env=env) == [
        "SignalException SIGUSR1"
    ]
    assert recorded(tmp_path, 2) == ["SIGUSR1", "SIGUSR1"]


@pytest.mark.anyio
async def test_run_sync_leaves_a_handler_of_the_program_alone(tmp_path: Path) -> None:
    own = "signal.signal(signal.SIGHUP, lambda sig, frame: print('own handler', flush=True))"
    out = await _run_sync_stopped_by([signal.SIGHUP, signal.SIGTERM], tmp_path, own=own)
    assert out == ["own handler", "SignalException SIGTERM"]
    assert recorded(tmp_path, 2) == ["SIGTERM", "SIGTERM"]  # SIGHUP was not forwarded
