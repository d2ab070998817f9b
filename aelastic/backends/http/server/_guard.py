"""The server's door: how many connections it holds, and how long a client may take.

How it works: the server listens through a :class:`ConnectionGuard`, a protocol factory
wrapped around aiohttp's (``runner.server``). Each connection gets a :class:`_Guarded`
protocol that hands every event to aiohttp's handler and keeps one deadline, re-armed
lazily (one ``loop.call_at`` timer per connection, like aiohttp's keep-alive timer):

* a new connection must deliver a request's head within ``read_timeout`` of opening (a
  client that sends nothing, or its headers a byte at a time, is dropped);
* between requests, a kept-alive connection may stay idle ``keepalive_timeout``; once a
  byte of the next request arrives, its head must be complete within ``read_timeout``;
* while a request is being handled there is no deadline (the app's :meth:`middleware`
  says when): a long-poll waits on the server, not on the client. The routes bound the
  body's read themselves (``read_timeout`` again); a rendezvous channel (a WebSocket: one
  long request) closes itself once idle for ``keepalive_timeout`` (:mod:`._channel`).

Past ``max_connections`` open connections, a new one is answered ``503`` and closed. Every
refusal, and every ``accept()`` that failed for want of file descriptors (asyncio's
traceback each time, replaced by :func:`quiet_accept_errors`), is logged as one line at
most every :data:`LOG_EVERY` seconds, with the count. :func:`raise_open_file_limit` lifts
the process's soft ``RLIMIT_NOFILE`` to its hard limit; :func:`connection_limit` keeps the
connection limit below the soft one, room left for accepts under way and the journal.

Hand-written because aiohttp's server has no connection limit, and its one keep-alive
timer (idle between requests and, in recent releases only, from the connect) cannot tell a
client slow to send its request from one idle between requests.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web

__all__ = [
    "BACKLOG",
    "DEFAULT_KEEPALIVE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_READ_TIMEOUT",
    "LOG_EVERY",
    "ConnectionGuard",
    "RateLimitedLog",
    "connection_limit",
    "quiet_accept_errors",
    "raise_open_file_limit",
]

log = logging.getLogger("aelastic.backends.http.server")

#: Seconds a client has to send a request's head (from the connect), and then its body.
DEFAULT_READ_TIMEOUT = 10.0
#: Seconds an idle kept-alive connection stays open between requests.
DEFAULT_KEEPALIVE_TIMEOUT = 30.0
#: Open connections held at most (lowered to fit the open-file limit).
DEFAULT_MAX_CONNECTIONS = 10_000
#: Seconds between two log lines about the same trouble (refusals, failed accepts).
LOG_EVERY = 10.0
#: Backlog of the listening socket; asyncio also accepts up to this many per loop pass.
BACKLOG = 128
#: File descriptors kept free beside the connections: sockets accepted and not yet handed
#: to a protocol, or refused and not yet closed (a backlog per loop pass, for about three
#: passes), the journal, the loop's own.
_FD_RESERVE = 3 * BACKLOG + 64

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_BUSY_BODY = b'{"error": "the server holds its limit of open connections; retry later"}'
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RateLimitedLog:
    """One warning line at most every ``every`` seconds, counting what happened between.

    Args:
        message: ``%``-format of the line; its first argument is the count.
        every: Seconds between two lines.
    """

    def __init__(self, message: str, every: float = LOG_EVERY) -> None:
        self._message = message
        self._every = every
        self._count = 0
        self._last = -math.inf
        self._pending: asyncio.TimerHandle | None = None
        self._args: tuple[object, ...] = ()

    def note(self, *args: object) -> None:
        """Count one occurrence (``args`` complete the message); log now or later."""
        self._count += 1
        self._args = args
        if self._pending is not None:
            return
        loop = asyncio.get_running_loop()
        due = self._last + self._every
        if loop.time() >= due:
            self._flush()
        else:
            self._pending = loop.call_at(due, self._flush)

    def _flush(self) -> None:
        self._pending = None
        if self._count:
            log.warning(self._message, self._count, *self._args)
            self._count = 0
            self._last = asyncio.get_running_loop().time()

    def flush(self) -> None:
        """Log what was counted and not logged yet, now."""
        if self._pending is not None:
            self._pending.cancel()
        self._flush()


class _Guarded(asyncio.Protocol):
    """One accepted connection: aiohttp's handler, plus the deadline it must meet."""

    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self._guard = guard
        self.inner = inner
        self._loop = guard.loop
        self._transport: asyncio.BaseTransport | None = None
        self._busy = 0  # requests being handled
        self._head = False  # a byte of the next request arrived since the last answer
        self._deadline = math.inf
        self._timer: asyncio.TimerHandle | None = None
        # Counted from now: the socket is open. The first request's head is due within
        # read_timeout (and if asyncio never makes the connection, that uncounts it).
        guard.opened(self)
        self._head = True
        self._arm(self._loop.time() + guard.read_timeout)

    # -- asyncio's events, handed on ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy and not self._head:
            self._head = True
            self._arm(min(self._deadline, self._loop.time() + self._guard.read_timeout))
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self.inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._guard.closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- the deadline ---------------------------------------------------------------------

    def request_started(self) -> None:
        self._busy += 1
        self._head = False
        self._deadline = math.inf

    def request_ended(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._arm(self._loop.time() + self._guard.keepalive_timeout)

    def _arm(self, deadline: float) -> None:
        self._deadline = deadline
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self._transport is None:  # asyncio failed to make the connection
            self._guard.closed(self)
            return
        if self._busy or self._deadline == math.inf:
            return
        if self._loop.time() < self._deadline:  # pushed back since: wait again
            self._timer = self._loop.call_at(self._deadline, self._expire)
            return
        self._guard.dropped(slow=self._head)
        self._transport.close()


class _Refused(asyncio.Protocol):
    """A connection past the limit: answered 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not registered as asyncio.WriteTransport).
        writer = cast(asyncio.WriteTransport, transport)
        writer.write(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
        writer.close()


class ConnectionGuard:
    """Limits and deadlines of a server's connections (see the module docstring).

    Args:
        max_connections: Open connections held at most.
        read_timeout: Seconds a client has to send a request's head.
        keepalive_timeout: Seconds an idle connection stays open between requests.

    Raises:
        ValueError: A limit or timeout is not positive.
    """

    def __init__(
        self,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections ({max_connections}) must be at least 1")
        for name, value in (("read_timeout", read_timeout), ("keepalive", keepalive_timeout)):
            if not 0 < value < math.inf:
                raise ValueError(f"{name} ({value}) must be a positive number of seconds")
        self.loop = asyncio.get_running_loop()
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.keepalive_timeout = keepalive_timeout
        self._open: dict[Any, _Guarded] = {}  # aiohttp's handler -> its connection
        self.refused = 0
        self.timed_out = 0
        self._refusals = RateLimitedLog(
            "refused %d new connection(s): %d are open, the limit (--max-connections; a "
            "connection or rendezvous channel idle for --keepalive-timeout is closed, one "
            "that sends no complete request within --read-timeout too)"
        )
        self._drops = RateLimitedLog(
            "closed %d connection(s) that sent no complete request within %g s (--read-timeout)"
        )

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self._open)

    def factory(self, server: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server``, around aiohttp's ``server``
        (``runner.server``, itself a protocol factory)."""

        def accept() -> asyncio.Protocol:
            if len(self._open) >= self.max_connections:
                self.refused += 1
                self._refusals.note(len(self._open))
                return _Refused()
            return _Guarded(self, server())

        return accept

    def opened(self, conn: _Guarded) -> None:
        self._open[conn.inner] = conn

    def closed(self, conn: _Guarded) -> None:
        self._open.pop(conn.inner, None)

    def dropped(self, slow: bool) -> None:
        self.timed_out += 1
        if slow:
            self._drops.note(self.read_timeout)

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Lift the connection's deadline while its request is handled."""
        conn = self._open.get(request.protocol)
        if conn is None:
            return await handler(request)
        conn.request_started()
        try:
            return await handler(request)
        finally:
            conn.request_ended()

    def close(self) -> None:
        """Log the counts not logged yet."""
        self._refusals.flush()
        self._drops.flush()


def raise_open_file_limit() -> int | None:
    """Lift this process's soft ``RLIMIT_NOFILE`` to its hard limit; the soft limit now.

    Returns:
        The soft limit after the change (``None`` where the platform has no such limit).
    """
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def connection_limit(wanted: int) -> int:
    """``wanted``, lowered so that the connections fit the soft open-file limit.

    Logs a warning when it lowers it.
    """
    try:
        import resource
    except ImportError:
        return wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted <= soft - _FD_RESERVE:
        return wanted
    fitting = max(soft - _FD_RESERVE, 1)
    log.warning(
        "the open-file limit (%d) leaves room for %d connections, not %d: raise it "
        "(ulimit -n) to hold more",
        soft,
        fitting,
        wanted,
    )
    return fitting


_ACCEPT_FAILED = "socket.accept() out of system resource"


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Log a failed ``accept()`` (out of file descriptors) as a rate-limited line.

    Other errors go to the loop's handler as before.

    Returns:
        A function putting the loop's previous exception handler back.
    """
    previous = loop.get_exception_handler()
    failed = RateLimitedLog(
        "could not accept %d connection(s): %s (the process is out of file descriptors; "
        "lower --max-connections or raise ulimit -n)"
    )

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == _ACCEPT_FAILED:
            failed.note(context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)

    def restore() -> None:
        failed.flush()
        loop.set_exception_handler(previous)

    return restore
