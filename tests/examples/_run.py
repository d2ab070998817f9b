"""Run an example (or the ``aelastic`` command) in a subprocess from the repository root."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args: Sequence[str], timeout: float = 100) -> tuple[int, str]:
    """``python <args>`` in the repository root; (exit code, stdout and stderr merged).

    The example runs in its own session; if it outlives ``timeout`` (kept below pytest's
    own timeout), its whole process group is killed and the test fails with its output.
    Hang detection is on by default: an example whose worker is called hung fails too.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{args} still running after {timeout} s; output:\n{out}") from None
    assert " is hung: " not in out and "hung: no " not in out, f"a hang reported:\n{out}"
    return proc.returncode, out
