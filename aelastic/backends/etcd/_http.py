"""A lean HTTP/1.1 client for etcd's JSON gateway: kept-alive connections, pipelined
requests, streamed answers.

How it works: a :class:`Pool` keeps idle connections per member. :meth:`Pool.exchange`
writes one or more requests on one connection in a single write (HTTP/1.1 pipelining:
etcd's server answers them in order, each after the one before it was carried out) and
reads their answers; :meth:`Pool.stream` opens a connection of its own for a streamed
answer (a watch) and hands out its body as it arrives. A connection whose exchange failed,
timed out or was cancelled is closed, never reused. The answers of etcd's gateway are
regular (a status line, headers, a body sized by ``Content-Length`` or chunked); a server
whose answer is not HTTP raises :class:`~._answers.NotEtcd`, one that closes the
connection unanswered :class:`~._answers.Hangup` (also during a TLS handshake: a port
without TLS), a member that cannot be reached or is too slow :class:`~._answers.Transient`,
TLS that cannot work (a certificate not trusted or not for the host: the default context
checks both; a client certificate the member refused) :class:`~._answers.TlsFailure`.

Why not aiohttp (aelastic's HTTP client elsewhere): measured on the 2-core machine, 256
clients on one event loop renewing leases against one etcd 3.4.23 (1,536 requests a run,
loads 12-17): aiohttp took 0.35-0.40 ms of the node's CPU per request, this client
0.08-0.10 ms; a formation of 1,024 nodes sends about 6,000 requests. And aiohttp does not
pipeline, which a node's first join needs: its lease grant and its join go in one write,
so etcd carries them out back to back and the lease's time to live counts from the join,
as the state machine's heartbeat window does. In two round trips, a busy etcd queued every
node's grant before any join and the leases ran out before their joins arrived
(docs/benchmarks.md, the etcd section).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import NamedTuple, TypeVar, cast

from ...core.race import wait_within
from ._answers import Hangup, NotEtcd, Transient, tls_failure

__all__ = ["Pool", "Response", "request_bytes"]

#: Longest status line and headers accepted (etcd's are a few hundred bytes).
_MAX_HEAD = 64 * 1024
_UNTIL_CLOSE = -2  # a body that ends when the server closes the connection
_CHUNKED = -1
_P = TypeVar("_P", bound=asyncio.BaseProtocol)


class Response(NamedTuple):
    """An answer: its HTTP status and body."""

    status: int
    body: bytes


def request_bytes(host: str, path: str, body: bytes, token: str | None = None) -> bytes:
    """One POST of a JSON ``body`` to ``path`` (with etcd's auth token, if any)."""
    auth = f"Authorization: {token}\r\n" if token else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{auth}\r\n"
    )
    return head.encode("latin-1") + body


class _Answer:
    """The answer a request waits for: whole (``done``), or streamed (``chunks``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, streamed: bool = False) -> None:
        self.streamed = streamed
        self.done: asyncio.Future[Response] = loop.create_future()
        self.status: asyncio.Future[int] = loop.create_future()
        self.chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.started = False
        self._body = bytearray()
        self._code = 0

    def head(self, code: int) -> None:
        self._code = code
        if not self.status.done():
            self.status.set_result(code)

    def data(self, data: bytes) -> None:
        if self.streamed:
            self.chunks.put_nowait(bytes(data))
        else:
            self._body += data

    def end(self) -> None:
        if self.streamed:
            self.chunks.put_nowait(None)
        elif not self.done.done():
            self.done.set_result(Response(self._code, bytes(self._body)))

    def fail(self, exc: BaseException) -> None:
        for future in (self.done, self.status):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: a waiter may be gone
        if self.streamed:
            self.chunks.put_nowait(exc)


class _Connection(asyncio.Protocol):
    """One connection to a member, reading its answers in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep = True  # reusable once its answers are read
        self._buf = bytearray()
        self._answers: deque[_Answer] = deque()
        self._length: int | None = None  # of the body being read; None: reading a head
        self._chunk: int | None = None  # bytes left of the current chunk (chunked bodies)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not isinstance-checked: uvloop's stream transports are not asyncio.Transports.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes, answers: list[_Answer]) -> None:
        assert self.transport is not None
        self._answers.extend(answers)
        self.transport.write(data)

    @property
    def idle(self) -> bool:
        return not self._answers and not self.closed and self.keep

    def close(self) -> None:
        self.keep = False
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except NotEtcd as exc:
            self._fail(exc)
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answers and self._length == _UNTIL_CLOSE:
            self._answers[0].data(bytes(self._buf))
            self._finish()
        if self._answers:
            started = self._answers[0].started
            error: Exception | None = None if exc is None else tls_failure(exc)
            if error is None:
                error = (
                    Transient("the connection broke during an answer")
                    if started
                    else Hangup("it closed the connection without an answer")
                )
            self._fail(error)

    def _fail(self, exc: BaseException) -> None:
        answers, self._answers = self._answers, deque()
        for answer in answers:
            answer.fail(exc)

    def _finish(self) -> None:
        self._answers.popleft().end()
        self._length = self._chunk = None

    def _parse(self) -> None:
        while self._buf:
            if not self._answers:
                raise NotEtcd("an answer to no request")
            if self._length is None:
                if not self._read_head():
                    return
            elif self._length == _CHUNKED:
                if not self._read_chunk():
                    return
            elif self._length == _UNTIL_CLOSE:
                self._answers[0].data(bytes(self._buf))
                self._buf.clear()
                return
            else:
                take = min(self._length, len(self._buf))
                self._answers[0].data(bytes(self._buf[:take]))
                del self._buf[:take]
                self._length -= take
                if self._length:
                    return
                self._finish()

    def _read_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD or not b"HTTP/1.".startswith(bytes(self._buf[:7])):
                raise NotEtcd(f"an answer that is not HTTP ({bytes(self._buf[:40])!r})")
            return False
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[: end + 4]
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise NotEtcd(f"an answer that is not HTTP ({lines[0][:40]!r})")
        code = int(status[1])
        length, chunked = None, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                if not value.strip().isdigit():
                    raise NotEtcd("an answer with a malformed Content-Length")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection" and b"close" in value.lower():
                self.keep = False
        if status[0] == b"HTTP/1.0":
            self.keep = False
        answer = self._answers[0]
        answer.started = True
        answer.head(code)
        if chunked:
            self._length = _CHUNKED
        elif length is not None:
            self._length = length
            if not length:
                self._finish()
        else:
            self._length, self.keep = _UNTIL_CLOSE, False
        return True

    def _read_chunk(self) -> bool:
        if self._chunk is None:
            end = self._buf.find(b"\r\n")
            if end < 0:
                return False
            size = bytes(self._buf[:end]).split(b";", 1)[0].strip()
            try:
                self._chunk = int(size, 16)
            except ValueError:
                raise NotEtcd("an answer with a malformed chunk") from None
            del self._buf[: end + 2]
            if self._chunk == 0:
                self._chunk = -1  # the last chunk: the trailer's empty line follows
        if self._chunk < 0:
            end = self._buf.find(b"\r\n\r\n" if self._buf[:2] != b"\r\n" else b"\r\n")
            if end < 0:
                return False
            del self._buf[: end + (2 if self._buf[:2] == b"\r\n" else 4)]
            self._finish()
            return True
        if len(self._buf) < self._chunk + 2:
            return False
        self._answers[0].data(bytes(self._buf[: self._chunk]))
        del self._buf[: self._chunk + 2]
        self._chunk = None
        return True


