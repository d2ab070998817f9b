"""A worker for the self-healing tests (no torch): ``python heal_worker.py MODE [ARG]``.

Files go to ``$HEAL_DIR``. Modes:

* ``hang RANK``: reports progress five times (``aelastic.worker.progress()``, as an optimizer
  step would); on attempt 0 the worker of global rank RANK then hangs inside a step
  (``stuck_in_step``), after writing the time to ``$HEAL_DIR/hang``. Everybody else finishes.
* ``raise``: raises ``ValueError`` (no ``@record``).
* ``until_alone``: waits while the world is bigger than its own node, then exits 0.
* ``turns INDEX``: the job's failures alternate between nodes: in the job's n-th round
  (counted by the rounds' ``MASTER_PORT``s in ``$HEAL_DIR/rounds``), the worker of node
  ``n % 2`` writes ``$HEAL_DIR/failed.<n>`` and raises; the other waits.
* ``hang_once KIND``: reports progress five times, then, the first time any worker of this
  node runs it (no ``$HEAL_DIR/hung.KIND`` yet), hangs: ``own`` inside ``stuck_in_step``,
  ``collective`` inside ``all_reduce`` of the file ``$HEAL_COLLECTIVE`` (a stand-in that
  lives under a ``torch/distributed/`` directory, as a rank waiting for a stuck peer would);
  ``stopped`` as ``own``, but the worker stops itself with ``SIGSTOP`` instead (a frozen
  rank: no stacks can be taken from it).
* ``hang_pair``: on attempt 0, after five progress reports, local rank 0 waits in the
  ``$HEAL_COLLECTIVE`` stand-in (after writing ``$HEAL_DIR/waiting``); local rank 1 starts
  its reports once that file is there and, one report later (and more reports until
  ``$HEAL_PAIR_BUSY`` seconds after 0.4 s past the file's creation), hangs in
  ``stuck_in_step``.
* ``frozen PATH``: local rank 1 reads PATH (a file of a frozen FUSE mount: uninterruptible
  sleep) after writing ``$HEAL_DIR/reading``; local rank 0 waits for that file, then fails.
"""

from __future__ import annotations

import os
import sys
import time

import aelastic.worker


def stuck_in_step() -> None:
    time.sleep(600)  # the stuck line


def main() -> int:
    mode, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    heal_dir = os.environ.get("HEAL_DIR", ".")
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if mode == "hang":
        for _ in range(5):
            time.sleep(0.02)
            aelastic.worker.progress()
        if attempt == 0 and rank == int(arg):
            with open(os.path.join(heal_dir, "hang"), "w") as f:
                f.write(repr(time.time()))
            stuck_in_step()
        return 0
    if mode == "hang_once":
        for _ in range(5):
            time.sleep(0.02)
            aelastic.worker.progress()
        marker = os.path.join(heal_dir, f"hung.{arg}")
        if not os.path.exists(marker):
            with open(marker, "w"):
                pass
            if arg in ("own", "stopped"):  # a step later than the peer: its stall is seen first
                time.sleep(float(os.environ.get("HEAL_LATER", "0.5")))
                aelastic.worker.progress()
                if arg == "stopped":
                    import signal

                    os.kill(os.getpid(), signal.SIGSTOP)
                stuck_in_step()
            import runpy

            runpy.run_path(os.environ["HEAL_COLLECTIVE"])["all_reduce"]()
        return 0
    if mode == "hang_pair":
        waiting = os.path.join(heal_dir, "waiting")
        if attempt == 0 and local == 1:  # no progress (no stall) until rank 0 waits, however
            while not os.path.exists(waiting):  # late either started on a loaded machine
                time.sleep(0.01)
        for _ in range(5):
            time.sleep(0.02)
            aelastic.worker.progress()
        if attempt == 0 and local == 1:  # some time after rank 0: seen stalled second
            time.sleep(0.3)
            aelastic.worker.progress()
            # Busy until a time counted from rank 0's wait (the file's), not from this
            # worker's start: one started late on a loaded machine would go on for longer.
            busy = float(os.environ.get("HEAL_PAIR_BUSY", "0"))
            began = os.stat(waiting).st_mtime + 0.4
            busy_until = time.monotonic() + max(began + busy - time.time(), 0.0)
            while time.monotonic() < busy_until:  # still making progress while rank 0 waits
                time.sleep(0.05)
                aelastic.worker.progress()
            stuck_in_step()
        if attempt == 0:
            import runpy

            with open(waiting, "w"):
                pass
            runpy.run_path(os.environ["HEAL_COLLECTIVE"])["all_reduce"]()
        return 0
    if mode == "raise":
        raise ValueError(f"the data shard of rank {rank} is corrupt")
    if mode == "until_alone":
        while int(os.environ["WORLD_SIZE"]) > int(os.environ["LOCAL_WORLD_SIZE"]):
            time.sleep(600)  # stopped when the group changes
        return 0
    if mode == "turns":
        rounds = os.path.join(heal_dir, "rounds")
        os.makedirs(rounds, exist_ok=True)
        with open(os.path.join(rounds, os.environ["MASTER_PORT"]), "a"):
            pass
        count = len(os.listdir(rounds)) - 1
        if count % 2 == int(arg):
            with open(os.path.join(heal_dir, f"failed.{count}"), "w"):
                pass
            raise ValueError(f"failure {count + 1} of the job")
        time.sleep(600)
        return 0
    if mode == "frozen":
        reading = os.path.join(heal_dir, "reading")
        if local == 1:
            with open(reading, "w"):
                pass
            with open(arg, "rb") as f:
                f.read()  # never answered
            return 0
        while not os.path.exists(reading):
            time.sleep(0.05)
        time.sleep(0.3)  # let the read reach the kernel
        return 1
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
