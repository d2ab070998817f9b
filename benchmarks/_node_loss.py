"""The node-loss case of ``recovery_latency.py``: a member node is lost -> every rank of the
re-formed job finished its next training step.

aelastic: three launchers on this machine run one job of ``--nnodes 2:2`` (one worker each,
``_train_worker.py``): two train, the third waits as a spare (the redundancy list). Once
both members trained a few steps, one member is SIGKILLed with its worker (a node that loses
power). The time is from the kill to the last rank's first step in the new group (worker
clocks: the same machine). Variants, all with the same heartbeat window (``CONF``):

* ``restart``: aelastic, warm standbys off: the survivor's worker fails, is started again
  cold and loads the newest checkpoint, as the spare's does.
* ``spare``: aelastic with warm standbys that imported torch ahead (a hot spare); still a
  restart from the checkpoint.
* ``inplace``: aelastic with a hot spare, and the worker uses ``aelastic.worker.InPlace``:
  the survivor's worker stays, the spare's gets the state from it.
* ``torch``: ``torchrun`` on c10d cannot keep a spare: with a third node standing by (its
  redundancy list) the members' workers were stopped and started again every 1 to 8 s
  before any failure (torch 2.13, measured here). So torch runs two launchers and a third
  is started at the moment of the kill (a replacement that takes no time to provision); the
  survivor's worker fails, torchrun restarts it (a restart spent) and both load the newest
  checkpoint. The first launcher hosts the c10d store: it is never the one killed. torch
  runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, its own switch back to a store per
  round for the workers: with the store shared (its default since 2.4) the replacement
  never started training. Each agent keeps the workers' store address of its first round;
  in the round after the loss the survivor, rank 0 again, keeps its old one and writes no
  ``MASTER_ADDR`` in the new round's store, so the replacement waits for it in
  ``RendezvousStoreInfo.build`` while the survivor waits for the replacement in
  ``_assign_worker_ranks`` (both stacks taken from a run here, torch 2.13), until their
  store timeouts.

A variant whose ranks make no step within ``AFTER_KILL`` seconds of the kill counts as
``inf`` (did not resume).

``python _node_loss.py node ENDPOINT RUN_ID VARIANT`` runs one aelastic node (HTTP
rendezvous, or Redis when ENDPOINT is a ``redis://`` URL).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
THIS = str(Path(__file__).resolve())
WORKER = str(Path(__file__).resolve().with_name("_train_worker.py"))
LOOPBACK = "127.0.0.1"
#: The rendezvous settings of every variant: a heartbeat a second, lost after two missed.
CONF = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2", "last_call_timeout": "1"}
VARIANTS = ("torch", "restart", "spare", "inplace")
#: Steps each member trains before the kill.
WARMUP_STEPS = 5
#: Seconds after the kill within which every rank must have made a step.
AFTER_KILL = 90.0


def node(argv: Sequence[str]) -> int:
    """One aelastic node of the job."""
    sys.path.insert(0, str(ROOT))
    from aelastic.agent import ElasticAgent, WorkerSpec
    from aelastic.rendezvous import RendezvousParameters, create_handler

    endpoint, run_id, variant = argv
    if os.environ.get("BENCH_TRACE_DIR"):  # the agent's steps, timed, in the launcher's log
        import logging

        logging.basicConfig(level=logging.INFO, format="%(created).3f %(name)s: %(message)s")
    backend = "redis" if endpoint.startswith(("redis://", "rediss://")) else "http"
    params = RendezvousParameters(backend, endpoint, run_id, 2, 2, local_addr=LOOPBACK, **CONF)
    spec = WorkerSpec(
        role="default",
        local_world_size=1,
        rdzv_handler=create_handler(params),
        entrypoint=sys.executable,
        args=(WORKER, "inplace" if variant == "inplace" else "checkpoint"),
        max_restarts=3,
        log_dir=os.devnull,
        warm_standby=variant != "restart",
        standby_preload=() if variant == "restart" else ("torch",),
    )
    result = ElasticAgent(spec).run_sync()
    return 1 if result.is_failed() else 0


def commands(variant: str, endpoint: str, run_id: str) -> list[str]:
    """The command line of one launcher of ``variant``."""
    if variant != "torch":
        return [sys.executable, THIS, "node", endpoint, run_id, variant]
    conf = ",".join(f"{k}={v}" for k, v in CONF.items())
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:2"),
        *("--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf),
        *("--local-addr", LOOPBACK, WORKER, "checkpoint"),
    ]


def _tree(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fp:
            children = [int(p) for p in fp.read().split()]
    except OSError:
        return []
    return children + [grandchild for child in children for grandchild in _tree(child)]


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launcher and everything under it (its workers have their own sessions)."""
    for pid in [proc.pid, *_tree(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _wait_listening(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def measure(
    variant: str, endpoint: str, run_id: str, timeout: float = 180.0, victim: str = "other"
) -> float:
    """Seconds from a member's kill to the last rank's first step after it (``victim``:
    ``"rank0"``, the member of group rank 0, whose address is the workers' master; else the
    other member)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOOPBACK, 0))
    deadline = time.monotonic() + timeout
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="aelastic-bench-") as tmp:
        env = dict(os.environ, BENCH_ADDR=f"{LOOPBACK}:{sock.getsockname()[1]}", BENCH_DIR=tmp)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if variant == "torch":  # see the module docstring
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        trace = os.environ.get("BENCH_TRACE_DIR")  # each launcher's output kept there
        try:
            cmd = commands(variant, endpoint, run_id)

            def launch() -> None:
                out = quiet
                if trace:
                    path = Path(trace) / f"{run_id}-{variant}-{len(procs)}.log"
                    out = {"stdout": path.open("wb"), "stderr": subprocess.STDOUT}
                procs.append(
                    subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, **out)
                )

            launch()
            if variant == "torch":  # the first torchrun hosts the store: it must be the one
                _wait_listening(int(endpoint.rsplit(":", 1)[1]), deadline)
            launch()
            if variant != "torch":
                launch()  # the spare
            replace = launch if variant == "torch" else None
            return _lose_a_member(sock, procs, deadline, replace, victim)
        finally:
            for proc in procs:
                _kill_tree(proc)
            sock.close()


def _lose_a_member(
    sock: socket.socket,
    procs: list[subprocess.Popen[bytes]],
    deadline: float,
    replace: Callable[[], None] | None,
    victim: str,
) -> float:
    def report() -> list[str]:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        return sock.recv(512).decode().split()

    before: dict[int, tuple[int, str, str]] = {}  # rank -> (step, pid, gen)
    while len(before) < 2 or min(s for s, _, _ in before.values()) < WARMUP_STEPS:
        _, rank, step, _t, pid, gen = report()
        before[int(rank)] = (int(step), pid, gen)
    if victim == "rank0":
        owner = _parent(int(before[0][1]))
        [member] = [p for p in procs if p.pid == owner]
    else:
        owners = {_parent(int(pid)) for _, pid, _ in before.values()}
        [member] = [p for p in procs[1:] if p.pid in owners][:1]
    killed = time.time()
    _kill_tree(member)
    if os.environ.get("BENCH_TRACE_DIR"):
        pids = [p.pid for p in procs]
        print(f"  killed launcher {member.pid} of {pids} at {killed:.3f}", file=sys.stderr)
    if replace is not None:
        replace()
    deadline = time.monotonic() + AFTER_KILL
    old = {(pid, gen) for _, pid, gen in before.values()}
    after: dict[int, float] = {}
    while len(after) < 2:
        try:
            _, rank, _step, t, pid, gen = report()
        except TimeoutError:
            return math.inf
        if float(t) > killed and (pid, gen) not in old:
            after.setdefault(int(rank), float(t))
    return max(after.values()) - killed


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return int(fp.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


if __name__ == "__main__":
    sys.exit(node(sys.argv[2:]))
