"""Rendezvous formation: time for N nodes (min = max = N) to complete one rendezvous.

aelastic and torch's own ``DynamicRendezvousHandler`` (c10d backend: a TCPStore on
loopback, nodes as threads, as torchrun runs it) are measured in the same run and
printed side by side with ratios (torch time / aelastic time; higher is better).

Also measures the wake-up latency: with one node already waiting in ``next_rendezvous``,
the time from the last node's own return (its request completed the round) to the waiting
node's return. torch's waiting nodes poll once a second; aelastic's are woken by the change.

Run: ``python benchmarks/rdzv_formation.py [--sizes 2,8,16,...] [--torch-max 64]
[--plot docs/formation.png]`` (``--plot``: formation time against N, torch and every aelastic
column of this run, as a PNG; needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic import RendezvousParameters
from aelastic import sync as aelastic_sync
from aelastic.backends import create_backend
from aelastic.core.params import RendezvousSettings
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.rendezvous import create_handler
from benchmarks import _plots
from benchmarks._servers import SERVER_BACKENDS, server_endpoint

LOOPBACK = "127.0.0.1"
CONF = {"join_timeout": 600, "last_call_timeout": 30, "read_timeout": 60}


def _params(backend: str, endpoint: str, run_id: str, n: int) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, run_id, n, n, local_addr=LOOPBACK, **CONF)


# -- aelastic ------------------------------------------------------------------------------


async def _async_formation(backend: str, endpoint: str, n: int) -> float:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    handlers = [create_handler(_params(backend, endpoint, run_id, n)) for _ in range(n)]
    try:
        start = time.perf_counter()
        infos = await asyncio.gather(*(h.next_rendezvous() for h in handlers))
        elapsed = time.perf_counter() - start
        assert sorted(i.rank for i in infos) == list(range(n))
        return elapsed
    finally:
        await asyncio.gather(*(h.aclose() for h in handlers))


def aelastic_async(backend: str, endpoint: str, n: int) -> float:
    """N handlers as tasks of one event loop."""
    return asyncio.run(_async_formation(backend, endpoint, n))


def _threads(n: int, make: Callable[[], Callable[[], int]]) -> float:
    """Run N node bodies in threads, released together; time until all are done."""
    bodies = [make() for _ in range(n)]
    ranks: list[int] = []
    gate = threading.Barrier(n + 1)
    lock = threading.Lock()

    def node(body: Callable[[], int]) -> None:
        gate.wait()
        rank = body()
        with lock:
            ranks.append(rank)

    threads = [threading.Thread(target=node, args=(b,), daemon=True) for b in bodies]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert sorted(ranks) == list(range(n)), ranks
    return elapsed


def aelastic_sync_threads(backend: str, endpoint: str, n: int) -> float:
    """N sync-facade handlers, one per thread."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    handlers: list[aelastic_sync.SyncRendezvousHandler] = []

    def make() -> Callable[[], int]:
        handler = aelastic_sync.create_handler(_params(backend, endpoint, run_id, n))
        handlers.append(handler)
        return lambda: handler.next_rendezvous().rank

    try:
        return _threads(n, make)
    finally:
        for handler in handlers:
            handler.close()


