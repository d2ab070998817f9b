"""How a Redis backend talks to the server: the shared client, retries, scripts, errors.

How it works: on first use a backend takes the event loop's :class:`~._client.RedisClient`
for its endpoint (or a private one with ``share_connections=false``) and the watch of its
run's channel. Every call is retried with backoff on connection trouble until
``read_timeout`` runs out, then fails with ``RendezvousConnectionError`` naming the
endpoint (never the password). Trouble includes what a failover looks like from outside:
a primary gone, sentinels naming no primary yet, a demoted primary (``READONLY``), a
cluster down or its slots moving, a primary refusing writes without enough replicas
(``NOREPLICAS``). A refused login, a server that does not speak Redis, a service name the
sentinels do not know fail at once. Scripts run by their SHA; a server that does not know
one (new, restarted, a replica promoted) gets its source once (``EVAL``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...core.errors import RendezvousConnectionError, RendezvousStateError
from ...core.events import BackendRetry, report
from .. import _shared
from .._watch import RunWatch
from . import _scripts as lua
from ._client import RedisClient
from ._cluster import is_retryable
from ._endpoint import RedisEndpoint

__all__ = ["RedisCalls"]

T = TypeVar("T")

_SHA = {src: sha for sha, src in lua.SCRIPTS.items()}
_READ_ONLY = frozenset({lua.KV_GET})

#: Errors after which a call is retried (the server may be back a moment later).
_TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    TryAgainError,
    ClusterDownError,
    asyncio.TimeoutError,
    OSError,
)


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT) or is_retryable(exc):
        return True
    # A primary with min-replicas-to-write refuses writes while too few replicas follow.
    return isinstance(exc, ResponseError) and str(exc).startswith("NOREPLICAS")


#: Longest idle time of the pub/sub connection before the listener checks it with a PING.
HEALTH_INTERVAL = 30.0

_private = itertools.count()


class RedisCalls:
    """The plumbing of :class:`~._backend.RedisBackend` (see the module docstring)."""

    def __init__(
        self,
        run_id: str,
        endpoint: RedisEndpoint,
        keys: lua.RunKeys,
        *,
        read_timeout: float,
        max_connections: int,
        share_connections: bool,
        wait_replicas: int = 0,
    ) -> None:
        self._run_id = run_id
        self._endpoint = endpoint
        self._keys = keys
        self._read_timeout = float(read_timeout)
        self._max_connections = int(max_connections)
        self._wait_replicas = int(wait_replicas)
        key: Any = (endpoint.identity, self._wait_replicas)
        self._share_key = ("redis", key if share_connections else (key, next(_private)))
        self._client: RedisClient | None = None
        self._watch: RunWatch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bind_lock: asyncio.Lock | None = None
        self._closed = False

    @property
    def endpoint(self) -> str:
        """The endpoint as a URL without the password."""
        return self._endpoint.display

    async def _bind(self) -> tuple[RedisClient, RunWatch]:
        """The client and run watch of this backend (acquired on first use)."""
        if self._closed:
            raise RendezvousConnectionError(f"The Redis backend for {self.endpoint} is closed.")
        loop = asyncio.get_running_loop()
        if self._client is not None and self._watch is not None:
            if loop is not self._loop:
                raise RuntimeError("A RedisBackend is bound to the event loop it first ran on.")
            return self._client, self._watch
        if self._bind_lock is None:
            self._bind_lock = asyncio.Lock()
        async with self._bind_lock:
            if self._client is None:
                endpoint, size, wait = self._endpoint, self._max_connections, self._wait_replicas
                client = _shared.acquire(
                    self._share_key, lambda: RedisClient(endpoint, size, HEALTH_INTERVAL, wait)
                )
                self._loop, self._client = loop, client
                self._watch = await client.watch(self._keys.channel)
        assert self._client is not None and self._watch is not None
        return self._client, self._watch

    async def _unbind(self) -> None:
        self._closed = True
        client, watch, self._client, self._watch = self._client, self._watch, None, None
        if client is None or watch is None:
            return
        await client.unwatch(self._keys.channel, watch)
        await _shared.release(self._share_key, client)

    async def _call(self, what: str, attempt: Callable[[float], Awaitable[T]]) -> T:
        """Run ``attempt(timeout)`` with retries on transient failures, within ``read_timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._read_timeout
        delay = 0.05
        cause: Exception | None = None  # the last failure that was not a timeout
        while True:
            try:
                return await attempt(max(deadline - loop.time(), 0.001))
            except AuthenticationError as exc:
                raise RendezvousConnectionError(
                    f"Authentication to Redis at {self.endpoint} failed ({what}): {exc} "
                    "Check the username/password (config keys or AELASTIC_REDIS_* variables)."
                ) from None
            except NoPermissionError as exc:
                raise RendezvousConnectionError(
                    f"Redis at {self.endpoint} refused {what}: {exc}"
                ) from None
            except InvalidResponse as exc:  # another protocol: retrying cannot help
                said = str(exc).removeprefix("Protocol Error: ")
                said = said if len(said) <= 60 else said[:57] + "..."
                raise RendezvousConnectionError(
                    f"The server at {self.endpoint} does not speak the Redis protocol (it "
                    f"answered {what} with {said}): is it a Redis server? Check the host and "
                    "port."
                ) from None
            except Exception as exc:
                server = self._client.server if self._client is not None else None
                permanent = None if server is None else await server.explain(exc)
                if permanent is not None:
                    raise RendezvousConnectionError(f"{permanent} ({what})") from None
                if not _transient(exc):
                    raise
                if not isinstance(exc, asyncio.TimeoutError):
                    cause = exc
                remaining = deadline - loop.time()
                if remaining <= 0:
                    # The last attempt often had only what was left of the time: a timeout
                    # says less than the failure before it.
                    exc = cause if isinstance(exc, asyncio.TimeoutError) and cause else exc
                    said = server.describe(exc) if server is not None else str(exc)
                    raise RendezvousConnectionError(
                        f"Redis at {self.endpoint} could not be reached within "
                        f"{self._read_timeout:g} s ({what}): {said or type(exc).__name__}"
                    ) from None
                error = str(exc) or type(exc).__name__
                report(
                    BackendRetry(
                        backend="redis",
                        endpoint=self.endpoint,
                        what=what,
                        error=error,
                        retry_for=remaining,
                    )
                )
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    async def _script(
        self,
        what: str,
        src: str,
        keys: Sequence[str],
        args: Sequence[Any],
        client: RedisClient | None = None,
        durable: bool = False,
    ) -> Any:
        shared = client or (await self._bind())[0]
        command = ("EVALSHA", _SHA[src], len(keys), *keys, *args)
        options: dict[str, Any] = {"shareable": src in _READ_ONLY}
        if durable:
            options["durable"] = keys[0]

        async def run(within: float) -> Any:
            try:
                return await shared.command(*command, within=within, **options)
            except NoScriptError:
                # A new or restarted server: this once the source itself (EVAL caches it
                # there), one round trip where loading every script would take two more.
                source = ("EVAL", src, *command[2:])
                return await shared.command(*source, within=within, **options)

        try:
            return await self._call(what, run)
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise RendezvousStateError(
                    f"A key of run '{self._run_id}' at {self.endpoint} holds a value of the "
                    f"wrong Redis type ({what}); it was left as it is."
                ) from None
            if "unauthenticated" in str(exc):  # a long command before any login
                raise RendezvousConnectionError(
                    f"Authentication to Redis at {self.endpoint} failed ({what}): it requires "
                    "a login and refused a request without one. Check the username/password "
                    "(config keys or AELASTIC_REDIS_* variables)."
                ) from None
            raise RendezvousConnectionError(
                f"Redis at {self.endpoint} failed {what}: {exc}"
            ) from None

    def _check(self, reply: list[Any], key: str) -> list[Any]:
        if reply[0] == lua.WRONG_TYPE:
            kind = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise RendezvousStateError(
                f"The key '{key}' of run '{self._run_id}' at {self.endpoint} is a Redis "
                f"{kind}, not a value aelastic wrote; it was left as it is."
            )
        return reply
