"""Run an example (or the ``aelastic`` command) in a subprocess from the repository root."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start(args: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``python <args>`` in the repository root, in a session of its own, its stdout
    and stderr merged; the environment is this one without its ``PET_*`` variables, plus
    ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 100) -> tuple[int, str]:
    """(exit code, output) of a process :func:`start` started; if it outlives ``timeout``
    (kept below pytest's own timeout), its whole process group is killed and the test fails
    with its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"{proc.args} still running after {timeout} s; output:\n{out}"
        ) from None
    assert " is hung: " not in out and "hung: no " not in out, f"a hang reported:\n{out}"
    return proc.returncode, out


def run(
    args: Sequence[str], timeout: float = 100, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """``python <args>`` in the repository root; (exit code, stdout and stderr merged).

    The example runs in its own session; if it outlives ``timeout`` (kept below pytest's
    own timeout), its whole process group is killed and the test fails with its output.
    ``env`` is added to the environment (whose ``PET_*`` variables are dropped). Hang
    detection is on by default: an example whose worker is called hung fails too.
    """
    return finish(start(args, env), timeout)
