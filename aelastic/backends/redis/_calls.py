"""How a Redis backend talks to the server: the shared client, retries, scripts, errors.

How it works: on first use a backend takes the event loop's :class:`~._client.RedisClient`
for its endpoint (or a private one with ``share_connections=false``) and the watch of its
run's channel. Every call is retried with backoff on connection trouble until
``read_timeout`` runs out, then fails with ``RendezvousConnectionError`` naming the
endpoint (never the password); the time counts from the first failure since the server
last answered, not from the call's start, so a call made during an outage gets what is left
(at least one attempt) and the "retrying for N s more" countdown never starts again while
nothing answers. Trouble includes what a failover looks like from outside:
a primary gone, sentinels naming no primary yet, a demoted primary (``READONLY``), a
cluster down or its slots moving, a primary refusing writes without enough replicas
(``NOREPLICAS``). A refused login, a server that does not speak Redis, a service name the
sentinels do not know fail at once. Scripts run by their SHA; a server that does not know
one (new, restarted, a replica promoted) gets its source once (``EVAL``).

A Redis user without a command aelastic needs gets an error naming it: the command itself
(``EVALSHA``), or one a script runs (``TIME``: Redis names only the script's line, which
:func:`missing_command` reads back in the script's source). The commands whose refusal a
script shrugs off (``PUBLISH``: waiters then ask by themselves; ``INFO``: no new epoch after
a failover) are tried once per client when it is first used, each refusal logged as one
warning naming the command. The ACL a node needs is :data:`NODE_ACL` (in
docs/production-store.md, tested against a real server).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import weakref
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

__all__ = ["CLUSTER_ACL", "NODE_ACL", "OPERATOR_ACL", "RedisCalls", "missing_command"]

log = logging.getLogger("aelastic.backends.redis")

T = TypeVar("T")

#: The commands a node's Redis user needs (besides ``AUTH``), as ``ACL SETUSER`` rules;
#: add key and channel patterns for the key prefix (``~aelastic:* &aelastic:*``).
NODE_ACL = (
    "+hello +ping +select +evalsha +eval +time +info +publish +subscribe +unsubscribe "
    "+exists +wait +type +get +set +del +incrby +pexpire +pttl +hget +hmget +hset +hsetnx +hdel "
    "+sadd +srem +scard +sismember +smembers +zadd +zrem +zcard +zscore +zrange +zrangebyscore "
    "+hgetall +client|setname +client|list"
)
#: What ``aelastic status --list/--reset`` and ``aelastic dashboard`` need beyond a node's.
OPERATOR_ACL = "+scan +unlink"
#: What a node needs beyond :data:`NODE_ACL` on Redis Cluster (the slots, the commands).
CLUSTER_ACL = "+cluster|slots +command"
_ACL_HINT = (
    "a node's Redis user needs these commands: ACL SETUSER <user> on >PASSWORD "
    f"~<prefix>:* &<prefix>:* {NODE_ACL} (docs/production-store.md)"
)
#: What Redis says when a script's command is refused (7.x: the line only; 6.x: its name).
_SCRIPT_REFUSED = re.compile(r"can't run this command|NOPERM|no permissions", re.IGNORECASE)
_SCRIPT_LINE = re.compile(r"@user_script:\s*(\d+)")
_CALLED = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'")
_NAMED = re.compile(r"run the '([a-z|]+)' command")
#: Clients whose permissions for the commands a script may shrug off were tried.
_tried: weakref.WeakSet[RedisClient] = weakref.WeakSet()


def missing_command(error: str, src: str) -> str | None:
    """The command a script's refusal (``error``) is about, read from the script's source
    ``src`` at the line Redis names (or from the error itself); ``None`` if unknown."""
    named = _NAMED.search(error)
    if named:
        return named.group(1).upper()
    line = _SCRIPT_LINE.search(error)
    if line is None:
        return None
    lines = src.splitlines()
    number = int(line.group(1))
    if not 1 <= number <= len(lines):
        return None
    called = _CALLED.findall(lines[number - 1])
    return called[0].upper() if len(called) == 1 else None


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


#: Seconds the one attempt of a call made after the outage's budget ran out may take.
_LAST_ATTEMPT = 2.0

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
        #: Loop time of the first failure since the server last answered (``None``: it does).
        self._failing_since: float | None = None

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
                if client not in _tried:
                    _tried.add(client)
                    await self._try_shrugged_off(client)
        assert self._client is not None and self._watch is not None
        return self._client, self._watch

    async def _try_shrugged_off(self, client: RedisClient) -> None:
        """Log a warning for each command a script would shrug off that the user may not run
        (both tried at once: one round trip, once per client)."""
        route = self._keys.state
        tries = {
            # A channel nobody subscribes to, under the run's prefix (as ACLs name them): on
            # the run's own channel, each node's probe reached every member (N² messages).
            "PUBLISH": ("PUBLISH", f"{self._keys.base}:probe", "p"),
            "INFO": ("INFO", "replication"),
        }
        effects = {
            "PUBLISH": "nodes are not told of changes and ask by themselves (slower)",
            "INFO": "after a failover, a state version lost with the old primary is not "
            "moved to a new epoch",
        }
        started = asyncio.get_running_loop().time()
        answers = await asyncio.gather(
            *(client.command(*c, within=self._read_timeout, route=route) for c in tries.values()),
            return_exceptions=True,
        )
        if any(isinstance(a, Exception) and _transient(a) for a in answers):
            # Not answered: the server fails since then (the call that follows gets what is
            # left of its read timeout, not one more whole).
            self._failing_since = self._failing_since or started
        for name, answer in zip(tries, answers, strict=True):
            said = str(answer)
            refused = isinstance(answer, ResponseError) and _SCRIPT_REFUSED.search(said)
            # (Only a refusal of this command: a cluster client's own setup may fail first.)
            about = f"'{name.lower()}'" in said or (name == "PUBLISH" and "channel" in said)
            if refused and about:
                log.warning(
                    "Redis at %s: the user may not run %s (%s): %s; %s",
                    self.endpoint,
                    name,
                    answer,
                    effects[name],
                    _ACL_HINT,
                )

    async def _unbind(self) -> None:
        self._closed = True
        client, watch, self._client, self._watch = self._client, self._watch, None, None
        if client is None or watch is None:
            return
        await client.unwatch(self._keys.channel, watch)
        await _shared.release(self._share_key, client)

    def _budget_left(self) -> float:
        """Seconds left of the read timeout of the outage under way (all of it: none)."""
        if self._failing_since is None:
            return self._read_timeout
        now = asyncio.get_running_loop().time()
        return max(self._failing_since + self._read_timeout - now, 0.0)

    async def _call(self, what: str, attempt: Callable[[float], Awaitable[T]]) -> T:
        """Run ``attempt(timeout)`` with retries on transient failures, within ``read_timeout``."""
        loop = asyncio.get_running_loop()
        delay = 0.05
        cause: Exception | None = None  # the last failure that was not a timeout
        first_failure: float | None = None  # this call's budget counts from here, or before
        while True:
            started = loop.time()
            since = min(t for t in (started, first_failure, self._failing_since) if t is not None)
            deadline = since + self._read_timeout
            try:
                result = await attempt(
                    max(deadline - started, min(self._read_timeout, _LAST_ATTEMPT))
                )
                self._failing_since = None
                return result
            except AuthenticationError as exc:
                raise RendezvousConnectionError(
                    f"Authentication to Redis at {self.endpoint} failed ({what}): {exc} "
                    "Check the username/password (config keys or AELASTIC_REDIS_* variables)."
                ) from None
            except NoPermissionError as exc:
                raise RendezvousConnectionError(
                    f"Redis at {self.endpoint} refused {what}: {exc}; {_ACL_HINT}"
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
                if self._failing_since is None:
                    self._failing_since = since
                first_failure = since  # never later: others' answers do not renew this call's
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
            if _SCRIPT_REFUSED.search(str(exc)):
                name = missing_command(str(exc), src) or "a command of aelastic's scripts"
                raise RendezvousConnectionError(
                    f"Redis at {self.endpoint} refused {what}: its user may not run {name} "
                    f"(inside aelastic's script: {exc}); {_ACL_HINT}"
                ) from None
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
