"""Connections shared by the backends of one event loop: one acquire/release pair.

How it works: many handlers in one process (a test, a benchmark, an agent and its status
page) each create a backend; the backends of one event loop and endpoint share one client
(Redis: a command pool and a pub/sub listener; HTTP: an aiohttp session and per-run long
polls). :func:`acquire` returns the loop's client for a key (made on first use) and counts
the reference; :func:`release` drops it, and the last one closes the client. A backend
created with ``share_connections=false`` passes a key of its own, so it gets a private
client (what separate hosts would have; the scale benchmark measures that way).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

__all__ = ["Closable", "acquire", "release"]


class Closable(Protocol):
    """A shared client: closed when its last user releases it."""

    async def aclose(self) -> None: ...


C = TypeVar("C", bound=Closable)

_clients: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[Hashable, tuple[Closable, int]]
] = weakref.WeakKeyDictionary()


def acquire(key: Hashable, make: Callable[[], C]) -> C:
    """The running loop's client for ``key`` (made by ``make`` on first use), one more user."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    entry = per_loop.get(key)
    client = make() if entry is None else entry[0]
    per_loop[key] = (client, (0 if entry is None else entry[1]) + 1)
    return client  # type: ignore[return-value]


async def release(key: Hashable, client: Closable) -> None:
    """One user fewer of ``client`` (acquired under ``key``); the last one closes it."""
    per_loop = _clients.get(asyncio.get_running_loop(), {})
    entry = per_loop.get(key)
    if entry is None or entry[0] is not client:
        await client.aclose()  # not (or no longer) shared: it is this user's alone
        return
    if entry[1] > 1:
        per_loop[key] = (client, entry[1] - 1)
        return
    del per_loop[key]
    await client.aclose()
