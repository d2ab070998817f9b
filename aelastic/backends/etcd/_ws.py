"""A minimal WebSocket client (RFC 6455) for etcd's gateway: a streamed call both ways.

How it works: etcd serves each of its streamed calls (``/v3/lease/keepalive``,
``/v3/watch``) also as a WebSocket on its client port: every text message the client sends
is one JSON request of the stream, every message etcd sends back one JSON answer line
(``{"result": ...}``, or ``{"error": ...}`` before etcd ends the stream). A plain HTTP
request cannot carry such a stream: etcd's HTTP/1.1 server reads a request's whole body
before it answers (measured: a chunked ``/v3/lease/keepalive`` body got no answer until it
ended). :class:`Socket` is an :class:`asyncio.Protocol` on a connection of
:meth:`._http.Pool.connect`: it sends the upgrade request, checks etcd's ``101`` answer
(and its ``Sec-WebSocket-Accept``), then hands each whole message to ``on_message`` and the
end of the connection to ``on_close`` (``None``: a clean close). Frames it sends are
masked, as a client's must be; it answers pings, and reassembles fragmented messages.

Why not a library: the etcd backend needs no package beyond the standard library (the
nodes' HTTP is :mod:`._http`'s), and this is all of WebSocket it uses (about a hundred
lines). Measured on the 2-core machine (1,024 leases, one etcd 3.4.23): a keep-alive
message on a stream cost etcd 0.15-0.2 ms of CPU against 0.37-0.46 ms for a keep-alive
request (docs/benchmarks.md, the etcd section).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
from collections.abc import Callable
from typing import cast

from ...core.race import wait_within
from ._answers import Hangup, NotEtcd, Transient

__all__ = ["Socket"]

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_TEXT, _CLOSE, _PING, _PONG = 0x1, 0x8, 0x9, 0xA
#: Longest message accepted from etcd (a keep-alive answer is about 200 bytes).
_MAX_MESSAGE = 16 * 1024 * 1024


def _masked(opcode: int, payload: bytes) -> bytes:
    """One final client frame of ``opcode`` carrying ``payload`` (masked)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    mask = os.urandom(4)
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    body = (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big") if n else b""
    return head + mask + body


class Socket(asyncio.Protocol):
    """A WebSocket to one member (see the module docstring).

    Args:
        on_message: Called with each whole message etcd sends.
        on_close: Called once when the connection ends, with the error (``None``: closed
            cleanly, by either side).
    """

    def __init__(
        self,
        on_message: Callable[[bytes], None],
        on_close: Callable[[BaseException | None], None],
    ) -> None:
        self._on_message = on_message
        self._on_close = on_close
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._key = base64.b64encode(os.urandom(16))
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._parts: list[bytes] = []  # a fragmented message's pieces so far
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not isinstance-checked: uvloop's stream transports are not asyncio.Transports.
        self._transport = cast(asyncio.Transport, transport)

    async def open(self, host: str, path: str, token: str | None, within: float) -> None:
        """Send the upgrade request for ``path`` and wait for etcd's ``101``.

        Raises:
            Transient: No answer within ``within`` s, or the connection broke.
            NotEtcd: The answer is not a WebSocket upgrade.
        """
        assert self._transport is not None
        auth = f"Authorization: {token}\r\n" if token else ""
        self._transport.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {self._key.decode()}\r\n"
            f"Sec-WebSocket-Version: 13\r\n{auth}\r\n".encode("latin-1")
        )
        try:
            await wait_within(asyncio.shield(self._opened), within)
        except TimeoutError:
            self.close()
            raise Transient(f"no WebSocket answer within {within:g} s") from None

    def send(self, text: bytes) -> None:
        """Send one text message (nothing once closed)."""
        if self._transport is not None and not self.closed:
            self._transport.write(_masked(_TEXT, text))

    def close(self) -> None:
        """Close the connection at once (``on_close(None)`` follows)."""
        if self._transport is not None and not self.closed:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            if not self._opened.done() and not self._handshake():
                return
            self._frames()
        except NotEtcd as exc:
            self._end(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc if exc is not None or self._opened.done() else None)

    def _end(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
        if not self._opened.done():
            refused = exc if isinstance(exc, NotEtcd) else Hangup("it closed the connection")
            self._opened.set_exception(refused)
            self._opened.exception()  # retrieved: the opener may be gone
        self._on_close(exc if exc is None or isinstance(exc, NotEtcd) else Transient(str(exc)))

    def _handshake(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > 64 * 1024 or not b"HTTP/1.".startswith(bytes(self._buf[:7])):
                raise NotEtcd(f"an answer that is not HTTP ({bytes(self._buf[:40])!r})")
            return False
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[: end + 4]
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or status[1] != b"101":
            raise NotEtcd(f"no WebSocket upgrade ({lines[0][:60]!r})")
        accept = base64.b64encode(hashlib.sha1(self._key + _GUID).digest())
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(b":") for line in lines[1:])
        }
        if headers.get(b"sec-websocket-accept") != accept:
            raise NotEtcd("a WebSocket upgrade without the right Sec-WebSocket-Accept")
        self._opened.set_result(None)
        return True

    def _frames(self) -> None:
        buf = self._buf
        while len(buf) >= 2:
            first, second = buf[0], buf[1]
            n, at = second & 0x7F, 2
            if n == 126:
                if len(buf) < 4:
                    return
                (n,), at = struct.unpack_from("!H", buf, 2), 4
            elif n == 127:
                if len(buf) < 10:
                    return
                (n,), at = struct.unpack_from("!Q", buf, 2), 10
            if second & 0x80:
                raise NotEtcd("a masked frame from the server")
            if n > _MAX_MESSAGE:
                raise NotEtcd(f"a WebSocket frame of {n} bytes")
            if len(buf) < at + n:
                return
            payload = bytes(buf[at : at + n])
            del buf[: at + n]
            opcode = first & 0x0F
            if opcode == _PING:
                if self._transport is not None:
                    self._transport.write(_masked(_PONG, payload))
            elif opcode == _CLOSE:
                self._end(None)
                return
            elif opcode != _PONG:
                self._parts.append(payload)
                if first & 0x80:  # the message's last frame
                    message, self._parts = b"".join(self._parts), []
                    self._on_message(message)