# -- torch ---------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def torch_c10d_threads(n: int) -> float:
    """torch's DynamicRendezvousHandler + C10dRendezvousBackend, nodes as threads."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParams
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    endpoint = f"{LOOPBACK}:{_free_port()}"
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    handlers = []

    def make() -> Callable[[], int]:
        params = TorchParams(
            "c10d",
            endpoint,
            run_id,
            n,
            n,
            local_addr=LOOPBACK,
            is_host=not handlers,  # the first node hosts the TCPStore, as on a real job
            **CONF,
        )
        handler = get_rendezvous_handler(params)
        handlers.append(handler)
        return lambda: handler.next_rendezvous().rank

    return _threads(n, make)


# -- wake-up latency -----------------------------------------------------------------------


def _in_own_loop(main: Callable[[], Coroutine[Any, Any, None]]) -> threading.Thread:
    """Run ``main`` on a fresh event loop in a thread: another node, with its own
    connections (backends share connections only within one loop)."""
    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread


async def _async_wakeup(backend: str, endpoint: str) -> float:
    """Round complete -> the waiting node's next_rendezvous returns."""
    run_id = f"wake-{uuid.uuid4().hex[:8]}"
    waiter = create_handler(_params(backend, endpoint, run_id, 2))
    completed: list[float] = []

    async def last_node() -> None:
        last = create_handler(_params(backend, endpoint, run_id, 2))
        async with last.events() as events:
            await last.next_rendezvous()
            completed.append((await events.get()).at)  # the request that completed the round
        await last.aclose()

    try:
        waiting = asyncio.ensure_future(waiter.next_rendezvous())
        while True:  # the waiter has joined and is parked, waiting for a change
            snapshot = await waiter.backend.snapshot()
            if snapshot is not None and snapshot.participants:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        thread = _in_own_loop(last_node)
        await waiting
        returned = time.time()
        await asyncio.to_thread(thread.join)
        return returned - completed[0]
    finally:
        await waiter.aclose()


def _join(params: RendezvousParameters, index: int) -> Request:
    settings = RendezvousSettings.from_parameters(params)
    node = NodeDesc(LOOPBACK, 1000 + index, 0)
    return Request(Op.JOIN, node, settings.rules, secret=secrets.token_hex(16))


async def _async_backend_wakeup(backend: str, endpoint: str) -> float:
    """Another node makes a round transition -> a waiter parked in wait_for_change returns."""
    params = _params(backend, endpoint, f"wake-{uuid.uuid4().hex[:8]}", 2)
    waiter = create_backend(params)
    ready, go = threading.Event(), threading.Event()
    wrote: list[float] = []

    async def writer() -> None:
        other = create_backend(params)
        await other.snapshot()  # connected
        ready.set()
        await asyncio.to_thread(go.wait)
        wrote.append(time.perf_counter())
        await other.apply(_join(params, 1))  # the second join starts the last call
        await other.aclose()

    try:
        token = (await waiter.apply(_join(params, 0))).status.token
        thread = _in_own_loop(writer)
        await asyncio.to_thread(ready.wait)
        parked = asyncio.ensure_future(waiter.wait_for_change(token, 30))
        await asyncio.sleep(0.2)
        go.set()
        await parked
        woke = time.perf_counter()
        await asyncio.to_thread(thread.join)
        return woke - wrote[0]
    finally:
        await waiter.aclose()


def aelastic_wakeup(backend: str, endpoint: str) -> float:
    return asyncio.run(_async_wakeup(backend, endpoint))


def aelastic_backend_wakeup(backend: str, endpoint: str) -> float:
    return asyncio.run(_async_backend_wakeup(backend, endpoint))


def torch_wakeup() -> float:
    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParams
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    endpoint = f"{LOOPBACK}:{_free_port()}"
    run_id = f"wake-{uuid.uuid4().hex[:8]}"
    made = [
        get_rendezvous_handler(
            TorchParams("c10d", endpoint, run_id, 2, 2, local_addr=LOOPBACK, is_host=i == 0, **CONF)
        )
        for i in range(2)
    ]
    # Record when the last node's write (the one that completes the round) lands.
    backend = made[1]._state_holder._backend
    writes: list[float] = []
    set_state = backend.set_state

    def recording_set_state(*args: object, **kwargs: object) -> object:
        result = set_state(*args, **kwargs)
        if result is not None and result[2]:
            writes.append(time.time())
        return result

    backend.set_state = recording_set_state
    returned: list[float] = []
    waiter = threading.Thread(
        target=lambda: (made[0].next_rendezvous(), returned.append(time.time()))
    )
    waiter.start()
    time.sleep(1.5)  # the waiter has joined and sleeps in torch's 1 s poll
    made[1].next_rendezvous()
    waiter.join()
    return returned[0] - writes[0]


# -- report --------------------------------------------------------------------------------


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:8.3f}s"


