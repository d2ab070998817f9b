"""A worker for the agent tests, started by the agent as ``python worker.py MODE [ARGS]``.

It reports to the test's :class:`~tests.agent.helpers.WorkerHub` (``AELASTIC_TEST_HUB`` =
``host:port``) with one JSON line (its pid, ranks and restart count), then obeys one line:
``exit N`` (exit with N), ``raise MSG`` (raise in torch's ``@record``), or waits for EOF
(then exits 0). Modes change what happens before reporting:

* ``report``: nothing special.
* ``env``: the hello line carries the whole environment and the argv.
* ``ignore_term``: SIGTERM is ignored (only SIGKILL ends it).
* ``grandchild``: starts a sleeping child process (same process group) and reports its pid.
* ``affinity``: the hello line carries the CPUs the worker may run on.
* ``record_signal DIR``: SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 write their name to
  ``DIR/<local_rank>`` and exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys


def main() -> int:
    mode = sys.argv[1]
    hello = {
        "mode": mode,
        "pid": os.getpid(),
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "argv": sys.argv[1:],
    }
    if mode == "env":
        hello["env"] = dict(os.environ)
        hello["main"] = {
            "argv0": sys.argv[0],
            "path0": sys.path[0],
            "file": __file__,
            "name": __name__,
            "package": __package__,
            "spec": __spec__,
        }
        hello["orig_argv"] = sys.orig_argv
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "affinity":
        hello["cpus"] = sorted(os.sched_getaffinity(0))
    if mode == "record_signal":
        path = os.path.join(sys.argv[2], os.environ["LOCAL_RANK"])

        def record_signal(sig: int, frame: object) -> None:
            with open(path, "w") as f:
                f.write(signal.Signals(sig).name)
            os._exit(0)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(sig, record_signal)
    child = None
    if mode == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        hello["grandchild"] = child.pid
    host, port = os.environ["AELASTIC_TEST_HUB"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(json.dumps(hello).encode() + b"\n")
        command = sock.makefile("r").readline().split(" ", 1)
    if command[0] == "exit":
        return int(command[1])
    if command[0] == "raise":
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def fail() -> None:
            raise RuntimeError(command[1].strip())

        fail()
    return 0


if __name__ == "__main__":
    sys.exit(main())
