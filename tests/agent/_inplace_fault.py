"""A worker that recovers in place (``aelastic.worker.InPlace``, gloo, CPU) and goes wrong:
``python _inplace_fault.py MODE``.

* ``broken-alone``: its collective "breaks" (a ``RuntimeError`` naming a closed connection)
  while no peer is lost: its agent must tell it to fail, and it exits with that error.
* ``stuck-handover MARKER``: in a group of two, says so (the file ``MARKER.<pid>``) and waits
  for the group to change; alone, waits for a second node too until the file ``MARKER``
  exists, then exits 0. A survivor left alone in its new group (no file ``MARKER`` yet) makes
  the file and hangs in the hand-over: its agent's ``recovery_timeout`` must restart it the
  old way.
"""

from __future__ import annotations

import os
import sys
import time

import aelastic.worker


def broken_alone() -> None:
    def train(round: aelastic.worker.Round) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    aelastic.worker.InPlace({"step": 0}, backend="gloo", timeout=30).run(train)


def stuck_handover(marker: str) -> None:
    def handover(round: aelastic.worker.Round) -> None:
        if round.recovered and round.world_size == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(3600)  # stuck: the agent's recovery_timeout ends it

    recovery = aelastic.worker.InPlace(None, backend="gloo", timeout=60, handover=handover)

    def train(round: aelastic.worker.Round) -> None:
        if round.world_size == 2:
            open(f"{marker}.{os.getpid()}", "w").close()
        while round.world_size == 2 or not os.path.exists(marker):
            recovery.check()  # until the group changes
            time.sleep(0.05)

    recovery.run(train)


if __name__ == "__main__":
    if sys.argv[1] == "broken-alone":
        broken_alone()
    else:
        stuck_handover(sys.argv[2])
