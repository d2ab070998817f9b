"""A lean Redis connection: pipelined commands on one socket, with pub/sub on the same one.

Why our own, for a measured reason: every rendezvous node has its own connection (separate
hosts have nothing to share), so what a connection costs is paid per node. With redis-py's
asyncio ``Connection`` (streams, a task per write under its socket timeout, a timeout context
per read, an event dispatcher and re-auth listeners per connection) and ``Redis`` client (its
pool's lock and checks, observability hooks), one ``PING`` cost ~140 µs of CPU, a connection
~150 µs to open and ~30 objects for the garbage collector to walk, and a pub/sub connection
takes no other command, so a node held two. A join cost ~2 ms of the node's CPU and 4,096
simulated nodes on two cores were bound by it. This protocol on asyncio's transport: ~22 µs
a ``PING``, ~85 µs a connection, 8 objects, and one connection per node where the server
speaks RESP3; a join ~0.6 ms (``benchmarks/rdzv_scale.py``; the figures in docs/benchmarks.md).

What it keeps from redis-py: the exception classes (an error reply becomes the same
``NoScriptError``, ``ReadOnlyError``, ``AuthenticationError``... through redis-py's own
``parse_error``), the TLS context (redis-py's defaults), and the messages of connection
failures. Sentinel discovery and Cluster routing stay redis-py's (:mod:`._servers`,
:mod:`._cluster`); the encoding is in :mod:`._codec`.

How it works: :class:`RespConnection` is an asyncio protocol. :meth:`~RespConnection.call`
writes packed commands and calls back with their replies, in order as they are parsed (no
task, no future per reply); an error reply is an exception *object* among them (as
redis-py's pipelines give them), a lost connection calls back with the reason, and one
watchdog timer per connection closes it when a call waits too long. A connection opened with
``on_push`` is a subscriber: on RESP3 (``HELLO 3``, Redis 6 and later) pushes go to that
callback and replies to the calls, so the one connection serves both; on RESP2 every reply
goes to the callback (a subscribed RESP2 connection takes no other command). :class:`Dialer`
opens connections: TCP (or TLS), then ``HELLO 3`` (with the login) or ``AUTH``, and
``SELECT``, in one round trip, within :data:`CONNECT_TIMEOUT`; a server without ``HELLO``
gets RESP2.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Callable
from typing import Any, cast

from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    InvalidResponse,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...core.race import wait_within
from ._codec import PING, Incomplete, Push, pack, parse
from ._endpoint import RedisEndpoint

__all__ = ["CONNECT_TIMEOUT", "Dialer", "Done", "RespConnection", "pack"]

#: Seconds to open a connection (TCP, TLS, AUTH) before that attempt counts as failed, and
#: to wait for the replies of a batch before its connection counts as dead.
CONNECT_TIMEOUT = 10.0

#: Called with a request's replies, or with why the connection was lost before they came.
Done = Callable[[list[Any] | None, BaseException | None], None]


class _Call:
    __slots__ = ("count", "done", "marker", "replies", "sent_at")

    def __init__(self, count: int, done: Done, sent_at: float, marker: bytes | None) -> None:
        self.count = count
        self.done = done
        self.sent_at = sent_at
        self.marker = marker
        self.replies: list[Any] = []


class RespConnection(asyncio.Protocol):
    """One connection to a Redis server (see the module docstring).

    A call unanswered for :data:`CONNECT_TIMEOUT` seconds means a dead connection (a
    half-open socket): it is closed, and its calls fail with a timeout. One watchdog timer
    per connection checks that (armed when a call goes out and none is armed), not one timer
    per call.

    Args:
        address: The server's host and port.
        on_push: Makes it a subscriber: called with every push (RESP3), or with every
            reply (RESP2: a subscribed connection takes no other command).
    """

    def __init__(
        self, address: tuple[str, int], on_push: Callable[[Any], None] | None = None
    ) -> None:
        self.address = address
        self.where = f"{address[0]}:{address[1]}"
        self.on_push = on_push
        #: The protocol spoken (3 after ``HELLO 3``): RESP3 carries commands and pushes.
        self.protocol = 2
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._calls: collections.deque[_Call] = collections.deque()
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        #: Why the connection was lost (``None`` while it is not).
        self.reason: BaseException | None = None
        self._on_lost: list[Callable[[BaseException], None]] = []
        #: The loop's time when bytes last arrived.
        self.received_at = self._loop.time()
        #: The name given to it (``CLIENT SETNAME``), if any (see :mod:`._presence`).
        self.client_name: str | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not isinstance-checked: uvloop's stream transports are not asyncio.Transports.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_at = self._loop.time()
        buf = self._buffer
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                reply, pos = parse(buf, pos)
                self._deliver(reply)
        except Incomplete:
            pass
        except InvalidResponse as exc:
            self.close(exc)
            return
        del buf[:pos]

    def eof_received(self) -> bool:
        self.close(RedisConnectionError("Connection closed by server."))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            reason: BaseException = RedisConnectionError("Connection closed by server.")
        elif isinstance(exc, OSError):
            reason = RedisConnectionError(f"Error while reading from {self.where} : {exc.args}")
        else:
            reason = exc
        self._fail(reason)

    # -- use ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the connection is lost (or being closed)."""
        return self.reason is not None

    def call(self, packed: bytes, count: int, done: Done, marker: bytes | None = None) -> None:
        """Send ``count`` packed commands; ``done(replies, None)`` once every reply came (in
        order; an error reply is an exception object), or ``done(None, reason)`` if the
        connection is lost first. With ``marker``, the call takes every reply up to one
        equal to it (commands whose replies may or may not come, such as ``SUBSCRIBE`` on
        RESP3, then ``PING marker``). ``done`` runs in the protocol's callback: it must not
        block or raise.

        Raises:
            redis.exceptions.ConnectionError: The connection is lost.
        """
        if self.reason is not None or self._transport is None:
            raise RedisConnectionError(f"Connection to {self.where} is closed.")
        now = self._loop.time()
        self._calls.append(_Call(count, done, now, marker))
        if self._watchdog is None:
            self._watchdog = self._loop.call_at(now + CONNECT_TIMEOUT, self._check)
        self._transport.write(packed)

    def _check(self) -> None:
        """The watchdog: close when the oldest call waited too long, else look again when
        it would have."""
        self._watchdog = None
        if not self._calls or self.reason is not None:
            return
        due = self._calls[0].sent_at + CONNECT_TIMEOUT
        if self._loop.time() >= due:
            self.close(RedisTimeoutError(f"Timeout reading from {self.where}"))
        else:
            self._watchdog = self._loop.call_at(due, self._check)

    async def request(self, packed: bytes, count: int, marker: bytes | None = None) -> list[Any]:
        """:meth:`call`, awaited: the replies (a lost connection raises its reason)."""
        future: asyncio.Future[list[Any]] = self._loop.create_future()

        def done(replies: list[Any] | None, error: BaseException | None) -> None:
            if future.done():
                return
            if replies is None:
                future.set_exception(error or RedisConnectionError("Connection lost."))
            else:
                future.set_result(replies)

        self.call(packed, count, done, marker)
        return await future

    def send(self, packed: bytes) -> None:
        """Send commands whose replies go to ``on_push`` (a RESP2 subscriber's)."""
        if self.reason is None and self._transport is not None:
            self._transport.write(packed)

    def ping(self) -> None:
        """Send a ``PING`` (a subscriber's liveness check; its answer is dropped)."""
        if self.protocol == 3:
            with contextlib.suppress(RedisConnectionError):
                self.call(PING, 1, _dropped)
        else:
            self.send(PING)  # the answer goes to on_push

    def on_lost(self, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook(reason)`` when the connection is lost (at once if it is)."""
        if self.reason is not None:
            hook(self.reason)
        else:
            self._on_lost.append(hook)

    def close(self, reason: BaseException | None = None) -> None:
        """Close the connection; pending replies fail with ``reason``."""
        self._fail(reason or RedisConnectionError(f"Connection to {self.where} is closed."))

    def _deliver(self, reply: Any) -> None:
        on_push = self.on_push
        if on_push is None or (self.protocol == 3 and type(reply) is not Push):
            if not self._calls:
                if on_push is not None and isinstance(reply, Exception):
                    self.close(reply)  # a RESP3 subscription refused (nothing else asked)
                return
            call = self._calls[0]
            call.replies.append(reply)
            if call.marker is None:
                complete = len(call.replies) == call.count
            else:
                complete = reply == call.marker
            if complete:
                self._calls.popleft()
                call.done(call.replies, None)
            return
        if isinstance(reply, Exception):  # RESP2: e.g. a subscription the ACL refused
            self.close(reply)
            return
        try:
            on_push(reply)
        except Exception as exc:  # the subscriber's owner sees it as the reason
            self.close(exc)

    def _fail(self, reason: BaseException) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        first = self.reason is None
        if first:
            self.reason = reason
        while self._calls:
            self._calls.popleft().done(None, reason)
        if first:
            hooks, self._on_lost = self._on_lost, []
            for hook in hooks:
                hook(reason)
        if self._transport is not None:
            self._transport.close()


def _dropped(replies: list[Any] | None, error: BaseException | None) -> None:
    pass


class Dialer:
    """Opens connections to the data nodes of an endpoint (same options for every node).

    Args:
        endpoint: Credentials, database, TLS options.
    """

    def __init__(self, endpoint: RedisEndpoint) -> None:
        self._endpoint = endpoint
        self._ssl: Any = None
        handshake: list[tuple[Any, ...]] = []
        if endpoint.password:
            if endpoint.username:
                handshake.append(("AUTH", endpoint.username, endpoint.password))
            else:
                handshake.append(("AUTH", endpoint.password))
        self._auth = len(handshake)
        if endpoint.db:
            handshake.append(("SELECT", endpoint.db))
        self._handshake = handshake
        self._packed = b"".join(pack(c) for c in handshake)
        # RESP3: HELLO logs in too; None until a server said whether it speaks it.
        hello: tuple[Any, ...] = ("HELLO", 3)
        if endpoint.password:
            hello += ("AUTH", endpoint.username or "default", endpoint.password)
        self._hello = pack(hello) + b"".join(pack(c) for c in handshake[self._auth :])
        self._hello_count = 1 + len(handshake) - self._auth
        self.resp3: bool | None = None

    def _ssl_context(self) -> Any:
        if self._ssl is None:
            from redis.asyncio.connection import SSLConnection  # redis-py's TLS defaults

            e = self._endpoint
            self._ssl = SSLConnection(
                ssl_ca_certs=e.ssl_ca_certs,
                ssl_certfile=e.ssl_certfile,
                ssl_keyfile=e.ssl_keyfile,
                ssl_cert_reqs=e.ssl_cert_reqs,
            ).ssl_context.get()
        return self._ssl

    async def open(
        self,
        address: tuple[str, int],
        on_push: Callable[[Any], None] | None = None,
        resp3: bool = False,
    ) -> RespConnection:
        """A connection to ``address``, logged in and on the endpoint's database; with
        ``resp3``, speaking RESP3 if the server does (Redis 6 and later).

        Raises:
            redis.exceptions.ConnectionError: It could not be opened.
            redis.exceptions.TimeoutError: Not within :data:`CONNECT_TIMEOUT`.
            redis.exceptions.AuthenticationError: The server refused the login.
        """
        host, port = address
        where = f"{host}:{port}"
        conn = RespConnection((host, port), None)
        try:
            await wait_within(self._connect(conn, host, port, resp3), CONNECT_TIMEOUT)
        except asyncio.TimeoutError:
            conn.close()
            raise RedisTimeoutError("Timeout connecting to server") from None
        except OSError as exc:
            conn.close()
            raise RedisConnectionError(_connect_error(where, exc)) from None
        except BaseException:
            conn.close()
            raise
        conn.on_push = on_push
        return conn

    async def _connect(self, conn: RespConnection, host: str, port: int, resp3: bool) -> None:
        loop = asyncio.get_running_loop()
        ssl = self._ssl_context() if self._endpoint.tls else None
        transport, _ = await loop.create_connection(lambda: conn, host, port, ssl=ssl)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if resp3 and self.resp3 is not False:
            replies = await conn.request(self._hello, self._hello_count)
            said = replies[0]
            if not _no_hello(said):
                for said in replies:
                    if isinstance(said, Exception):
                        raise said
                self.resp3 = True
                conn.protocol = 3
                return
            self.resp3 = False  # an older server: RESP2, the listener on a connection of its own
        if not self._handshake:
            return
        replies = await conn.request(self._packed, len(self._handshake))
        if self._auth and isinstance(replies[0], AuthenticationWrongNumberOfArgsError):
            # A server before Redis 6 takes a password alone.
            rest = self._handshake[1:]
            packed = pack(("AUTH", self._endpoint.password)) + b"".join(pack(c) for c in rest)
            replies = await conn.request(packed, 1 + len(rest))
        for said in replies:
            if isinstance(said, Exception):
                raise said
        if self._auth and replies[0] != b"OK":
            raise AuthenticationError("Invalid Username or Password")


def _no_hello(said: Any) -> bool:
    """Whether ``HELLO`` failed because the server does not have it (before Redis 6), the
    user may not run it (ACL), or before a login it was not given (commands will say so)."""
    if not isinstance(said, RedisError):
        return False
    text = str(said).lower()
    return any(why in text for why in ("unknown command", "noproto", "authenticated", "hello"))


def _connect_error(where: str, exc: OSError) -> str:
    """redis-py's words for a failed connect (``Error 111 connecting to h:p. ...``)."""
    if not exc.args:
        return f"Error connecting to {where}."
    if len(exc.args) == 1:
        return f"Error {exc.args[0]} connecting to {where}."
    return f"Error {exc.args[0]} connecting to {where}. {exc.args[1]}."
