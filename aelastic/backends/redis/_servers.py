"""Where a run's keys live: a standalone server, a primary found by Sentinel, or a Cluster.

How it works: :func:`make_server` gives :class:`~._client.RedisClient` one object per
endpoint kind, all with the same small surface, built on redis-py's own clients (no
discovery of our own):

* :class:`Standalone`: ``Redis`` on a blocking pool of ``max_connections``; the listener
  subscribes on the server itself.
* :class:`SentinelPrimary`: ``Sentinel(...).master_for(service)``. Its pool asks the
  sentinels for the primary on every new connection, and drops a connection that finds
  the primary demoted (``READONLY``); a failed call is retried by :mod:`._calls`, so it
  reaches the new primary once Sentinel has promoted one. The listener asks the sentinels
  too, each time it (re)connects: it subscribes on the current primary (and Sentinel kills
  the pub/sub clients of a demoted one, so it moves on a manual failover as well).
* :class:`~._cluster.Cluster` (in :mod:`._cluster`): ``RedisCluster``, routing by the run's
  hash tag; the listener subscribes on any node.

:meth:`execute` runs a batch of commands in one round trip (a pipeline) and, when asked,
ends it with ``WAIT <replicas> <ms>`` on the same connection, so the reply comes only once
that many replicas hold the batch's writes. :meth:`explain` turns what retrying cannot fix
into a one-line error (a service Sentinel does not know, a sentinel refusing the login).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    RedisError,
    ResponseError,
)

from ._endpoint import CLUSTER, SENTINEL, RedisEndpoint

__all__ = ["Batch", "SentinelPrimary", "Standalone", "make_server"]

#: Seconds to open a connection (TCP, TLS, AUTH) before that attempt counts as failed.
CONNECT_TIMEOUT = 10.0


class Batch(NamedTuple):
    """Commands for one round trip.

    Attributes:
        commands: Each command's arguments.
        routes: For each command, a key whose slot picks the cluster node (commands
            without keys: ``SCAN``, ``PUBLISH``), or ``None``.
        durable: Keys written by the batch that replicas should acknowledge.
    """

    commands: list[tuple[Any, ...]]
    routes: list[str | None]
    durable: list[str]


class Standalone:
    """One Redis server (or a proxy). See the module docstring."""

    def __init__(self, endpoint: RedisEndpoint, max_connections: int) -> None:
        self.endpoint = endpoint
        self.kwargs = connection_kwargs(endpoint)
        self.redis: Any = self._command_client(max_connections)

    def _command_client(self, max_connections: int) -> Any:
        kwargs = dict(self.kwargs, host=self.endpoint.host, port=self.endpoint.port)
        pool = BlockingConnectionPool(max_connections=max_connections, timeout=None, **kwargs)
        return Redis(connection_pool=pool)

    async def execute(self, batch: Batch, wait: tuple[int, int] | None) -> tuple[list[Any], int]:
        """Replies (or reply errors) of ``batch`` in one round trip, and the replicas that
        acknowledged its writes (``wait``: ``(replicas, ms)``; -1 when not asked)."""
        commands = batch.commands
        waiting = wait is not None and bool(batch.durable)
        if len(commands) == 1 and not waiting:
            try:
                return [await self.redis.execute_command(*commands[0])], -1
            except ResponseError as exc:
                return [exc], -1
        async with self.redis.pipeline(transaction=False) as pipe:
            for args in commands:
                pipe.execute_command(*args)
            if waiting:
                assert wait is not None
                pipe.execute_command("WAIT", *wait)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        if not waiting:
            return replies, -1
        return replies[:-1], acked(replies[-1])

    async def load_scripts(self, scripts: Iterable[str]) -> None:
        """Load ``scripts`` into the script cache of the server(s) holding the keys."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for src in scripts:
                pipe.script_load(src)
            await pipe.execute()

    async def pubsub_address(self) -> tuple[str, int]:
        """Where the listener subscribes next."""
        return self.endpoint.host, self.endpoint.port

    async def explain(self, exc: BaseException) -> str | None:
        """A one-line message when ``exc`` is a failure that retrying cannot fix."""
        return None

    def describe(self, exc: BaseException) -> str:
        """``exc`` in a few words for a message (retries ran out)."""
        return str(exc) or type(exc).__name__

    async def aclose(self) -> None:
        """Close every connection."""
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()


