"""A launcher killed with SIGKILL leaves nothing running: workers, their children, standbys.

The kernel's parent-death signal gives each worker and warm standby SIGKILL; the guardian
SIGKILLs what is left of each worker's process group, then exits. No grace: nobody runs the
node any more, and a worker that traps SIGTERM would keep its peers' collectives open.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ._proc import Cli, alive

# A worker with a child in its process group; ``--ignore-term`` makes the worker deaf to
# SIGTERM (as a worker whose handler goes on training).
FAMILY = """
import os, signal, subprocess, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
os.write(1, f"worker pid={os.getpid()} child={child.pid}\\n".encode())
time.sleep(600)
"""

#: Generous bounds: the machine may be loaded.
BOUND = 60.0


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (forked by any of its threads)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fp:
                found.extend(int(p) for p in fp.read().split())
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fp:
            return [a.decode(errors="replace") for a in fp.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _running(pid: int, program: str) -> list[int]:
    """Children of ``pid`` running ``program`` (a script name in their command line)."""
    return [c for c in _children(pid) if any(a.endswith(program) for a in _cmdline(c))]


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = BOUND) -> None:
    """Look at ``condition`` until it holds (processes we cannot await: not our children)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout:g} s")
        time.sleep(0.05)


def _gone(pids: Iterable[int]) -> Callable[[], bool]:
    wanted = list(pids)
    return lambda: not [pid for pid in wanted if alive(pid)]


def _family(cli: Cli, count: int) -> tuple[list[int], list[int]]:
    """The worker pids and their children's, once ``count`` workers reported and the agent
    said it started them (it has announced them to its guardian by then)."""
    cli.wait_for(lambda lines: len(re.findall(r"worker pid=", "\n".join(lines))) == count)
    cli.wait_for(lambda lines: any(re.search(r"started \d+ workers? \(pid", ln) for ln in lines))
    found = re.findall(r"worker pid=(\d+) child=(\d+)", cli.output)
    return [int(w) for w, _ in found], [int(c) for _, c in found]


def _kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigkilled_launcher_leaves_no_worker_child_or_standby(tmp_path: Path) -> None:
    (tmp_path / "family.py").write_text(textwrap.dedent(FAMILY))
    with Cli(["run", "--nproc-per-node", "2", "family.py"], tmp_path) as cli:
        agent = cli.proc.pid
        workers, children = _family(cli, 2)
        _wait_until(lambda: len(_running(agent, "_standby.py")) == 2, "2 warm standbys up")
        standbys = _running(agent, "_standby.py")
        guardians = _running(agent, "_guard.py")
        assert len(guardians) == 1
        everything = [*workers, *children, *standbys, *guardians]
        assert all(alive(pid) for pid in everything)
        try:
            os.kill(agent, signal.SIGKILL)
            assert cli.wait(BOUND) == -signal.SIGKILL
            _wait_until(_gone(everything), "gone: workers, their children, standbys, guardian")
        finally:
            _kill_all(everything)


def test_a_worker_ignoring_sigterm_is_killed_at_once_not_after_the_grace(
    tmp_path: Path,
) -> None:
    (tmp_path / "family.py").write_text(textwrap.dedent(FAMILY))
    args = ["run", "--shutdown-timeout", "120", "--no-warm-standby", "family.py", "--ignore-term"]
    with Cli(args, tmp_path) as cli:
        workers, children = _family(cli, 1)
        try:
            killed = time.monotonic()
            os.kill(cli.proc.pid, signal.SIGKILL)
            cli.wait(BOUND)
            _wait_until(_gone([*workers, *children]), "gone: the worker and its child")
            assert time.monotonic() - killed < 30  # far from the grace period (120 s)
        finally:
            _kill_all([*workers, *children])


def test_without_the_guardian_the_kernel_still_stops_workers_and_standbys(
    tmp_path: Path,
) -> None:
    (tmp_path / "family.py").write_text(textwrap.dedent(FAMILY))
    with Cli(["run", "--nproc-per-node", "2", "family.py"], tmp_path) as cli:
        agent = cli.proc.pid
        workers, children = _family(cli, 2)
        _wait_until(lambda: len(_running(agent, "_standby.py")) == 2, "2 warm standbys up")
        standbys = _running(agent, "_standby.py")
        try:
            for guardian in _running(agent, "_guard.py"):
                os.kill(guardian, signal.SIGKILL)
            os.kill(agent, signal.SIGKILL)
            # The parent-death signal reaches the workers and the standbys themselves; the
            # workers' children need the guardian (killed here): they are the test's to end
            # (they also hold the launcher's output pipe open).
            _wait_until(_gone([*workers, *standbys]), "gone: workers and standbys")
        finally:
            _kill_all([*workers, *children, *standbys])
        cli.wait(BOUND)
