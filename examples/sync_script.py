"""aelastic from a plain (not async) script: the sync facade, with torch's method names.

Run it::

    python examples/sync_script.py                       # 3 nodes as threads, in memory
    python examples/sync_script.py --rdzv-backend redis --rdzv-endpoint redis://host:6379/0 \\
        --nnodes 2                                       # one node per process, run it twice

How it works: ``aelastic.sync.create_handler`` gives a blocking handler with the same methods
as torch's ``RendezvousHandler`` (``next_rendezvous``, ``num_nodes_waiting``, ``shutdown``...)
and a blocking store with torch's ``Store`` methods (``set``, ``get``, ``add``, ``wait``...).
aelastic runs its async core on a private event loop in a background thread, so the script
needs no ``async`` anywhere. Each node joins the rendezvous, learns its rank, publishes a
greeting in the round's store, reads everybody's, counts itself with ``add``, and leaves.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import uuid

from aelastic import RendezvousParameters
from aelastic.sync import create_handler


def node(params: RendezvousParameters, name: str) -> str:
    """One node's life; returns what it saw."""
    with create_handler(params) as handler:
        info = handler.next_rendezvous()  # blocks until the group is formed
        store = info.store
        store.set(f"greeting/{info.rank}", f"hello from {name}")
        greetings = store.multi_get([f"greeting/{r}" for r in range(info.world_size)])
        arrived = store.add("arrived", 1)
        store.wait(["greeting/0"])  # already there: returns at once
        handler.leave()  # leave without closing the job for the others
    heard = ", ".join(g.decode() for g in greetings)
    return f"{name}: rank {info.rank} of {info.world_size}; #{arrived} to arrive; heard: {heard}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rdzv-backend", default="memory", help="memory, redis or http")
    p.add_argument("--rdzv-endpoint", default="", help="redis://... or host:port")
    p.add_argument("--rdzv-id", default=None, help="job id (the same on every node)")
    p.add_argument("--nnodes", type=int, default=3, help="nodes in the group")
    args = p.parse_args(argv)
    params = RendezvousParameters(
        backend=args.rdzv_backend,
        endpoint=args.rdzv_endpoint,
        run_id=args.rdzv_id or f"sync-demo-{uuid.uuid4().hex[:8]}",
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        join_timeout=60,
        last_call_timeout=0.5,
    )
    if args.rdzv_backend != "memory":  # one node per process
        if args.rdzv_id is None:
            p.error("--rdzv-id is needed so that the processes find each other")
        print(node(params, f"{socket.gethostname()}:{os.getpid()}"), flush=True)
        return 0
    # The memory backend is shared by the threads of this process: one thread per node.
    lines: list[str] = []
    threads = [
        threading.Thread(target=lambda i=i: lines.append(node(params, f"node-{i}")))
        for i in range(args.nnodes)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for line in sorted(lines):
        print(line, flush=True)
    return 0 if len(lines) == args.nnodes else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
