"""The sync facade's portal: cost of one blocking call, aelastic's private loop vs anyio's portal.

Every blocking call of ``aelastic.sync`` (a ``SyncStore.get``, ``num_nodes_waiting``, ...)
crosses from the caller's thread to the loop thread and back. This measures that crossing
with a coroutine that does nothing: aelastic's portal (``asyncio.run_coroutine_threadsafe``
on a loop in a daemon thread) against anyio's ``start_blocking_portal`` (``call`` and
``start_task_soon``), and one ``SyncStore.set`` on the memory backend for scale.

Run: ``python benchmarks/sync_portal.py [--calls 5000]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from anyio.from_thread import start_blocking_portal

from aelastic import RendezvousParameters, sync


async def _noop() -> int:
    return 1


def _per_call(call: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean microseconds per call."""
    call()
    means = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    calls = parser.parse_args().calls
    own = _per_call(lambda: sync.run(_noop()), calls)
    with start_blocking_portal("asyncio") as portal:
        anyio_call = _per_call(lambda: portal.call(_noop), calls)
        anyio_soon = _per_call(lambda: portal.start_task_soon(_noop).result(), calls)
    handler = sync.create_handler(RendezvousParameters("memory", "", "portal-bench", 1, 1))
    store = handler.next_rendezvous().store
    store_set = _per_call(lambda: store.set("key", b"value"), calls)
    handler.close()
    print(f"one blocking call, microseconds (median of 5 x {calls} calls; lower is better)")
    print(f"  aelastic private loop          {own:7.1f}")
    print(f"  anyio portal.call              {anyio_call:7.1f}  ({anyio_call / own:.1f}x)")
    print(f"  anyio portal.start_task_soon   {anyio_soon:7.1f}  ({anyio_soon / own:.1f}x)")
    print(f"  SyncStore.set (memory backend) {store_set:7.1f}")


if __name__ == "__main__":
    main()
