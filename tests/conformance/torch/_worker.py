"""A worker of the agent and launcher scenarios, run as ``python _worker.py OUT MODE [ARG]``.

It writes its environment as JSON to ``OUT/<RANK>.<TORCHELASTIC_RESTART_COUNT>.json``
(standard library only: no torch import, so it starts in a few tens of milliseconds), then:

* ``ok``: exits 0.
* ``sleep S``: sleeps S seconds (``S@R``: only rank R sleeps), then exits 0.
* ``fail_odd``: odd ranks exit 1 at once; even ranks exit 0 (``fail_odd S``: even ranks
  sleep S seconds first).
* ``fail_until N``: exits 1 while ``TORCHELASTIC_RESTART_COUNT`` is below N, then 0.
* ``kill_rank1_once``: rank 1 kills itself with SIGKILL on the first attempt.
* ``sleep_alone S``: sleeps S seconds while ``WORLD_SIZE`` is 1, then exits 0.
* ``alone_after PATH``: in a world of one, waits until PATH exists (at most 60 s) and exits
  0; in a bigger world, sleeps 60 s.
* ``until_file PATH``: waits until PATH exists (at most 60 s), then exits 0.
* ``fail_after PATH``: waits until PATH exists (at most 60 s), then exits 1.
* ``term_ignored``: rank 0 ignores SIGTERM (then writes ``OUT/ignoring``) and sleeps 60 s;
  rank 1 exits 1 once rank 0 ignores SIGTERM.
* ``print``: prints ``creating <RANK>`` on stdout, then exits 0.
* ``fail``: raises ``RuntimeError`` (torch's ``bin/test_script.py --fail``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> int:
    out, mode, *rest = sys.argv[1:]
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(out, f"{rank}.{restart}.json")
    with open(f"{path}.{os.getpid()}", "w") as f:
        json.dump(dict(os.environ), f)
    os.replace(f"{path}.{os.getpid()}", path)  # whole, for a reader polling the directory
    if mode == "sleep":
        seconds, _, only = rest[0].partition("@")
        if not only or int(only) == rank:
            time.sleep(float(seconds))
    elif mode == "sleep_alone":
        if os.environ["WORLD_SIZE"] == "1":
            time.sleep(float(rest[0]))
    elif mode == "alone_after":
        if os.environ["WORLD_SIZE"] != "1":
            time.sleep(60)
        _wait_for_file(rest[0])
    elif mode == "until_file":
        _wait_for_file(rest[0])
    elif mode == "fail_after":
        _wait_for_file(rest[0])
        return 1
    elif mode == "term_ignored":
        ignoring = os.path.join(out, "ignoring")
        if rank == 1:
            _wait_for_file(ignoring)
            return 1
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(ignoring, "w").close()
        time.sleep(60)
    elif mode == "fail_odd":
        if rank % 2:
            return 1
        if rest:
            time.sleep(float(rest[0]))
    elif mode == "fail_until":
        return 1 if restart < int(rest[0]) else 0
    elif mode == "kill_rank1_once":
        if rank == 1 and restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "print":
        print(f"creating {rank}", flush=True)
    elif mode == "fail":
        raise RuntimeError("raising exception since --fail flag was set")
    return 0


def _wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
