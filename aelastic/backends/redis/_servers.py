"""Where a run's keys live: a standalone server, a primary found by Sentinel, or a Cluster.

How it works: :class:`~._client.RedisClient` makes one object per endpoint kind, all with
the same small surface (discovery and routing are redis-py's):

* :class:`Standalone`: lean connections of our own (:mod:`._resp`): the listener's, which
  subscribes on the server itself and, on RESP3, carries every batch that does not wait for
  replicas (pipelined); others kept for reuse (the client bounds them to
  ``max_connections``).
* :class:`SentinelPrimary`: the same connections, each opened to the primary that redis-py's
  ``Sentinel`` names at that moment; a connection that finds the primary demoted
  (``READONLY``) is dropped, and a failed call is retried by :mod:`._calls`, so it reaches
  the new primary once Sentinel has promoted one. The listener asks the sentinels too, each
  time it (re)connects: it subscribes on the current primary (and Sentinel kills the pub/sub
  clients of a demoted one, so it moves on a manual failover as well).
* :class:`~._cluster.Cluster` (in :mod:`._cluster`): ``RedisCluster``, routing by the run's
  hash tag; the listener subscribes on any node.

Every listener, whatever the kind, is a :class:`~._resp.RespConnection` (:meth:`dial`).
:meth:`execute` runs a batch of commands in one round trip (a pipeline) and, when asked,
ends it with ``WAIT <replicas> <ms>`` on the same connection, so the reply comes only once
that many replicas hold the batch's writes. :meth:`explain` turns what retrying cannot fix
into a one-line error (a service Sentinel does not know, a sentinel refusing the login).
"""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from typing import Any, NamedTuple

