"""One gRPC call on an HTTP/2 connection (:mod:`._h2`): its answer's messages, its end.

How it works: the connection hands a call the DATA of its stream (:meth:`Call.body`),
which holds gRPC's length-prefixed messages, cut anywhere; a whole message goes to the
call's callback (a watch, the keep-alive stream) or into :attr:`Call.messages`. The
connection resolves :attr:`Call.done` with the call's gRPC status, or fails it.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Protocol

from ._answers import NotEtcd

__all__ = ["MAX_MESSAGE", "Call", "Carrier", "grpc_message"]

#: The largest answer taken (a listing of every run's header is the largest etcd sends).
MAX_MESSAGE = 256 << 20


class Carrier(Protocol):
    """What a call needs of its connection."""

    loop: asyncio.AbstractEventLoop
    peer_window: int

    def send_data(self, call: Call, data: bytes, end: bool) -> None: ...

    def reset(self, call: Call) -> None: ...

    def forget(self, call: Call) -> None: ...

    def rst(self, stream: int) -> None: ...


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

    def body(self, data: bytes) -> None:
        buffer = self._body
        buffer += data
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if size > MAX_MESSAGE:
                self.fail(NotEtcd(f"a gRPC message of {size} bytes (at most {MAX_MESSAGE})"))
                self.connection.rst(self.stream)
                return
            if len(buffer) < 5 + size:
                break
            if buffer[0]:
                self.fail(NotEtcd("a compressed gRPC message, never asked for"))
                return
            message = bytes(buffer[5 : 5 + size])
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
