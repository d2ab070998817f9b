"""One measured job of ``rdzv_scale.py``: worker processes, phases, and what they cost.

How it works: :func:`measure` starts the worker processes (``benchmarks/_scale_node.py``, or
torch's nodes), reads the JSON lines they print into a :class:`Job`, and drives the phases,
reading the server's counters at each boundary:

1. formation: every node calls ``next_rendezvous`` at the same wall-clock time; the phase ends
   when the last node returned (or ``timeout`` passed: "did not finish");
2. idle: after ``settle`` seconds, ``idle`` seconds while every node heartbeats and watches;
   any ``watch()`` return before the kill is a spurious membership change;
3. kill (optional): SIGKILL of the last worker, which hosts exactly one node; for every
   survivor, the time (wall clock, from the kill) until its ``watch()`` returned a view with
   that node lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._scale_servers import ROOT, Counters, ServerUnderTest, cpu_seconds

__all__ = ["Job", "busy_loops", "measure"]

_STARTUP_TIMEOUT = 300.0
_STATS_TIMEOUT = 30.0
_EXIT_TIMEOUT = 30.0
_LINE_LIMIT = 1 << 24


class Worker:
    """One worker process and its share of the nodes."""

    def __init__(self, index: int, count: int, process: asyncio.subprocess.Process) -> None:
        self.index = index
        self.count = count
        self.process = process
        self.alive = True
        self.killed = False


class Job:
    """The worker processes of one measured job and every event they reported."""

    def __init__(self, log_dir: Path, name: str) -> None:
        self.workers: list[Worker] = []
        self.ready: set[int] = set()
        self.formed: dict[tuple[int, int], dict[str, Any]] = {}
        self.failed: dict[tuple[int, int], dict[str, Any]] = {}
        self.watches: list[tuple[tuple[int, int], dict[str, Any]]] = []
        self.watch_errors: list[dict[str, Any]] = []
        self.stats: dict[int, dict[str, Any]] = {}
        self.log_paths: list[Path] = []
        self._log_dir = log_dir
        self._name = name
        self._changed = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    @property
    def nodes(self) -> int:
        return sum(w.count for w in self.workers)

    @property
    def died(self) -> list[int]:
        """Workers that exited without being told to (or killed)."""
        return [w.index for w in self.workers if not w.alive and not w.killed]

    async def spawn(self, counts: list[int], command: Callable[[int, int], list[str]]) -> None:
        for index, count in enumerate(counts):
            log_path = self._log_dir / f"{self._name}-w{index}.log"
            self.log_paths.append(log_path)
            with log_path.open("wb") as log:
                process = await asyncio.create_subprocess_exec(
                    *command(index, count),
                    cwd=ROOT,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    limit=_LINE_LIMIT,
                    env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
                )
            worker = Worker(index, count, process)
            self.workers.append(worker)
            self._readers.append(asyncio.ensure_future(self._read(worker)))

    async def _read(self, worker: Worker) -> None:
        assert worker.process.stdout is not None
        async for line in worker.process.stdout:
            try:
                self._feed(worker, json.loads(line))
            except ValueError:
                continue
            self._changed.set()
        worker.alive = False
        self._changed.set()

    def _feed(self, worker: Worker, event: dict[str, Any]) -> None:
        kind = event["ev"]
        key = (worker.index, event.get("i", -1))
        if kind == "ready":
            self.ready.add(worker.index)
        elif kind == "formed":
            self.formed[key] = event
        elif kind == "failed":
            self.failed[key] = event
        elif kind == "watch":
            self.watches.append((key, event))
        elif kind == "watch_error":
            self.watch_errors.append(event)
        elif kind == "stats":
            self.stats[worker.index] = event

    async def until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``done()`` holds; ``False`` if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def send(self, command: dict[str, Any]) -> None:
        line = (json.dumps(command) + "\n").encode()
        for worker in self.workers:
            if worker.alive and worker.process.stdin is not None:
                try:
                    worker.process.stdin.write(line)
                    await worker.process.stdin.drain()
                except (ConnectionError, OSError):
                    pass

    async def wakeups(self) -> int:
        """Wake-ups of every node so far (-1 if a worker cannot count them)."""
        self.stats.clear()
        alive = [w.index for w in self.workers if w.alive]
        await self.send({"cmd": "stats"})
        await self.until(lambda: all(i in self.stats for i in alive), _STATS_TIMEOUT)
        counts = [self.stats[i]["wakeups"] for i in alive if i in self.stats]
        if len(counts) < len(alive) or any(c < 0 for c in counts):
            return -1
        return sum(counts)

    def cpu(self) -> float:
        """CPU seconds the live worker processes used so far (the nodes' side)."""
        total = 0.0
        for worker in self.workers:
            if worker.alive and not worker.killed:
                with contextlib.suppress(OSError):
                    total += cpu_seconds(worker.process.pid)
        return total

    def kill(self, worker: Worker) -> None:
        worker.killed = True
        os.kill(worker.process.pid, signal.SIGKILL)

    async def stop(self) -> None:
        """Tell every worker to exit; kill what is left after a grace period."""
        await self.send({"cmd": "exit"})
        for worker in self.workers:
            if worker.process.stdin is not None:
                worker.process.stdin.close()
        await asyncio.wait(
            [asyncio.ensure_future(w.process.wait()) for w in self.workers],
            timeout=_EXIT_TIMEOUT,
        )
        for worker in self.workers:
            if worker.process.returncode is None:
                worker.process.kill()
        for worker in self.workers:
            await worker.process.wait()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    def log_issues(self) -> dict[str, Any]:
        """Tracebacks, errors and warnings the workers wrote to stderr."""
        lines: list[str] = []
        for path in self.log_paths:
            text = path.read_text(errors="replace") if path.exists() else ""
            lines += [
                ln.strip()
                for ln in text.splitlines()
                if any(w in ln for w in ("Traceback", "Error", "WARNING", "Warning", "warning"))
            ]
        samples = list(dict.fromkeys(lines))[:8]
        return {"lines": len(lines), "samples": samples}


def _per_node(counters: Counters, n: int, seconds: float = 1.0) -> dict[str, float | None]:
    scale = n * seconds
    return {
        "commands_per_node": None if counters.commands < 0 else counters.commands / scale,
        "operations_per_node": None if counters.operations < 0 else counters.operations / scale,
        "bytes_per_node": counters.bytes_out / scale,
        "connections_per_node": counters.connections / n,
        "server_cpu_s": counters.cpu,
    }


def _per_request(counters: Counters, seconds: float) -> dict[str, float | None]:
    """What one request (while idle: one heartbeat) cost the server, and how busy it was."""
    requests = counters.commands
    calls, usec = counters.script_calls, counters.script_usec
    return {
        "server_busy": counters.cpu / seconds,
        "server_cpu_us_per_request": counters.cpu / requests * 1e6 if requests > 0 else None,
        "bytes_per_request": counters.bytes_out / requests if requests > 0 else None,
        "script_calls": None if calls < 0 else calls,
        "script_us_per_call": usec / calls if calls > 0 else None,
    }


def _memory_per_node(now: Counters, empty: Counters, n: int) -> float | None:
    """The server's memory beyond what it used empty, per node (bytes)."""
    if now.memory < 0 or empty.memory < 0:
        return None
    return (now.memory - empty.memory) / n


class _Detections:
    """When each survivor's ``watch()`` first showed the killed node lost (from the kill)."""

    def __init__(self, job: Job, victim: Worker, since: float) -> None:
        self._job = job
        self._pid = victim.process.pid
        self._name = job.formed.get((victim.index, 0), {}).get("node") or None
        self._since = since
        self._seen = len(job.watches)
        self.delays: dict[tuple[int, int], float] = {}
        self.others: set[str] = set()  # other members shown lost meanwhile

    def update(self) -> int:
        """Take in the new watch events; how many survivors have detected the loss."""
        watches = self._job.watches
        for key, event in watches[self._seen :]:
            view = event["view"]
            for name, pid in zip(view["lost"], view["lost_pids"], strict=True):
                if pid == self._pid or name == self._name:
                    self.delays.setdefault(key, event["t"] - self._since)
                else:
                    self.others.add(name)
        self._seen = len(watches)
        return len(self.delays)


async def measure(
    server: ServerUnderTest,
    counts: list[int],
    command: Callable[[int, int], list[str]],
    *,
    log_dir: Path,
    name: str,
    timeout: float,
    settle: float,
    idle: float,
    kill: bool,
    detect_timeout: float,
) -> dict[str, Any]:
    """Run one job of ``sum(counts)`` nodes (``counts[i]`` in worker process ``i``).

    Returns:
        ``status`` ("ok", "did not start", "did not finish", "failed") and the measures of
        each phase that ran: ``formation``, ``idle``, ``kill``; ``log_issues``.
    """
    job = Job(log_dir, name)
    n = sum(counts)
    result: dict[str, Any] = {"n": n, "processes": len(counts), "status": "ok"}
    result["load_average_before"] = os.getloadavg()
    try:
        before = server.snapshot()
        await job.spawn(counts, command)
        if not await job.until(
            lambda: len(job.ready) == len(counts) or bool(job.died), _STARTUP_TIMEOUT
        ):
            result["status"] = "did not start"
            return result
        at = time.time() + 1.0
        cpu0 = job.cpu()
        await job.send({"cmd": "form", "at": at})
        finished = await job.until(
            lambda: len(job.formed) + len(job.failed) >= n or bool(job.died), timeout + 1.0
        )
        spent = server.snapshot() - before
        formation = _per_node(spent, n)
        formation["memory_per_node"] = _memory_per_node(spent, before, n)
        formation["nodes_cpu_s"] = job.cpu() - cpu0
        formation["formed"] = len(job.formed)
        formation["started_at"] = at  # wall-clock time, to place the nodes' log lines
        if job.formed:
            formed_at = sorted(e["t"] - at for e in job.formed.values())
            formation["seconds"] = formed_at[-1]
            formation["first_formed_s"] = formed_at[0]
        result["formation"] = formation
        if not finished:
            result["status"] = "did not finish"
            formation["seconds"] = None
            formation["timeout_s"] = timeout
            return result
        if job.failed or job.died:
            result["status"] = "failed"
            result["errors"] = sorted({e["error"] for e in job.failed.values()})
            result["died"] = job.died
            return result

        if idle > 0:
            await asyncio.sleep(settle)
            wakeups0, counters0, t0 = await job.wakeups(), server.snapshot(), time.time()
            cpu0 = job.cpu()
            await asyncio.sleep(idle)
            wakeups1, counters1, t1 = await job.wakeups(), server.snapshot(), time.time()
            window = t1 - t0
            result["idle"] = _per_node(counters1 - counters0, n, window)
            result["idle"].update(_per_request(counters1 - counters0, window))
            result["idle"]["memory_per_node"] = _memory_per_node(counters1, before, n)
            result["idle"]["nodes_cpu_s"] = job.cpu() - cpu0
            result["idle"]["seconds"] = window
            woken = -1 if min(wakeups0, wakeups1) < 0 else wakeups1 - wakeups0
            result["idle"]["wakeups_per_node_s"] = None if woken < 0 else woken / n / window
        result["spurious_watch_returns"] = len(job.watches)
        result["spurious_samples"] = [e["view"] for _, e in job.watches[:5]]

        if kill:
            victim = job.workers[-1]
            assert victim.count == 1
            survivors = [key for key in job.formed if key[0] != victim.index]
            killed_at = time.time()
            job.kill(victim)
            found = _Detections(job, victim, killed_at)
            await job.until(lambda: found.update() >= len(survivors), detect_timeout)
            found.update()
            delays = sorted(found.delays.values())
            complete = bool(delays) and len(delays) == len(survivors)
            result["kill"] = {
                "survivors": len(survivors),
                "detected": len(delays),
                "max_s": delays[-1] if complete else None,
                "median_s": statistics.median(delays) if delays else None,
                "other_members_lost": len(found.others),
            }
        result["watch_errors"] = len(job.watch_errors)
        return result
    finally:
        result["load_average_after"] = os.getloadavg()
        await job.stop()
        result["log_issues"] = job.log_issues()


@contextlib.contextmanager
def busy_loops(count: int) -> Any:
    """``count`` processes spinning on the CPU while the block runs (other work competing
    for the cores, as on a shared machine)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def node_command(spec: dict[str, Any], endpoints: list[str]) -> Callable[[int, int], list[str]]:
    """The command line of an aelastic worker process running ``count`` nodes: process
    ``index`` reaches the server at ``endpoints[index % len(endpoints)]`` (one server
    listening on several loopback addresses; see ``_scale_servers.LOOPBACKS``)."""

    def command(index: int, count: int) -> list[str]:
        endpoint = endpoints[index % len(endpoints)]
        return [
            sys.executable,
            "-m",
            "benchmarks._scale_node",
            json.dumps({**spec, "endpoint": endpoint, "count": count}),
        ]

    return command


def torch_command(spec: dict[str, Any]) -> Callable[[int, int], list[str]]:
    """The command line of a process running ``count`` torch c10d nodes as threads."""

    def command(index: int, count: int) -> list[str]:
        spec_json = json.dumps({**spec, "count": count})
        return [sys.executable, "-m", "benchmarks._scale_torch", "nodes", spec_json]

    return command
