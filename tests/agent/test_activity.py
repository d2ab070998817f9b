"""A worker seen from outside (``/proc``): real processes that sleep, compute, write, or wait
while a child of theirs computes (a data loader's worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aelastic.agent.health import activity
from aelastic.agent.health.activity import CPU_SHARE, IO_RATE, Activity, busy, sample

pytestmark = pytest.mark.timeout(60)

SLEEPS = "import time; print('ready', flush=True); time.sleep(60)"
COMPUTES = "print('ready', flush=True)\nwhile True: sum(range(1000))"
WRITES = """
import os, sys, time
print('ready', flush=True)
with open(sys.argv[1], 'wb') as f:
    while True:
        f.write(os.urandom(64 * 1024)); f.flush(); time.sleep(0.05)
"""
PARENT_OF_A_WORKER = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', {COMPUTES!r}], stdout=subprocess.PIPE)
child.stdout.readline()
print('ready', flush=True)
time.sleep(60)
"""


@contextmanager
def started(code: str, *args: str) -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _worked(pid: int, seconds: float = 2.0) -> bool:
    before = sample(pid)
    time.sleep(seconds)
    after = sample(pid)
    assert after.processes >= 1
    return busy(before, after, seconds)


def test_the_verdict_on_two_samples() -> None:
    idle = Activity(cpu=1.0, io=1000, disk=False, processes=1)
    assert not busy(idle, Activity(1.0 + CPU_SHARE * 4 * 0.9, 1000, False, 1), 4.0)
    assert busy(idle, Activity(1.0 + CPU_SHARE * 4 * 1.1, 1000, False, 1), 4.0)
    assert not busy(idle, Activity(1.0, 1000 + IO_RATE * 3, False, 1), 4.0)
    assert busy(idle, Activity(1.0, 1000 + IO_RATE * 5, False, 1), 4.0)
    assert busy(idle, Activity(1.0, 1000, True, 1), 4.0)  # waiting for the disk


def test_a_sleeping_process_is_idle_and_a_computing_or_writing_one_is_not(
    tmp_path: Path,
) -> None:
    with started(SLEEPS) as pid:
        assert not _worked(pid)
    with started(COMPUTES) as pid:
        assert _worked(pid)
    with started(WRITES, str(tmp_path / "checkpoint")) as pid:
        assert _worked(pid)


@pytest.mark.parametrize("children_listed", [True, False])
def test_a_process_whose_child_computes_is_not_idle(
    children_listed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the kernel's children lists (CONFIG_PROC_CHILDREN), the parents are read.
    monkeypatch.setattr(activity, "_HAS_CHILDREN", children_listed and activity._HAS_CHILDREN)
    with started(PARENT_OF_A_WORKER) as pid:
        assert sample(pid).processes == 2
        assert _worked(pid)


def test_a_process_that_is_gone_reads_as_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert sample(proc.pid) == Activity(0.0, 0, False, 0)