class SentinelPrimary(Standalone):
    """The primary of a service that Redis Sentinel watches. See the module docstring."""

    def _command_client(self, max_connections: int) -> Any:
        endpoint = self.endpoint
        data = {k: v for k, v in self.kwargs.items() if k != "connection_class"}
        if endpoint.tls:
            data["ssl"] = True
        assert endpoint.service is not None
        self.sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(endpoint.hosts),
            sentinel_kwargs=_sentinel_kwargs(endpoint, self.kwargs),
            **data,
        )
        return self.sentinel.master_for(
            endpoint.service,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=None,
        )

    async def pubsub_address(self) -> tuple[str, int]:
        """The primary that the sentinels name now."""
        assert self.endpoint.service is not None
        host, port = await self.sentinel.discover_master(self.endpoint.service)
        return str(host), int(port)

    async def explain(self, exc: BaseException) -> str | None:
        """Ask the sentinels why they named no primary: an unknown service or a refused
        login cannot be retried away; a primary being replaced can."""
        if not isinstance(exc, MasterNotFoundError):
            return await super().explain(exc)
        known, refused = await self._ask_sentinels()
        service = self.endpoint.service
        if refused:
            return (
                f"The Redis Sentinel at {refused[0]} refused aelastic's login ({refused[1]}): "
                "check sentinel_username/sentinel_password or AELASTIC_REDIS_SENTINEL_PASSWORD."
            )
        if known is not None and service not in known:
            names = ", ".join(sorted(known)) or "none"
            return (
                f"The Redis Sentinels at {self.endpoint.addresses} watch no primary named "
                f"'{service}' (they watch: {names}). Check the service name in the endpoint."
            )
        return None

    def describe(self, exc: BaseException) -> str:
        if isinstance(exc, MasterNotFoundError):
            return (
                f"no sentinel at {self.endpoint.addresses} named a live primary for "
                f"'{self.endpoint.service}' (no sentinel reachable, or a failover that did "
                "not finish)"
            )
        return super().describe(exc)

    async def _ask_sentinels(self) -> tuple[set[str] | None, tuple[str, str] | None]:
        """(services the reachable sentinels know, or ``None`` when none answered;
        (address, reason) of a sentinel that refused the login, if any)."""
        known: set[str] | None = None
        for client in self.sentinel.sentinels:  # (redis-py reorders them: best first)
            options = client.connection_pool.connection_kwargs
            host, port = options.get("host"), options.get("port")
            try:
                masters = await client.sentinel_masters()
            except AuthenticationError as exc:
                return known, (f"{host}:{port}", str(exc))
            except ResponseError as exc:
                if "NOPERM" in str(exc) or "NOAUTH" in str(exc):
                    return known, (f"{host}:{port}", str(exc))
                continue
            except (RedisError, OSError, asyncio.TimeoutError):
                continue
            known = (known or set()) | {str(name) for name in masters}
        return known, None

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel.aclose()


def make_server(endpoint: RedisEndpoint, max_connections: int) -> Standalone:
    """The server object of ``endpoint``'s kind."""
    if endpoint.kind == SENTINEL:
        return SentinelPrimary(endpoint, max_connections)
    if endpoint.kind == CLUSTER:
        from ._cluster import Cluster  # (it builds on Standalone)

        return Cluster(endpoint, max_connections)
    return Standalone(endpoint, max_connections)


def acked(reply: Any) -> int:
    return reply if isinstance(reply, int) else 0


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool, waiting for a free connection instead of failing (as standalone)."""


def accepted(*classes: type) -> set[str]:
    """Keyword arguments the ``__init__`` of ``classes`` (and their bases) take."""
    names: set[str] = set()
    for cls in classes:
        for base in cls.__mro__:
            init = base.__dict__.get("__init__")
            if init is not None:
                names.update(inspect.signature(init).parameters)
    return names


def _quiet_handshake() -> dict[str, Any]:
    """Options that spare a new connection's optional round trips, where redis-py has them."""
    # The options are taken by a base class's __init__ (Connection's own takes **kwargs).
    options = accepted(Connection)
    quiet: dict[str, Any] = {}
    if "driver_info" in options:  # no CLIENT SETINFO lib-name/lib-ver
        quiet["driver_info"] = None
    if "maint_notifications_config" in options:
        from redis.maint_notifications import MaintNotificationsConfig

        quiet["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return quiet


_QUIET = _quiet_handshake()


def connection_kwargs(endpoint: RedisEndpoint) -> dict[str, Any]:
    """Options of a connection to a data node of ``endpoint`` (host and port aside)."""
    kwargs: dict[str, Any] = {
        "db": endpoint.db,
        "username": endpoint.username,
        "password": endpoint.password,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": CONNECT_TIMEOUT,
        "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 0),
        "connection_class": Connection,
        "protocol": 2,  # RESP2: no HELLO round trip on connect
    }
    kwargs.update(_QUIET)
    if endpoint.tls:
        kwargs.update(
            connection_class=SSLConnection,
            ssl_ca_certs=endpoint.ssl_ca_certs,
            ssl_certfile=endpoint.ssl_certfile,
            ssl_keyfile=endpoint.ssl_keyfile,
            ssl_cert_reqs=endpoint.ssl_cert_reqs,
        )
    return kwargs


def _sentinel_kwargs(endpoint: RedisEndpoint, data: dict[str, Any]) -> dict[str, Any]:
    """Options of the clients of the sentinels: their own login, the data nodes' TLS."""
    options = accepted(Redis)
    kwargs = {k: v for k, v in data.items() if k in options and k not in ("db", "retry")}
    kwargs.pop("connection_class", None)
    kwargs.update(username=endpoint.sentinel_username, password=endpoint.sentinel_password)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    if endpoint.tls:
        kwargs["ssl"] = True
    return kwargs


def new_pubsub_connection(kwargs: dict[str, Any], address: Sequence[Any]) -> Connection:
    """An unconnected connection for the listener at ``address`` (no read timeout: idle
    reads wait for messages, pings detect a loss)."""
    options = dict(kwargs, host=address[0], port=address[1], socket_timeout=None)
    cls: type[Connection] = options.pop("connection_class")
    return cls(**options)
