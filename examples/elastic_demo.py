"""Elasticity on one machine: two nodes train together, one crashes, the survivor carries on.

Run it::

    python examples/elastic_demo.py

How it works: the demo starts an HTTP rendezvous server (``aelastic serve``) and two
``aelastic run`` launchers, "node A" and "node B", each running one worker of
``examples/ddp_train.py`` with ``--nnodes 1:2`` (the job may run on one or two nodes). Once
they train together (world size 2), the demo kills node B the hard way: SIGKILL to its
launcher and its worker, as if the machine had lost power. Node A notices (its worker's
collective breaks at once, and B's heartbeats stop), re-forms the group alone, and its new
worker resumes from the last checkpoint with world size 1 and finishes the job. Every line of
both nodes is shown, prefixed with the node's name. The demo exits with node A's exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "ddp_train.py"


class Node:
    """A child process whose output lines are printed with a prefix and kept."""

    def __init__(self, name: str, cmd: list[str], lines: queue.Queue[tuple[str, str]]) -> None:
        self.name = name
        env = dict(os.environ)
        root = str(HERE.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._lines = lines
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put((self.name, line.rstrip("\n")))
        self._lines.put((self.name, ""))  # end of output

    def kill_hard(self) -> None:
        """SIGKILL the process and its children (a node that loses power)."""
        victims = [self.proc.pid, *_children(self.proc.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill_hard()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fp:
            direct = [int(p) for p in fp.read().split()]
    except OSError:
        return []
    return direct + [grandchild for child in direct for grandchild in _children(child)]


def say(text: str) -> None:
    print(f"\n>>> {text}\n", flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps of the job")
    p.add_argument("--step-time", type=float, default=0.15, help="seconds per step")
    p.add_argument("--timeout", type=float, default=300, help="give up after this long")
    args = p.parse_args(argv)

    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    deadline = time.monotonic() + args.timeout
    python = [sys.executable, "-m", "aelastic"]
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    checkpoints = tempfile.mkdtemp(prefix="aelastic-demo-")

    def next_line() -> tuple[str, str]:
        name, line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        if line:
            print(f"[{name}] {line}", flush=True)
        return name, line

    say("starting an HTTP rendezvous server (aelastic serve)")
    server = Node("server", [*python, "serve", "--port", "0"], lines)
    nodes: list[Node] = []
    try:
        url = ""
        while not url:
            _, line = next_line()
            found = re.search(r"listening on http://(\S+)", line)
            url = found.group(1) if found else ""
        run = [
            *python,
            "run",
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=http",
            f"--rdzv-endpoint={url}",
            f"--rdzv-id={run_id}",
            # Heartbeats every 0.5 s, dead after 2 missed: a crash is seen within a second.
            "--rdzv-conf=last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=2",
            "--max-restarts=3",
            "--local-addr=127.0.0.1",
            str(TRAIN),
            f"--steps={args.steps}",
            f"--step-time={args.step_time}",
            f"--checkpoint-dir={checkpoints}",
            "--checkpoint-every=5",
        ]
        say("starting node A and node B: one worker each, the job allows 1 to 2 nodes")
        node_a, node_b = Node("node A", run, lines), Node("node B", run, lines)
        nodes = [node_a, node_b]
        # Wait until they train together and a checkpoint exists.
        together = False
        while True:
            _, line = next_line()
            together = together or "world size 2" in line
            if together and re.search(r"step \d+/\d+ .*checkpoint saved", line):
                break
        say("node B loses power (SIGKILL to its launcher and its worker)")
        node_b.kill_hard()
        # Node A carries on alone until its launcher exits.
        finished = False
        while not finished:
            name, line = next_line()
            finished = name == "node A" and line == ""
        code = node_a.proc.wait()
        say(f"node A exited with code {code}: " + ("the job finished" if code == 0 else "FAILED"))
        return code
    except queue.Empty:
        say(f"the demo did not finish within {args.timeout:g} s")
        return 1
    finally:
        for node in nodes:
            node.stop()
        server.stop()
        shutil.rmtree(checkpoints, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
