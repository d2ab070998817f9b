"""The HTTP/2 connections of one client to the members of an etcd cluster: one per member.

How it works: :meth:`Pool.connection` gives the member's open connection (:mod:`._h2`),
or opens one (callers that ask while it opens wait for the same one); every call of the
client, its watch and its keep-alive stream share it. :meth:`Pool.exchange` carries out
several calls: one after the other (each started once the one before was answered), as a
node's first join needs (its lease granted before the join that uses it: etcd carries
each call of a connection out on its own, in any order, and renews a lease only once its
grant was applied); or all in one write, when their order does not matter. A connection
that failed, that etcd ended or that broke the protocol (:mod:`._limits`) is dropped for
the next call; a call that times out or is cancelled is reset, and the connection stays,
unless the member left this side's writes unread meanwhile (a member that reads nothing
holds nothing more of this side's). A member that takes a connection and says nothing at
all (:data:`SILENT`) is given up, and the call tried again. A streamed call's answers wait
for their reader within :data:`~._limits.MAX_UNREAD` bytes.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from ...core.race import wait_within
from ._answers import Hangup, Misbehaved, NotEtcd, Transient, etcd_error, tls_failure
from ._h2 import Call, Connection, Metadata
from ._limits import MAX_UNREAD
from ._proto import Method, ProtoError, Schema, decode

__all__ = ["SILENT", "Answer", "Arrived", "Pool", "answers"]

#: A member that took the connection and said nothing for this long (not even HTTP/2's
#: settings) is given up, and the call tried again: an attempt at the only member would
#: otherwise wait out the whole read timeout (60 s) in silence, and say nothing meanwhile.
#: An etcd member sends its settings as its server takes the connection, before it reads
#: any request: a member that is only slow to answer requests still says that much.
SILENT = 10.0


class Answer(NamedTuple):
    """A call's end: its gRPC status and message, and its answer's messages."""

    code: int
    text: str
    messages: list[bytes]


class Pool:
    """The connections to the members (see the module docstring).

    Args:
        ssl_context: TLS of the members' connections (``None``: plain HTTP/2); its ALPN is
            set to ``h2``.
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        if ssl_context is not None:
            ssl_context.set_alpn_protocols(["h2"])
        self._open: dict[tuple[str, int], Connection] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[Connection]] = {}
        self._all: set[Connection] = set()
        self._closed = False

    async def connection(self, host: str, port: int, within: float) -> Connection:
        """The open connection to member ``host:port``, opened within ``within`` s if none.

        Raises:
            Transient: It cannot be reached in time.
            Hangup: It closed the connection during the TLS handshake (no TLS there).
            TlsFailure: TLS cannot work with it.
        """
        key = (host, port)
        connection = self._open.get(key)
        if connection is not None:
            if connection.usable:
                return connection
            self._drop(connection)
        opening = self._opening.get(key)
        if opening is None:
            opening = asyncio.ensure_future(self._connect(host, port, within))
            self._opening[key] = opening
            opening.add_done_callback(lambda done: self._opened(key, done))
        try:
            return await wait_within(asyncio.shield(opening), within)
        except TimeoutError:
            raise Transient(f"no connection within {within:g} s") from None

    def _opened(self, key: tuple[str, int], done: asyncio.Future[Connection]) -> None:
        if self._opening.get(key) is done:
            del self._opening[key]
        if done.cancelled() or done.exception() is not None:
            return
        connection = done.result()
        if self._closed:
            connection.close()
            return
        self._open[key] = connection
        self._all.add(connection)

    async def _connect(self, host: str, port: int, within: float) -> Connection:
        loop = asyncio.get_running_loop()
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        scheme = "https" if self._ssl else "http"
        try:
            _, connection = await wait_within(
                loop.create_connection(
                    lambda: Connection(authority, scheme), host, port, ssl=self._ssl,
                    server_hostname=host if self._ssl else None,
                ),
                within,
            )  # fmt: skip
        except TimeoutError:
            raise Transient(f"no connection within {within:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            failure = tls_failure(exc)
            if failure is not None:
                raise failure from None
            if self._ssl is not None and isinstance(
                exc, (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
            ):  # accepted, then closed during the handshake: a server without TLS does
                raise Hangup("it closed the connection during the TLS handshake") from None
            raise Transient(str(exc) or type(exc).__name__) from None
        return connection

    async def exchange(
        self,
        host: str,
        port: int,
        calls: list[tuple[str, bytes]],
        metadata: Metadata,
        timeout: float,
        connect: float,
        ordered: bool = True,
    ) -> list[Answer]:
        """The calls ``(method, request)``: their answers, in order. ``ordered``: each
        started once the one before was answered (etcd carries each out after the one
        before); else all in one write (carried out in any order).

        Raises:
            Transient: The member could not be reached, or did not answer in time.
            Hangup, NotEtcd, TlsFailure: See :mod:`._h2`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        connection = await self.connection(host, port, min(connect, timeout))
        started: list[Call] = []
        try:
            if not ordered:
                started = [connection.call(m, request, metadata) for m, request in calls]
            answers = []
            for index, (method, request) in enumerate(calls):
                if ordered:
                    if connection.closed:  # the member went away after an answer
                        connection = await self.connection(host, port, min(connect, timeout))
                    started.append(connection.call(method, request, metadata))
                call = started[index]
                await _spoken(connection, call, deadline)
                try:
                    code, text = await wait_within(
                        asyncio.shield(call.done), deadline - loop.time()
                    )
                except TimeoutError:
                    if connection.writing_paused:
                        connection.close()  # the member reads nothing: it holds no more
                    raise Transient(f"no answer within {timeout:g} s") from None
                answers.append(Answer(code, text, call.messages))
            return answers
        finally:
            for call in started:
                if not call.done.done():
                    call.cancel()
            if connection.closed:
                self._drop(connection)

    @asynccontextmanager
    async def stream(
        self,
        host: str,
        port: int,
        method: Method,
        requests: list[bytes],
        metadata: Metadata,
        connect: float,
        deadline: float | None,
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streamed call of ``method`` (a watch): its ``requests`` sent in order, then
        its answers one by one (until ``deadline``, when given); the call is left (reset)
        on leaving.

        Raises:
            Transient, Hangup, NotEtcd, TlsFailure: As :meth:`exchange` (also while reading).
            EtcdError: etcd ended the call with an error.
        """
        connection = await self.connection(host, port, connect)
        arrived = Arrived()
        first, *more = requests
        call = connection.call(method.path, first, metadata, False, arrived.append)
        try:
            for request in more:
                call.send(request)
            call.done.add_done_callback(lambda _: arrived.woken.set())
            yield answers(call, arrived, method.answer, deadline)
        finally:
            call.cancel()

    def _drop(self, connection: Connection) -> None:
        for key, known in list(self._open.items()):
            if known is connection:
                del self._open[key]
        self._all.discard(connection)

    async def aclose(self) -> None:
        """Close every connection, once those still opening gave up (a connection
        abandoned mid-handshake would be left to the garbage collector). Idempotent."""
        self._closed = True
        openings = list(self._opening.values())
        for opening in openings:
            opening.cancel()
        await asyncio.gather(*openings, return_exceptions=True)
        for connection in list(self._all):
            connection.close()
        self._all.clear()
        self._open.clear()


class Arrived:
    """A streamed call's messages that arrived and were not read yet (at most
    :data:`~._limits.MAX_UNREAD` bytes), and the event that wakes their reader."""

    def __init__(self) -> None:
        self._messages: deque[bytes] = deque()
        self._unread = 0
        self.woken = asyncio.Event()

    def append(self, message: bytes) -> None:
        """Keep one more message (the call's callback).

        Raises:
            Misbehaved: Over :data:`~._limits.MAX_UNREAD` bytes wait for the reader.
        """
        self._unread += len(message)
        if self._unread > MAX_UNREAD:
            raise Misbehaved(
                f"it streamed answers faster than they were read (over {MAX_UNREAD} bytes waiting)"
            )
        self._messages.append(message)
        self.woken.set()

    def __bool__(self) -> bool:
        return bool(self._messages)

    def popleft(self) -> bytes:
        """The oldest message."""
        message = self._messages.popleft()
        self._unread -= len(message)
        return message


async def _spoken(connection: Connection, call: Call, deadline: float) -> None:
    """Wait until the member said anything on ``connection`` (its HTTP/2 settings, which
    an etcd member sends as it takes a connection), for :data:`SILENT` s at most.

    Raises:
        Transient: It said nothing for that long (the connection is closed).
    """
    if connection.heard.done():
        return
    loop = asyncio.get_running_loop()
    within = min(SILENT, deadline - loop.time())
    waits: set[asyncio.Future[Any]] = {connection.heard, call.done}
    await asyncio.wait(waits, timeout=max(within, 0.0), return_when=asyncio.FIRST_COMPLETED)
    if not connection.heard.done() and not call.done.done() and within >= SILENT:
        connection.close()
        raise Transient(f"it took the connection and said nothing for {SILENT:g} s")


async def answers(
    call: Call, arrived: Arrived, schema: Schema, deadline: float | None
) -> AsyncIterator[dict[str, Any]]:
    """A streamed call's answers (as they arrive), until it ends (etcd's refusal raised)
    or ``deadline``."""
    loop = asyncio.get_running_loop()
    woken = arrived.woken
    while True:
        while arrived:
            try:
                yield decode(schema, arrived.popleft())
            except ProtoError as exc:
                raise NotEtcd(f"a streamed answer not understood ({exc})") from None
        if call.done.done():
            code, text = call.done.result()  # raises the connection's error
            if code:
                raise etcd_error(text, code)
            return
        woken.clear()
        try:
            if deadline is None:
                await woken.wait()
            else:
                await wait_within(woken.wait(), deadline - loop.time())
        except TimeoutError:
            raise Transient("the stream's time ran out") from None
