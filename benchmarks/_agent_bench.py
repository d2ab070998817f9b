"""Shared parts of the agent benchmarks: the agent node, the report channel, the table.

The worker both launchers start is ``_agent_worker.py`` (see there).

``python _agent_bench.py node BACKEND ENDPOINT RUN_ID NNODES NPROC MAX_RESTARTS MODE`` runs one
aelastic agent node with that worker (``ElasticAgent.run_sync``; ``BENCH_WARM=0`` turns the
warm standbys off).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THIS = str(Path(__file__).resolve())
WORKER = str(Path(__file__).resolve().with_name("_agent_worker.py"))
LOOPBACK = "127.0.0.1"


def node(argv: Sequence[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from aelastic.agent import ElasticAgent, WorkerSpec
    from aelastic.rendezvous import RendezvousParameters, create_handler

    backend, endpoint, run_id, nnodes, nproc, max_restarts, mode = argv
    params = RendezvousParameters(
        backend, endpoint, run_id, int(nnodes), int(nnodes), local_addr=LOOPBACK
    )
    spec = WorkerSpec(
        role="default",
        local_world_size=int(nproc),
        rdzv_handler=create_handler(params),
        entrypoint=sys.executable,
        args=(WORKER, mode),
        max_restarts=int(max_restarts),
        log_dir=os.devnull,
        warm_standby=os.environ.get("BENCH_WARM", "1") == "1",
    )
    result = ElasticAgent(spec).run_sync()
    return 1 if result.is_failed() else 0


# -- used by the benchmark scripts ------------------------------------------------------------


class Reports:
    """The UDP socket the workers report to."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((LOOPBACK, 0))
        self.addr = f"{LOOPBACK}:{self.sock.getsockname()[1]}"

    def next(self, deadline: float) -> list[str]:
        """The next report, split in words (TimeoutError at ``deadline``, monotonic)."""
        self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data = self.sock.recv(512)
        except TimeoutError as exc:
            raise TimeoutError("no report from the workers in time") from exc
        return data.decode().split()

    def close(self) -> None:
        self.sock.close()


def env_for(reports: Reports, **extra: str) -> dict[str, str]:
    """The environment of a launcher (and so of its workers)."""
    env = dict(os.environ)
    env["BENCH_ADDR"] = reports.addr
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def aelastic_node_cmd(
    backend: str, endpoint: str, run_id: str, nnodes: int, nproc: int, restarts: int, mode: str
) -> list[str]:
    numbers = [str(nnodes), str(nproc), str(restarts)]
    return [sys.executable, THIS, "node", backend, endpoint, run_id, *numbers, mode]


def torchrun_cmd(args: Sequence[str], mode: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, WORKER, mode]


@contextlib.contextmanager
def launched(
    cmds: Sequence[list[str]], env: dict[str, str]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the launchers (quiet); kill whatever is left on the way out."""
    procs = [
        subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for cmd in cmds
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()


def finish(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 120.0) -> None:
    """Wait for the launchers to exit; raise with their stderr if one failed."""
    for proc in procs:
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            assert proc.stderr is not None
            err = proc.stderr.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"launcher {proc.args!r} ended with {code}:\n{err}")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(title: str, rows: Sequence[tuple[str, float, float, str]]) -> str:
    """Rows of (case, torch, aelastic, unit) with the ratio torch / aelastic."""
    lines = [title, f"{'case':<34} {'torch':>10} {'aelastic':>10} {'ratio':>8}"]
    for case, torch_value, ours, unit in rows:
        if math.isinf(torch_value) or math.isinf(ours):  # a side that never got there
            shown = [
                f"{'never':>10}" if math.isinf(v) else f"{v:>9.3f}{unit}"
                for v in (torch_value, ours)
            ]
            lines.append(f"{case:<34} {shown[0]} {shown[1]} {'n/a':>8}")
            continue
        ratio = torch_value / ours if ours > 0 else float("inf")
        lines.append(f"{case:<34} {torch_value:>9.3f}{unit} {ours:>9.3f}{unit} {ratio:>7.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(node(sys.argv[2:]))
