"""A chaos worker: ``python _worker.py DIR``. Records who it is, then idles until stopped.

It writes ``DIR/<pid>.json`` (atomically) with its pid, its agent's pid and torch's rank
variables, so the test can tell which workers ran, in which rank, and whether any is left.
"""

from __future__ import annotations

import json
import os
import sys
import time

_KEYS = ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT")


def main() -> None:
    record = {
        "pid": os.getpid(),
        "agent": os.getppid(),
        "started": time.time(),
        **{
            key.lower(): int(os.environ[key])
            for key in (
                "RANK",
                "WORLD_SIZE",
                "GROUP_RANK",
                "LOCAL_RANK",
                "TORCHELASTIC_RESTART_COUNT",
            )
        },
    }
    path = os.path.join(sys.argv[1], f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
