"""The worker of the agent benchmarks (few imports: its own startup is not what is measured).

``python _agent_worker.py MODE`` reports ``start <after crash: 0|1> <rank> <wall time>`` (and
``crash <wall time>``) in a UDP datagram to ``BENCH_ADDR``. Modes:

* ``crash``: in the first attempt, global rank 0 crashes (exit 1) ``BENCH_CRASH_AFTER`` s
  after starting while the others sleep; after the crash (the file ``BENCH_MARK`` exists)
  every worker exits 0 at once.
* ``sleep``: sleep ``BENCH_SLEEP`` s, then exit 0.
"""

import os
import socket
import sys
import time


def worker(mode: str) -> int:
    now = time.time()
    host, port = os.environ["BENCH_ADDR"].rsplit(":", 1)
    rank = int(os.environ["RANK"])
    # The survivors of a crash keep restart count 0 (they spent no restart): a marker file
    # tells the attempts after the crash from the first one.
    marker = os.environ.get("BENCH_MARK", "")
    after_crash = bool(marker) and os.path.exists(marker)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.sendto(f"start {int(after_crash)} {rank} {now!r}".encode(), (host, int(port)))
    if mode == "sleep":
        time.sleep(float(os.environ.get("BENCH_SLEEP", "20")))
        return 0
    if after_crash:
        return 0
    if rank == 0:
        time.sleep(float(os.environ.get("BENCH_CRASH_AFTER", "1.0")))
        open(marker, "w").close()
        sock.sendto(f"crash {time.time()!r}".encode(), (host, int(port)))
        os._exit(1)
    time.sleep(600)  # stopped by the agent
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
