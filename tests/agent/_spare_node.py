"""One node of the spare tests: ``python _spare_node.py ENDPOINT RUN_ID MODE [k=v ...]``.

An ElasticAgent on the HTTP rendezvous at ENDPOINT, ``--nnodes 2:2`` (a third node is a
spare), one ``_spare_train.py MODE`` worker, no restart to spend (``max_restarts=0``: a
restart spent would fail the run), warm standbys with torch imported ahead of time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from aelastic.agent import ElasticAgent, WorkerSpec
from aelastic.rendezvous import RendezvousParameters, create_handler


def main() -> int:
    if os.environ.get("TRAIN_VERBOSE"):
        import logging

        logging.basicConfig(level=logging.INFO, format=f"%(created).3f {os.getpid()} %(message)s")
    endpoint, run_id, mode, *conf = sys.argv[1:]
    config = dict(item.split("=", 1) for item in conf)
    backend = "redis" if endpoint.startswith("redis://") else "http"
    params = RendezvousParameters(backend, endpoint, run_id, 2, 2, local_addr="127.0.0.1", **config)
    worker = str(Path(__file__).with_name("_spare_train.py"))
    spec = WorkerSpec(
        "trainer",
        1,
        create_handler(params),
        sys.executable,
        ("-u", worker, mode),
        max_restarts=0,
        stop_grace_period=5,
        standby_preload=("torch",),
        recovery_timeout=30,
        log_dir=os.environ.get("TRAIN_LOGS"),
        tee="3",
    )
    result = ElasticAgent(spec).run_sync()
    return 1 if result.is_failed() else 0


if __name__ == "__main__":
    sys.exit(main())