def _ratio(torch_s: float | None, ours: float | None) -> str:
    if torch_s is None or ours is None or ours <= 0:
        return "-"
    return f"{torch_s / ours:6.1f}x"


@contextmanager
def _endpoints(backends: list[str]) -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        found = {"memory": "bench"}
        for name in backends:
            if name in SERVER_BACKENDS:
                found[name] = stack.enter_context(server_endpoint(name))
        yield found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,8,16,32,64,128,256,512,1024")
    parser.add_argument("--torch-max", type=int, default=64, help="largest N run on torch")
    parser.add_argument("--backends", default="memory,redis,http,etcd")
    parser.add_argument("--server-max", type=int, default=256, help="largest N over a server")
    parser.add_argument("--wakeup-samples", type=int, default=5)
    parser.add_argument("--plot", type=Path, help="write formation time vs N as a PNG here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    with _endpoints(backends) as endpoints:
        columns = [("memory async", "memory", aelastic_async)]
        columns.append(("memory sync-threads", "memory", aelastic_sync_threads))
        columns += [(f"{b} async", b, aelastic_async) for b in backends if b in SERVER_BACKENDS]
        header = f"{'N':>5} | {'torch c10d':>10} | " + " | ".join(
            f"{name:>19} {'ratio':>7}" for name, _, _ in columns
        )
        print("Rendezvous formation (min = max = N); ratio = torch / aelastic")
        print(header)
        print("-" * len(header))
        measured: dict[str, dict[int, float]] = {"torch c10d": {}}
        measured.update({name: {} for name, _, _ in columns})
        for n in sizes:
            torch_s = torch_c10d_threads(n) if n <= args.torch_max else None
            if torch_s is not None:
                measured["torch c10d"][n] = torch_s
            cells = []
            for name, backend, run in columns:
                limit = args.server_max if backend in SERVER_BACKENDS else 1 << 30
                ours = run(backend, endpoints[backend], n) if n <= limit else None
                if ours is not None:
                    measured[name][n] = ours
                cells.append(f"{_fmt(ours):>19} {_ratio(torch_s, ours):>7}")
            print(f"{n:>5} | {_fmt(torch_s):>10} | " + " | ".join(cells), flush=True)
        if args.plot is not None:
            _plots.lines(
                {f"aelastic {k}" if k != "torch c10d" else k: v for k, v in measured.items()},
                args.plot,
                title="Rendezvous formation (min = max = N), torch and aelastic in one run",
                xlabel="nodes (N)",
                ylabel="seconds until every node has its rank",
                note=_plots.footnote("torch: DynamicRendezvousHandler on c10d, nodes as threads"),
            )
            print(f"wrote {args.plot}")

        print()
        print(f"Wake-up latency (median of {args.wakeup_samples}), milliseconds:")
        print("  change -> waiter wakes: another node writes the state; a waiter parked in")
        print("    wait_for_change returns (torch has no wake-up: its waiters sleep 1 s a poll)")
        print("  round complete -> waiter returns: the last node's write completes the round;")
        print("    the waiting node's next_rendezvous returns (includes its bootstrap reads)")
        samples = args.wakeup_samples
        torch_ms = statistics.median(torch_wakeup() for _ in range(samples)) * 1000
        print(
            f"{'':>12} | {'change -> waiter wakes':>22} | {'round complete -> waiter returns':>32}"
        )
        print(f"{'torch c10d':>12} | {'(1 s poll)':>22} | {torch_ms:23.2f}")
        for backend in ["memory", *[b for b in backends if b in SERVER_BACKENDS]]:
            endpoint = endpoints[backend]
            raw = statistics.median(
                aelastic_backend_wakeup(backend, endpoint) for _ in range(samples)
            )
            full = statistics.median(aelastic_wakeup(backend, endpoint) for _ in range(samples))
            print(
                f"{backend:>12} | {raw * 1000:22.2f} | {full * 1000:23.2f}"
                f" ({torch_ms / (full * 1000):,.0f}x faster)"
            )


if __name__ == "__main__":
    main()
