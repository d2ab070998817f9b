"""A node is lost mid-training: a hot spare takes its place and the survivor goes on in place.

Run it (CPU, gloo; nothing else to start)::

    python examples/inplace_recovery.py

How it works: the demo starts an HTTP rendezvous server (``aelastic serve``) and three
``aelastic run --nnodes 2:2`` launchers, "node A", "node B" and "node C", each with one
worker running this file's ``train`` part. The job needs exactly two nodes: the third is a
hot spare (torch's redundancy list), its worker's interpreter already up with torch imported
(``--standby-preload torch``). The workers train with :class:`aelastic.worker.InPlace`: the
model and the optimizer live in memory, in ``state``. Once the members trained together for
a while, the demo SIGKILLs one member (its launcher and its worker, as if the machine lost
power). The survivor's collective breaks; it leaves its process group and waits. The
rendezvous declares the member lost within its heartbeat window (1 s here), the spare fills
the round at once, the survivor's agent sends its worker the new ranks, and the worker makes
a new process group with the spare's worker, hands it the model and the optimizer (a
broadcast from the survivor) and goes on from the step it was at. No process of the
survivor restarts, no restart is spent (``--max-restarts 0``), no checkpoint is read. At the
end the demo prints the loss curve across the loss, the survivor's worker pid before and
after, and how long the job stood still. The demo exits 0 when the job finished.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
_STEP = re.compile(r"step (\d+)/\d+ loss ([0-9.e+-]+) world (\d+) rank (\d+) pid (\d+) t ([0-9.]+)")


# -- the training, run by each node's worker -------------------------------------------------


def train(argv: list[str]) -> int:
    """One worker: a linear regression (``y = 3*x0 - 2*x1 + 0.5``), DDP over gloo, made again
    at each new group; everything it needs to go on is in ``state``."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.1)
    args = p.parse_args(argv)

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import aelastic.worker

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    recovery = aelastic.worker.InPlace(state, backend="gloo", timeout=30)

    def run(round: aelastic.worker.Round) -> None:
        ddp = DistributedDataParallel(model)  # made again in each new process group
        if round.recovered:
            print(
                f"rank {round.rank}: in a new group of {round.world_size} (round "
                f"{round.number}), state from rank {round.source}, at step {state['step']}",
                flush=True,
            )
        while state["step"] < args.steps:
            recovery.check()  # leaves at once when the agent says the group changes
            generator = torch.Generator().manual_seed(1000 * state["step"] + round.rank)
            x = torch.randn(32, 2, generator=generator)
            y = x @ torch.tensor([[3.0], [-2.0]]) + 0.5
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()  # the all-reduce: it breaks when a peer is gone
            optimizer.step()
            state["step"] += 1
            print(
                f"step {state['step']}/{args.steps} loss {loss.item():.5f} world "
                f"{round.world_size} rank {round.rank} pid {os.getpid()} t {time.time():.3f}",
                flush=True,
            )
            time.sleep(args.step_time)

    recovery.run(run)
    return 0


# -- the demo: a server, three nodes, one of them killed ------------------------------------


