"""In-memory backend: the embedded default, and the reference the other backends match.

How it works: handlers in one process that name the same ``endpoint`` share one
:class:`~._engine.Engine`, which applies the pure state machine to each run under a lock
(safe across threads and event loops) and wakes waiters on changes. Time is the handler's
clock (a request carries it), so a test's manual clock drives timeouts and heartbeats.
A run lives in its process: once the last backend of a run that no node is in any more is
closed (the run closed, or its nodes all left), the run stays as it is (closed: every new
handler of it sees it closed) but its id is free at once for the next job of the process
(no grace: a node of its job would be a handler of this process, and none is left).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..core.health import JobHealth
from ..core.params import RendezvousParameters
from ..core.redact import redact_endpoint
from ..core.state import Reply, Request, Snapshot, Status, Transition
from ..core.token import Token
from ._engine import Engine, now_ms

__all__ = ["MemoryBackend", "create_backend", "reset"]

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()
#: Backends of this process per (endpoint, run id) not closed yet.
_users: dict[tuple[str, str], int] = {}


def _engine(endpoint: str) -> Engine:
    with _engines_lock:
        engine = _engines.get(endpoint)
        if engine is None:
            engine = _engines[endpoint] = Engine()
        return engine


class MemoryBackend:
    """State and store of one run, shared by every handler of this process on ``endpoint``.

    Args:
        run_id: The run whose state this backend holds.
        endpoint: Any name; handlers naming the same endpoint share a rendezvous.
    """

    name = "memory"

    def __init__(self, run_id: str, endpoint: str = "") -> None:
        self._endpoint = endpoint
        self._engine = _engine(endpoint)
        self._run_id = run_id
        self._released = False
        with _engines_lock:
            _users[endpoint, run_id] = _users.get((endpoint, run_id), 0) + 1

    def __repr__(self) -> str:
        endpoint = redact_endpoint(self._endpoint)
        return f"MemoryBackend(run_id={self._run_id!r}, endpoint={endpoint!r})"

    @property
    def endpoint(self) -> str:
        return self._endpoint or "memory"

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        now = request.now_ms if request.now_ms is not None else now_ms()
        return self._engine.apply(self._run_id, request, now)

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        if not await self._engine.wait_status(self._run_id, token, timeout):
            return None
        return self._engine.status(self._run_id, now_ms())

    async def snapshot(self) -> Snapshot | None:
        return self._engine.snapshot(self._run_id, now_ms())

    async def health(self) -> JobHealth | None:
        return self._engine.health(self._run_id)

    async def close_run(self) -> bool:
        reply = self._engine.apply(self._run_id, Request.operator_close(), now_ms())
        return reply.transition is Transition.MARK_CLOSED

    async def reset(self) -> bool:
        return self._engine.delete(self._run_id)

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        """The runs of this process on this endpoint (another process's are not seen)."""
        return self._engine.list_runs(now_ms(), limit)

    # -- key-value store ------------------------------------------------------------------

    async def kv_set(self, key: str, value: bytes) -> None:
        self._engine.kv_set(self._run_id, key, value)

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._engine.kv_get(self._run_id, keys)

    async def kv_add(self, key: str, amount: int) -> int:
        return self._engine.kv_add(self._run_id, key, amount)

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        return self._engine.kv_compare_set(self._run_id, key, expected, desired)

    async def kv_delete(self, key: str) -> bool:
        return self._engine.kv_delete(self._run_id, key)

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        return await self._engine.kv_wait(self._run_id, keys, timeout)

    async def aclose(self) -> None:
        """Let go of the run (its data stays for other handlers of this process); once the
        last backend of a run that no node is in lets go, its id is free for a new job."""
        if self._released:
            return
        self._released = True
        key = (self._endpoint, self._run_id)
        with _engines_lock:
            left = _users.get(key, 1) - 1
            if left:
                _users[key] = left
                return
            _users.pop(key, None)
        self._engine.free_if_over(self._run_id)


def create_backend(params: RendezvousParameters) -> MemoryBackend:
    """Create the in-memory backend for ``params.run_id`` at ``params.endpoint``."""
    return MemoryBackend(params.run_id, params.endpoint or "")


def reset() -> None:
    """Forget every in-memory run of this process (tests use it between cases)."""
    with _engines_lock:
        _engines.clear()
        _users.clear()
