"""The server's event loop: uvloop when it is installed, else asyncio's own.

How it works: :func:`run` runs the server's main coroutine to its end on a new loop of the
kind asked (``auto``: uvloop if it can be imported, ``asyncio``, ``uvloop``), as
``asyncio.run`` does (uvloop's ``run``).

Why: with a member's heartbeat held on its WebSocket every second, the server's work per
beat is mostly the loop's: polling the sockets, reading a frame, writing the answer, the
callbacks between. uvloop does those in C; asyncio's selector loop in Python. Measured on
this project's 2-core machine (``benchmarks/beat_cost_http.py``, figures in
docs/benchmarks.md), uvloop takes a large share off the server's CPU per held beat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LOOPS", "resolve", "run"]

T = TypeVar("T")

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


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """Run ``main`` to its end on a new event loop of ``kind`` (see :func:`resolve`)."""
    try:
        resolved = resolve(kind)
    except ValueError:
        main.close()
        raise
    if resolved == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