class Node:
    """A child process whose output lines are printed with a prefix and queued."""

    def __init__(self, name: str, cmd: list[str], lines: queue.Queue[tuple[str, str]]) -> None:
        self.name = name
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._lines = lines
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put((self.name, line.rstrip("\n")))
        self._lines.put((self.name, ""))  # end of output

    def kill_hard(self) -> None:
        """SIGKILL the launcher and its worker at once (a node that loses power)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill_hard()


def say(text: str) -> None:
    print(f"\n>>> {text}\n", flush=True)


def chart(losses: dict[int, float], kill_after: int, width: int = 60, height: int = 10) -> str:
    """The loss per step as text (log scale); ``|`` marks where the node was killed."""
    steps = sorted(losses)
    logs = {step: math.log10(max(loss, 1e-12)) for step, loss in losses.items()}
    top, low = max(logs.values()), min(logs.values())
    span = (top - low) or 1.0
    columns = [steps[min(c * len(steps) // width, len(steps) - 1)] for c in range(width)]
    kill_column = next((c for c, step in enumerate(columns) if step > kill_after), None)
    rows = []
    for level in range(height, -1, -1):
        cut = low + span * level / height
        cells = [
            "*"
            if abs(logs[step] - cut) <= span / (2 * height)
            else "|"
            if c == kill_column
            else " "
            for c, step in enumerate(columns)
        ]
        rows.append(f"{10**cut:10.5f} " + "".join(cells))
    rows.append(f"{'step':>10} {steps[0]:<{width - 3}}{steps[-1]:>3}")
    return "\n".join(rows)


def demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps of the job")
    p.add_argument("--step-time", type=float, default=0.1, help="extra seconds per step")
    p.add_argument("--kill-at", type=int, default=20, help="kill a member after this step")
    p.add_argument("--timeout", type=float, default=300, help="give up after this long")
    args = p.parse_args(argv)

    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    deadline = time.monotonic() + args.timeout
    python = [sys.executable, "-m", "aelastic"]

    def next_line() -> tuple[str, str]:
        name, line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        if line:
            print(f"[{name}] {line}", flush=True)
        return name, line

    say("starting an HTTP rendezvous server (aelastic serve)")
    server = Node("server", [*python, "serve", "--port", "0"], lines)
    nodes: dict[str, Node] = {}
    try:
        url = ""
        while not url:
            found = re.search(r"listening on http://(\S+)", next_line()[1])
            url = found.group(1) if found else ""
        run = [
            *python,
            "run",
            "--nnodes=2:2",
            "--nproc-per-node=1",
            "--max-restarts=0",
            "--rdzv-backend=http",
            f"--rdzv-endpoint={url}",
            f"--rdzv-id=inplace-{uuid.uuid4().hex[:8]}",
            # A heartbeat every 0.5 s, lost after 2 missed: a dead node is declared within ~1 s.
            "--rdzv-conf=last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=2",
            "--standby-preload=torch",
            "--local-addr=127.0.0.1",
            str(Path(__file__).resolve()),
            "train",
            f"--steps={args.steps}",
            f"--step-time={args.step_time}",
        ]
        say("starting nodes A, B and C: the job takes 2, the third is a hot spare")
        nodes = {f"node {n}": Node(f"node {n}", run, lines) for n in "ABC"}
        losses: dict[int, float] = {}
        owner: dict[int, str] = {}  # global rank -> node name
        pid_of: dict[str, int] = {}
        killed: tuple[str, float] | None = None
        survivor, before = "", 0
        resumed_at: float | None = None
        ended: set[str] = set()
        while len(ended) < 3:
            name, line = next_line()
            if not line:
                ended.add(name)
                continue
            found = _STEP.search(line)
            if found is None:
                continue
            step, loss, _world, rank, pid, t = found.groups()
            owner[int(rank)], pid_of[name] = name, int(pid)
            if int(rank) == 0:
                losses[int(step)] = float(loss)
            if killed is not None and resumed_at is None and int(step) > args.kill_at:
                resumed_at = float(t)
            if killed is None and int(step) == args.kill_at and len(owner) == 2:
                victim = owner[0]
                survivor = next(n for n in owner.values() if n != victim)
                before = pid_of[survivor]
                say(f"{victim} loses power (SIGKILL to its launcher and its worker)")
                nodes[victim].kill_hard()
                killed = (victim, time.time())
                ended.add(victim)
        if killed is None:
            say("the job ended before a node was killed: raise --steps")
            return 1
        codes = {name: node.proc.wait() for name, node in nodes.items() if name != killed[0]}
        say("the loss of rank 0 per step, log scale (| marks the kill)")
        print(chart(losses, args.kill_at), flush=True)
        after = pid_of[survivor]
        standing = f"{resumed_at - killed[1]:.2f} s" if resumed_at is not None else "?"
        say(
            f"{survivor}'s worker: pid {before} before the kill, {after} after "
            f"({'the same process' if before == after else 'restarted'}); the job stood still "
            f"{standing} from the kill to the next step; exit codes {codes}"
        )
        return 0 if set(codes.values()) == {0} and max(losses) == args.steps else 1
    except queue.Empty:
        say(f"the demo did not finish within {args.timeout:g} s")
        return 1
    finally:
        for node in nodes.values():
            node.stop()
        server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        sys.exit(train(sys.argv[2:]))
    sys.exit(demo(sys.argv[1:]))
