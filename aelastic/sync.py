"""The sync facade: torch's blocking rendezvous API over aelastic's one async core.

How it works: a private event loop runs in a daemon thread (one per process, started on
first use, like anyio's blocking portal). Every blocking call submits a coroutine to that
loop and waits for its result; heartbeats keep running on that loop between calls. It never
touches the caller's event loop, so it works from plain scripts, from worker threads, and
from a thread while another event loop runs elsewhere. Interrupting a blocked call (Ctrl-C)
cancels the coroutine, so an interrupted ``next_rendezvous`` leaves what it joined.

Why not anyio's ``start_blocking_portal`` (measured, ``benchmarks/sync_portal.py``): a call
through it costs twice as much (about 65 us against 32 us per blocking call on the reference
machine: its task group and cancel scope per call), and a ``SyncStore`` operation on the
memory backend is itself about 33 us, so every store call of a torch program would take
about twice as long. The portal here is the same pattern in 60 lines: it also cancels the
loop's own tasks (heartbeats) when it stops, which anyio's portal leaves pending, and makes
a new loop in a forked child.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from .core.params import RendezvousInfo, RendezvousParameters
from .core.store import Store
from .rendezvous import create_handler as create_async_handler
from .rendezvous.handler import DynamicRendezvousHandler

__all__ = ["SyncRendezvousHandler", "SyncStore", "create_handler", "run"]

T = TypeVar("T")


class _Portal:
    """An event loop in a daemon thread, with blocking calls into it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._main, args=(ready,), name="aelastic-sync-loop", daemon=True
        )
        self.thread.start()
        ready.wait()

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("aelastic.sync blocking calls cannot run on aelastic's own loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            if issubclass(concurrent.futures.TimeoutError, TimeoutError):
                raise
            # Python 3.10: concurrent.futures' own class, not the built-in one callers catch.
            raise TimeoutError(f"not done within {timeout:g} s") from None
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


_portal_lock = threading.Lock()
_portal_instance: _Portal | None = None


def _portal() -> _Portal:
    global _portal_instance
    with _portal_lock:
        portal = _portal_instance
        # A forked child inherits no running thread: it needs its own loop.
        if portal is None or portal.pid != os.getpid() or not portal.thread.is_alive():
            portal = _portal_instance = _Portal()
        return portal


@atexit.register
def _stop_portal() -> None:
    portal = _portal_instance
    if portal is not None and portal.pid == os.getpid():
        portal.stop()


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on aelastic's private loop and block until it is done.

    Safe to call from any thread, including one whose own event loop is running.
    """
    return _portal().call(coro, timeout)


def _seconds(timeout: timedelta | float | None) -> float | None:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return timeout


class SyncStore:
    """Blocking twin of :class:`aelastic.store.Store` with torch ``Store`` method names."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"SyncStore({self._store!r})"

    @property
    def async_store(self) -> Store:
        """The async store this one wraps."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """Default timeout of blocking calls."""
        return timedelta(seconds=self._store.timeout)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Change the default timeout of blocking calls."""
        seconds = _seconds(timeout)
        assert seconds is not None
        self._store.timeout = seconds

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``."""
        run(self._store.set(key, value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting until it exists (``StoreTimeoutError`` on timeout)."""
        return run(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key``; the new value."""
        return run(self._store.add(key, amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (empty: missing)."""
        return run(self._store.compare_set(key, expected, desired))

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Wait until every key exists (``StoreTimeoutError`` on timeout)."""
        run(self._store.wait(keys, _seconds(timeout)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys``, waiting until all exist."""
        return run(self._store.multi_get(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set each key to the matching value."""
        run(self._store.multi_set(keys, values))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return run(self._store.delete_key(key))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists (does not wait)."""
        return run(self._store.check(keys))


class SyncRendezvousHandler:
    """Blocking rendezvous handler with torch's ``RendezvousHandler`` method names.

    Args:
        handler: The async handler to drive (see :func:`create_handler`).
    """

    def __init__(self, handler: DynamicRendezvousHandler) -> None:
        self._handler = handler

    def __repr__(self) -> str:
        return f"SyncRendezvousHandler({self._handler!r})"

    @property
    def async_handler(self) -> DynamicRendezvousHandler:
        """The async handler (its coroutines run on aelastic's private loop)."""
        return self._handler

    @property
    def use_agent_store(self) -> bool:
        """See :attr:`DynamicRendezvousHandler.use_agent_store`."""
        return self._handler.use_agent_store

    def get_backend(self) -> str:
        """Name of the rendezvous backend."""
        return self._handler.get_backend()

    def get_run_id(self) -> str:
        """The run id of the rendezvous."""
        return self._handler.get_run_id()

    def next_rendezvous(self) -> RendezvousInfo[SyncStore]:
        """Block until this node is part of a completed round (see the async handler)."""
        info = run(self._handler.next_rendezvous())
        return RendezvousInfo(
            SyncStore(info.store), info.rank, info.world_size, info.bootstrap_store_info
        )

    def is_closed(self) -> bool:
        """Whether the rendezvous has been closed."""
        return run(self._handler.is_closed())

    def set_closed(self) -> None:
        """Mark the rendezvous as closed."""
        run(self._handler.set_closed())

    def num_nodes_waiting(self) -> int:
        """Number of nodes waiting to join the next round."""
        return run(self._handler.num_nodes_waiting())

    def shutdown(self) -> bool:
        """Close the rendezvous for every node and release the backend."""
        return run(self._handler.shutdown())

    def leave(self) -> None:
        """Leave the rendezvous without closing it for the others."""
        run(self._handler.leave())

    def close(self) -> None:
        """Release the backend without changing the shared state."""
        run(self._handler.aclose())

    def __enter__(self) -> SyncRendezvousHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def create_handler(params: RendezvousParameters) -> SyncRendezvousHandler:
    """Create a blocking rendezvous handler (torch's method names and return types).

    Raises:
        ValueError: Unknown backend or invalid parameters.
        ImportError: The backend's optional dependencies are missing.
    """

    async def _create() -> DynamicRendezvousHandler:
        # Built on the private loop, so that clients bind to the loop that drives them.
        return create_async_handler(params)

    return SyncRendezvousHandler(run(_create()))
