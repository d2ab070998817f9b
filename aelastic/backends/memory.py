"""In-memory backend: the embedded default, and the reference the other backends match.

How it works: handlers in one process that name the same ``endpoint`` share one
``_Hub``; each run id has a ``_Run`` holding the encoded state, its version and the
key-value pairs. A lock makes it safe across threads and event loops. Waiters register
a future with the loop they run on and a predicate; a change wakes the waiters whose
predicate now holds (once: a woken waiter is dropped, it re-reads and waits anew), so
N waiting nodes cost O(N) wake-ups per change at most, never a poll.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .._redact import redact_endpoint
from ..rendezvous.api import RendezvousParameters
from .base import NO_STATE, Token

__all__ = ["CONFIG_KEYS", "MemoryBackend", "create_backend"]

#: The ``--rdzv-conf`` keys of this backend, beyond the rendezvous settings: none.
CONFIG_KEYS: tuple[str, ...] = ()

_epochs = itertools.count(1)


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    ready: Callable[[], bool]


@dataclass
class _Run:
    state: bytes | None = None
    version: int = 0
    epoch: int = field(default_factory=lambda: next(_epochs))
    kv: dict[str, bytes] = field(default_factory=dict)
    waiters: set[_Waiter] = field(default_factory=set)

    @property
    def token(self) -> Token:
        return NO_STATE if self.state is None else f"{self.epoch}.{self.version}"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Hub:
    """All runs of one endpoint in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, _Run] = {}

    def run(self, run_id: str) -> _Run:
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = _Run()
        return run

    def notify(self, run: _Run) -> None:
        """Wake the waiters whose condition holds. Call with the lock held."""
        woken = [w for w in run.waiters if w.ready()]
        for waiter in woken:
            run.waiters.discard(waiter)
            waiter.loop.call_soon_threadsafe(_resolve, waiter.future)


_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


def _hub(endpoint: str) -> _Hub:
    with _hubs_lock:
        hub = _hubs.get(endpoint)
        if hub is None:
            hub = _hubs[endpoint] = _Hub()
        return hub


def _add(current: bytes | None, amount: int, key: str) -> int:
    try:
        return (0 if current is None else int(current)) + amount
    except ValueError:
        raise ValueError(f"The value of key {key!r} is not an integer.") from None


class MemoryBackend:
    """State and store of one run, shared by every handler of this process on ``endpoint``.

    Args:
        run_id: The run whose state this backend holds.
        endpoint: Any name; handlers naming the same endpoint share a rendezvous.
    """

    name = "memory"

    def __init__(self, run_id: str, endpoint: str = "") -> None:
        self._endpoint = endpoint
        self._hub = _hub(endpoint)
        self._run_id = run_id
        with self._hub.lock:
            self._run = self._hub.run(run_id)

    def __repr__(self) -> str:
        endpoint = redact_endpoint(self._endpoint)
        return f"MemoryBackend(run_id={self._run_id!r}, endpoint={endpoint!r})"

    @property
    def endpoint(self) -> str:
        return self._endpoint or "memory"

    async def read(self) -> tuple[bytes | None, Token]:
        with self._hub.lock:
            return self._run.state, self._run.token

    async def compare_and_set(self, state: bytes, token: Token) -> tuple[bool, bytes | None, Token]:
        run = self._run
        with self._hub.lock:
            if run.token != token:
                return False, run.state, run.token
            run.state = state
            run.version += 1
            self._hub.notify(run)
            return True, state, run.token

    async def wait_for_change(self, token: Token, timeout: float | None) -> None:
        run = self._run
        await self._wait(lambda: run.token != token, timeout)

    async def _wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        loop = asyncio.get_running_loop()
        with self._hub.lock:
            if ready():
                return True
            waiter = _Waiter(loop, loop.create_future(), ready)
            self._run.waiters.add(waiter)
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=timeout)
        finally:
            with self._hub.lock:
                self._run.waiters.discard(waiter)
            waiter.future.cancel()
        if done:
            return True
        with self._hub.lock:
            return ready()

    # -- key-value store ------------------------------------------------------------------

    def _changed(self) -> None:
        self._hub.notify(self._run)

    async def kv_set(self, key: str, value: bytes) -> None:
        with self._hub.lock:
            self._run.kv[key] = bytes(value)
            self._changed()

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._hub.lock:
            return [self._run.kv.get(k) for k in keys]

    async def kv_add(self, key: str, amount: int) -> int:
        with self._hub.lock:
            value = _add(self._run.kv.get(key), amount, key)
            self._run.kv[key] = str(value).encode()
            self._changed()
            return value

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        with self._hub.lock:
            current = self._run.kv.get(key)
            if current is None and expected is not None:
                return expected
            if current != expected:
                assert current is not None
                return current
            self._run.kv[key] = bytes(desired)
            self._changed()
            return bytes(desired)

    async def kv_delete(self, key: str) -> bool:
        with self._hub.lock:
            existed = self._run.kv.pop(key, None) is not None
            if existed:
                self._changed()
            return existed

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        kv = self._run.kv
        wanted = list(keys)
        return await self._wait(lambda: all(k in kv for k in wanted), timeout)

    async def aclose(self) -> None:
        """Nothing to release: the run's data stays for other handlers of this process."""

    async def reset(self) -> bool:
        """Drop the run's state and store, for every handler of this process (waiters wake).

        Returns:
            Whether the run held anything.
        """
        with self._hub.lock:
            run = self._run
            held = run.state is not None or bool(run.kv)
            run.state, run.version, run.epoch = None, 0, next(_epochs)
            run.kv.clear()
            self._hub.notify(run)
            return held


def create_backend(params: RendezvousParameters) -> MemoryBackend:
    """Create the in-memory backend for ``params.run_id`` at ``params.endpoint``."""
    return MemoryBackend(params.run_id, params.endpoint or "")


def reset() -> None:
    """Forget every in-memory run of this process (tests use it between cases)."""
    with _hubs_lock:
        _hubs.clear()
