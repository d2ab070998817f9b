"""A warm standby's worker prints an uncaught error as a cold start does: the user's frames
only (none of the standby's), exit code 1, and SIGINT's death for KeyboardInterrupt."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aelastic.agent import WorkerSpec
from aelastic.agent.processes.standby import Standby, launch_of

from .helpers import make_handler

pytestmark = pytest.mark.anyio

SCRIPT = """
import os
def step():
    raise {error}("attempt " + os.environ["RANK"])
step()
"""


@pytest.mark.parametrize(("error", "code"), [("RuntimeError", 1), ("KeyboardInterrupt", None)])
async def test_a_warm_workers_traceback_is_a_cold_ones(
    tmp_path: Path, error: str, code: int | None
) -> None:
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT.format(error=error))
    cold = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(script)],
        env={**os.environ, "RANK": "3"},
        capture_output=True,
    )
    launch = launch_of(WorkerSpec("t", 1, make_handler("tb"), sys.executable, (str(script),)))
    assert launch is not None
    standby = Standby(launch, dict(os.environ), 0)
    err = tmp_path / "err.txt"
    fd = os.open(err, os.O_WRONLY | os.O_CREAT)
    try:
        proc = standby.release({**os.environ, "RANK": "3"}, [], [None, fd])
    finally:
        os.close(fd)
    warm_code = await asyncio.wait_for(proc.wait(), 30)
    proc.close()
    assert err.read_bytes() == cold.stderr
    assert "standby" not in err.read_text() and f"{error}: attempt 3" in err.read_text()
    expected = -signal.SIGINT if code is None else code
    assert warm_code == cold.returncode == expected
