"""One gRPC call on an HTTP/2 connection (:mod:`._h2`): its answer's messages, its end.

How it works: the connection hands a call the header blocks of its stream
(:meth:`Call.headers`: the answer's HTTP status and content type, then the trailers' gRPC
status, which resolves :attr:`Call.done`) and its DATA (:meth:`Call.body`), which holds
gRPC's length-prefixed messages, cut anywhere; a whole message goes to the call's callback
(a watch, the keep-alive stream) or into :attr:`Call.messages` (a unary call: one message,
as gRPC answers). A message over :data:`~._limits.MAX_MESSAGE` is refused from its
prefix, before any of it is buffered, and a unary answer of a second message is refused
when it begins: :class:`~._answers.Misbehaved` is raised to the connection, which closes
(its member sends what no etcd does). The connection fails :attr:`Call.done` when it
breaks.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Protocol
from urllib.parse import unquote

from ._answers import Misbehaved, NotEtcd, Transient
from ._limits import MAX_MESSAGE

__all__ = ["Call", "Carrier", "grpc_message"]


class Carrier(Protocol):
    """What a call needs of its connection."""

    loop: asyncio.AbstractEventLoop

    @property
    def peer_window(self) -> int: ...

    def send_data(self, call: Call, data: bytes, end: bool) -> None: ...

    def reset(self, call: Call) -> None: ...

    def forget(self, call: Call) -> None: ...


def grpc_message(message: bytes) -> bytes:
    """A gRPC message: not compressed, its length, itself."""
    return b"\x00" + struct.pack(">I", len(message)) + message


class Call:
    """One gRPC call: its answer's messages as they arrive, then its end.

    ``on_message`` (when given) takes each message; otherwise they are kept in
    :attr:`messages`. :attr:`done` resolves with ``(grpc status, message)`` or fails with
    the connection's error.
    """

    def __init__(
        self, connection: Carrier, stream: int, on_message: Callable[[bytes], None] | None
    ) -> None:
        self.connection = connection
        self.stream = stream
        self.messages: list[bytes] = []
        self.on_message = on_message
        self.done: asyncio.Future[tuple[int, str]] = connection.loop.create_future()
        self.headers_seen = False
        self.window = connection.peer_window
        self.backlog = bytearray()  # data waiting for a window
        self.end_after_backlog = False
        self.received = 0
        self._body = bytearray()

    def send(self, message: bytes, end: bool = False) -> None:
        """Send one more message on the call's stream (``end``: the last)."""
        self.connection.send_data(self, grpc_message(message), end)

    def cancel(self) -> None:
        """Leave the call (a reset for the member; no effect on a call that ended)."""
        self.connection.reset(self)

    def headers(self, headers: dict[bytes, bytes], end: bool) -> None:
        """Take one of the answer's header blocks (``end``: it ended the stream).

        Raises:
            Misbehaved: A second block that does not end the call (gRPC's answer is
                headers, messages, then trailers that end the stream).
        """
        if self.headers_seen and not end:
            raise Misbehaved("it sent a second header block that does not end the call")
        if not self.headers_seen:
            status = headers.get(b":status", b"")
            if status != b"200":
                error = (Transient if status[:1] == b"5" else NotEtcd)(
                    f"HTTP status {status.decode(errors='replace') or 'missing'}"
                )
                self.fail(error)
                return
            kind = headers.get(b"content-type", b"")
            if not kind.startswith(b"application/grpc"):
                self.fail(NotEtcd(f"an answer of type {kind.decode(errors='replace')!r}"))
                return
            self.headers_seen = True
        if b"grpc-status" in headers or end:
            try:
                code = int(headers.get(b"grpc-status", b"2"))
            except ValueError:
                code = 2
            text = unquote(headers.get(b"grpc-message", b"").decode(errors="replace"))
            self.connection.forget(self)
            if not self.done.done():
                self.done.set_result((code, text))

    def body(self, data: bytes) -> None:
        """Take DATA of the answer.

        Raises:
            Misbehaved: A message over :data:`~._limits.MAX_MESSAGE`, or a second message
                in a unary answer.
        """
        buffer = self._body
        buffer += data
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if size > MAX_MESSAGE:
                raise Misbehaved(
                    f"it sent a gRPC message of {size} bytes (this side takes {MAX_MESSAGE} "
                    "at most)"
                )
            if self.on_message is None and self.messages:
                raise Misbehaved("it sent a second gRPC message in a unary call's answer")
            if len(buffer) < 5 + size:
                break
            if buffer[0]:
                self.fail(NotEtcd("a compressed gRPC message, never asked for"))
                return
            with memoryview(buffer) as view:
                message = bytes(view[5 : 5 + size])  # one copy (a slice would make two)
            del buffer[: 5 + size]
            if self.on_message is not None:
                self.on_message(message)
            else:
                self.messages.append(message)

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
            self.done.exception()  # retrieved: its waiter may be gone
        self.connection.forget(self)
