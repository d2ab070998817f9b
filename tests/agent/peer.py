"""A peer node for cross-process tests: ``python peer.py BACKEND ENDPOINT RUN_ID [k=v ...]``.

Runs an ElasticAgent with one ``worker.py report`` worker (reporting to the hub named by
``AELASTIC_TEST_HUB``) on the given rendezvous (min 1, max 2 nodes; ``k=v`` rendezvous
configuration). Its logs go to ``AELASTIC_TEST_LOG_DIR`` when set (the test may kill it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from aelastic.agent import ElasticAgent, WorkerSpec
from aelastic.rendezvous import RendezvousParameters, create_handler


def main() -> int:
    backend, endpoint, run_id, *conf = sys.argv[1:]
    config = dict(item.split("=", 1) for item in conf)
    params = RendezvousParameters(backend, endpoint, run_id, 1, 2, **config)
    worker = str(Path(__file__).with_name("worker.py"))
    spec = WorkerSpec(
        "trainer",
        1,
        create_handler(params),
        sys.executable,
        (worker, "report"),
        log_dir=os.environ.get("AELASTIC_TEST_LOG_DIR"),
    )
    result = ElasticAgent(spec).run_sync()
    return 1 if result.is_failed() else 0


if __name__ == "__main__":
    sys.exit(main())
