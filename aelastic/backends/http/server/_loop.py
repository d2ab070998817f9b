"""The server process's event loop and garbage collector.

How it works: :func:`run` runs the server's main coroutine to its end on a new loop of the
kind asked (``auto``: uvloop if it can be imported, ``asyncio``, ``uvloop``), as
``asyncio.run`` does (uvloop's ``run``), after :func:`tune_gc`. Only ``aelastic serve``'s
own process does this (:func:`~aelastic.backends.http.server.run_server`); a server started
with :func:`~aelastic.backends.http.server.serve` inside another program runs on that
program's loop and collector.

Why: with a member's heartbeat held on its WebSocket every second, the server's work per
beat is mostly the loop's: polling the sockets, reading a frame, writing the answer, the
callbacks between. uvloop does those in C; asyncio's selector loop in Python. Measured on
this project's 2-core machine (``benchmarks/beat_cost_http.py``, docs/benchmarks.md): at
1,024 nodes the loop alone took the server from 207 to 158 us of CPU per held beat (single
runs, loaded machine); at 4,096 nodes with the other savings in, the two loops measured
alike on the loaded machine (89.4 and 89.7 us).
The collector: a server holding thousands of connections has a large heap of long-lived
objects, and each young collection cost it milliseconds (6 ms each, measured at 4,096 nodes);
with the default threshold (700 allocations) the bursts of one tick of the heartbeats' timer
wheel set one off a few times a second: 15-23% of the server's CPU. Past a threshold of
:data:`GC_THRESHOLD` the bursts end before it is reached (one collection in 40 s, measured).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["GC_THRESHOLD", "LOOPS", "resolve", "run", "tune_gc"]

T = TypeVar("T")

#: Young objects (allocations less deallocations) between two collections in the server's
#: process; Python's default is 700.
GC_THRESHOLD = 20_000

#: The loops :func:`run` knows.
LOOPS = ("auto", "asyncio", "uvloop")


def resolve(kind: str) -> str:
    """The loop ``kind`` stands for (``auto``: ``uvloop`` when installed, else ``asyncio``).

    Raises:
        ValueError: ``kind`` is not one of :data:`LOOPS`, or ``uvloop`` is asked and missing.
    """
    if kind not in LOOPS:
        raise ValueError(f"unknown event loop {kind!r} (one of {', '.join(LOOPS)})")
    if kind == "asyncio":
        return kind
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if kind == "uvloop":
            raise ValueError("the uvloop event loop needs uvloop: pip install uvloop") from None
        return "asyncio"
    return "uvloop"


def tune_gc() -> None:
    """Collect the young objects every :data:`GC_THRESHOLD` allocations (this process)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, older, oldest)


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """Run ``main`` to its end on a new event loop of ``kind`` (see :func:`resolve`), in
    this process, with :func:`tune_gc`."""
    try:
        resolved = resolve(kind)
    except ValueError:
        main.close()
        raise
    tune_gc()
    if resolved == "uvloop":
        import uvloop

        result: T = uvloop.run(main)  # typed Any: uvloop is optional, not type-checked
        return result
    return asyncio.run(main)