class Pool:
    """Connections to the members of one cluster (see the module docstring).

    Args:
        ssl_context: TLS of the members' connections (``None``: plain HTTP).
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def _connect(self, host: str, port: int, within: float) -> _Connection:
        connection = await self.connect(_Connection, host, port, within)
        self._open.add(connection)
        return connection

    async def connect(self, factory: Callable[[], _P], host: str, port: int, within: float) -> _P:
        """A connection to a member speaking protocol ``factory()`` (TLS as the pool's),
        errors as :meth:`exchange`'s (a connection made here is its caller's to close)."""
        loop = asyncio.get_running_loop()
        try:
            _, connection = await wait_within(
                loop.create_connection(
                    factory, host, port, ssl=self._ssl,
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

    def _take(self, host: str, port: int) -> _Connection | None:
        idle = self._idle.get((host, port))
        while idle:
            connection = idle.pop()
            if connection.idle:
                return connection
            self._open.discard(connection)
        return None

    async def exchange(
        self, host: str, port: int, data: bytes, timeout: float, connect: float, count: int = 1
    ) -> list[Response]:
        """Send ``count`` requests on one connection in one write; their answers, in order.

        Args:
            host, port: The member.
            data: The requests, whole (:func:`request_bytes`), one after the other.
            count: How many requests ``data`` holds.
            timeout: Seconds for the whole exchange.
            connect: Seconds connecting may take (within ``timeout``).

        Raises:
            Transient: The member could not be reached, or did not answer in time.
            Hangup: It closed the connection without an answer.
            NotEtcd: Its answer is not HTTP.
            TlsFailure: TLS cannot work with it (see the module docstring).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        connection = self._take(host, port)
        if connection is None:
            connection = await self._connect(host, port, min(connect, timeout))
        answers = [_Answer(loop) for _ in range(count)]
        kept = False
        try:
            connection.send(data, answers)
            responses = []
            for answer in answers:
                left = deadline - loop.time()
                try:
                    responses.append(await wait_within(asyncio.shield(answer.done), left))
                except TimeoutError:
                    raise Transient(f"no answer within {timeout:g} s") from None
            kept = connection.idle
            return responses
        finally:
            if kept:
                self._idle.setdefault((host, port), []).append(connection)
            else:
                connection.close()
                self._open.discard(connection)

    @asynccontextmanager
    async def stream(
        self, host: str, port: int, request: bytes, connect: float
    ) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """A streamed answer on a connection of its own: its status and its body's pieces
        as they arrive (the connection is closed on leaving).

        Raises:
            Transient, Hangup, NotEtcd, TlsFailure: As :meth:`exchange` (also while reading).
        """
        loop = asyncio.get_running_loop()
        connection = await self._connect(host, port, connect)
        answer = _Answer(loop, streamed=True)
        try:
            connection.send(request, [answer])
            status = await answer.status

            async def pieces() -> AsyncIterator[bytes]:
                while True:
                    piece = await answer.chunks.get()
                    if piece is None:
                        return
                    if isinstance(piece, BaseException):
                        raise piece
                    yield piece

            yield status, pieces()
        finally:
            connection.close()
            self._open.discard(connection)

    def close(self) -> None:
        """Close every connection."""
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()