from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.exceptions import (
    AuthenticationError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from ._endpoint import RedisEndpoint
from ._options import connection_kwargs, sentinel_kwargs
from ._resp import CONNECT_TIMEOUT, Dialer, RespConnection, pack

__all__ = ["CONNECT_TIMEOUT", "Batch", "SentinelPrimary", "Standalone", "acked"]


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

    #: The listener's connection also carries commands (RESP3), where the server speaks it.
    combines = True

    def __init__(self, endpoint: RedisEndpoint, max_connections: int) -> None:
        self.endpoint = endpoint
        self.dialer = Dialer(endpoint)
        self._idle: list[RespConnection] = []
        self._open: set[RespConnection] = set()
        self._closed = False
        self._combined: RespConnection | None = None
        self._was_combined = False
        self._coming: asyncio.Future[None] | None = None
        #: A listener connection still being opened after a caller gave up waiting for it,
        #: and what tells the others waiting for it that somebody did.
        self._slow: asyncio.Future[None] | None = None
        self._gave_up: tuple[asyncio.Future[None], asyncio.Future[None]] | None = None
        self.redis: Any = self._command_client(max_connections)

    def _command_client(self, max_connections: int) -> Any:
        return None  # connections of our own (:meth:`execute`)

    async def dial(
        self,
        address: tuple[str, int],
        on_push: Callable[[Any], None] | None = None,
        resp3: bool = False,
    ) -> RespConnection:
        """A new connection to ``address`` (see :meth:`Dialer.open <._resp.Dialer.open>`)."""
        conn = await self.dialer.open(address, on_push, resp3)
        if self._closed:
            conn.close()
            raise RedisConnectionError("The client is closed.")
        self._open.add(conn)
        conn.on_lost(lambda _: self._open.discard(conn))
        return conn

    # -- the listener's connection, for commands too --------------------------------------

    def expect(self) -> None:
        """The listener opens its connection: batches wait for it rather than open one."""
        if self.combines and (self._coming is None or self._coming.done()):
            self._coming = asyncio.get_running_loop().create_future()

    def adopt(self, conn: RespConnection | None) -> None:
        """The listener's connection is up and subscribed (``conn``), or failed (``None``):
        batches go on it from now on when it speaks RESP3 (one connection per client)."""
        if self.combines and conn is not None and conn.protocol == 3 and self._may_adopt(conn):
            self._combined = conn
            self._was_combined = True
        coming, self._coming = self._coming, None
        if coming is not None and not coming.done():
            coming.set_result(None)

    def _may_adopt(self, conn: RespConnection) -> bool:
        return not self._closed and not conn.closed

    async def combined(self) -> RespConnection | None:
        """The listener's connection when it carries the commands too (RESP3), once it is
        up; ``None`` when this client has none (RESP2, or no listener yet).

        Raises:
            redis.exceptions.ConnectionError: It has one, lost: the listener opens it again.
        """
        await self.settled()
        conn = self._combined
        if conn is not None and not conn.closed:
            return conn
        if self._was_combined:
            raise RedisConnectionError("the client's connection is being opened again")
        return None

    async def settled(self, within: float | None = None) -> None:
        """Until the listener's connection is up (or failed), if it is being opened, or
        ``within`` seconds passed: a caller's own bound, so that a server that takes
        connections but never answers holds no call for the listener's whole connect
        timeout. Once a caller gave up, nobody waits for that connection any more (the
        others dial their own meanwhile)."""
        coming = self._coming
        if coming is None or coming is self._slow:
            return
        if self._gave_up is None or self._gave_up[0] is not coming:
            self._gave_up = (coming, asyncio.get_running_loop().create_future())
        gave_up = self._gave_up[1]
        # (Neither is cancelled with this caller.)
        await asyncio.wait({coming, gave_up}, timeout=within, return_when=FIRST_COMPLETED)
        if not coming.done() and within is not None:
            self._slow = coming
            if not gave_up.done():
                gave_up.set_result(None)

    def _reusable(self, exclusive: bool) -> RespConnection | None:
        """A connection for a batch: the listener's (pipelined with whatever it carries),
        unless the batch must have one to itself (it waits for replicas); else an idle one."""
        combined = self._combined
        if not exclusive and combined is not None and not combined.closed:
            return combined
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connection(self, exclusive: bool) -> RespConnection:
        conn = self._reusable(exclusive)
        if conn is None and not exclusive and self._coming is not None:
            await self.settled()
            conn = self._reusable(exclusive)
        return conn or await self.dial(await self._primary())

    async def _primary(self) -> tuple[str, int]:
        return self.endpoint.host, self.endpoint.port

    # -- batches --------------------------------------------------------------------------

    def send_now(self, batch: Batch, done: Callable[[Any], None]) -> bool:
        """Send ``batch`` at once on a connection that is up (``False``: none is); ``done``
        gets ``(replies, -1)`` or the failure (an exception)."""
        conn = self._reusable(False)
        if conn is None:
            return False
        self._send(conn, batch, None, done)
        return True

    async def execute(self, batch: Batch, wait: tuple[int, int] | None) -> tuple[list[Any], int]:
        """Replies (or reply errors) of ``batch`` in one round trip, and the replicas that
        acknowledged its writes (``wait``: ``(replicas, ms)``; -1 when not asked)."""
        exclusive = wait is not None and bool(batch.durable)
        conn = await self._connection(exclusive)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(result: Any) -> None:
            if not future.done():
                future.set_result(result)

        self._send(conn, batch, wait, done)
        # (Cancelled meanwhile: the replies still come, in order, and are dropped.)
        result = await future
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def _send(
        self,
        conn: RespConnection,
        batch: Batch,
        wait: tuple[int, int] | None,
        done: Callable[[Any], None],
    ) -> None:
        commands = batch.commands
        waiting = wait is not None and bool(batch.durable)
        packed = b"".join([pack(args) for args in commands])
        count = len(commands)
        if waiting:
            packed += pack(("WAIT", *(wait or ())))
            count += 1

        def finished(replies: list[Any] | None, error: BaseException | None) -> None:
            if replies is None:
                done(error or RedisConnectionError("Connection lost."))
                return
            self._keep(conn, replies)
            done((replies[:-1], acked(replies[-1])) if waiting else (replies, -1))

        try:
            conn.call(packed, count, finished)  # (a dead connection: see its watchdog)
        except RedisConnectionError as exc:
            done(exc)

    def _keep(self, conn: RespConnection, replies: list[Any]) -> None:
        """Reuse ``conn`` (unless the client closed meanwhile, or it reached a replica)."""
        if self._closed or any(isinstance(reply, ReadOnlyError) for reply in replies):
            conn.close()
        elif not conn.closed and conn is not self._combined:
            self._idle.append(conn)

    async def scan(self, pattern: str, limit: int) -> list[bytes]:
        """Keys matching ``pattern`` (``SCAN``), stopping after about ``limit`` of them."""
        found: list[bytes] = []
        cursor: Any = 0
        while True:
            batch = Batch([("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)], [None], [])
            (reply,), _ = await self.execute(batch, None)
            if isinstance(reply, Exception):
                raise reply
            cursor, keys = reply
            found.extend(k if isinstance(k, bytes) else str(k).encode() for k in keys)
            if len(found) >= limit or int(cursor) == 0:
                return found

    async def pubsub_address(self) -> tuple[str, int]:
        """Where the listener subscribes next."""
        return self.endpoint.host, self.endpoint.port

    async def presence_address(self, route: str) -> tuple[str, int]:
        """Where a node's named connection goes: the server holding the key ``route``."""
        return await self._primary()

    def address_now(self, route: str) -> tuple[str, int] | None:
        """Where the commands on ``route`` go now, as known without asking (``None``: the
        one place there is)."""
        return None

    async def explain(self, exc: BaseException) -> str | None:
        """A one-line message when ``exc`` is a failure that retrying cannot fix."""
        return None

    def describe(self, exc: BaseException) -> str:
        """``exc`` in a few words for a message (retries ran out)."""
        return str(exc) or type(exc).__name__

    async def aclose(self) -> None:
        """Close every connection."""
        self._closed = True
        self._idle = []
        self._combined = None
        self.adopt(None)
        for conn in list(self._open):
            conn.close()


class SentinelPrimary(Standalone):
    """The primary of a service that Redis Sentinel watches. See the module docstring."""

    def _command_client(self, max_connections: int) -> Any:
        endpoint = self.endpoint
        assert endpoint.service is not None
        kwargs = connection_kwargs(endpoint)
        # Typed from redis-py 8 on, untyped before: called through Any for both.
        sentinel: Any = Sentinel
        self.sentinel = sentinel(
            list(endpoint.hosts), sentinel_kwargs=sentinel_kwargs(endpoint, kwargs)
        )
        self._at: tuple[str, int] | None = None
        return None

    async def _primary(self) -> tuple[str, int]:
        address = await self._discover()
        if address != self._at:  # a failover: connections to the old primary go
            self._at = address
            idle, self._idle = self._idle, []
            for conn in idle:
                conn.close()
        return address

    def _may_adopt(self, conn: RespConnection) -> bool:
        if self._at is None:
            self._at = conn.address
        return conn.address == self._at and super()._may_adopt(conn)

    async def pubsub_address(self) -> tuple[str, int]:
        """The primary that the sentinels name now."""
        return await self._discover()

    def address_now(self, route: str) -> tuple[str, int] | None:
        return self._at

    async def _discover(self) -> tuple[str, int]:
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
        # Each sentinel's client (redis-py's Sentinel has its own aclose() from 8.1 on only).
        for client in self.sentinel.sentinels:
            await client.aclose()


def acked(reply: Any) -> int:
    return reply if isinstance(reply, int) else 0
