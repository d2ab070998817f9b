"""A lean HTTP/2 connection for gRPC calls to one etcd member (RFC 9113, client side).

How it works: a :class:`Connection` (an asyncio protocol) carries any number of calls at
once, each an HTTP/2 stream: :meth:`Connection.call` sends a call's headers and first
message in one write and returns its :class:`Call`, which collects the answer's gRPC
messages (or hands each to a callback, for a watch or the keep-alive stream) and ends
with the call's gRPC status. The connection sends its settings at once (no push, large
windows: etcd's answers never wait for a window update but every gigabyte), answers
pings and settings, honours the member's windows for what it sends (a message that does
not fit waits for the window update), and reads header blocks with :mod:`._hpack`.
A connection the member ends (GOAWAY) takes no new call, fails the calls etcd said
it will not carry out and closes once the others ended; one that closes fails every call
left. What a member may send is bounded (:mod:`._limits`: each frame's size from its head,
before it is buffered; a header block's size and frames; messages; frames that carry
nothing for a call); a frame that breaks HTTP/2 or goes beyond a bound closes the
connection, failing every call on it with :class:`~._answers.Misbehaved`, which says what
the member did. Acknowledgements are written only while the member reads: when the
transport pauses this side's writes, the connection stops reading until they resume.

What a server that is not an etcd member does fails the calls with
:class:`~._answers.NotEtcd` (its first bytes are not HTTP/2's settings, an HTTP status
other than 200, an answer that is not gRPC); a connection closed before any answer,
:class:`~._answers.Hangup`; one lost later, a stream reset, :class:`~._answers.Transient`.

Why hand-written (gRPC's Python package, grpcio, is the maintained client): measured on
the 2-core machine, etcd 3.4 spends a third of the CPU on a request over gRPC that it
spends on the same request through its JSON gateway (0.15-0.2 ms against 0.45-0.75 ms;
a watch opened, 0.26 ms against 0.76 ms), and HTTP/2 carries a node's requests, watch and
keep-alive stream on one connection instead of three. grpcio would bring a C core with
threads of its own, and fork handlers, into a launcher that forks its workers, plus
protobuf for a dozen messages (:mod:`._proto` writes them by hand).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import cast

from ._answers import Hangup, Misbehaved, NotEtcd, Transient, tls_failure
from ._call import Call, grpc_message
from ._frames import (
    ACK,
    BIG,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_SENT,
    WINDOW_UPDATE,
    check,
    frame,
    head,
    name,
    unpadded,
)
from ._hpack import Decoder, HpackError, encode
from ._limits import MAX_FRAME, MAX_HEADER_LIST, MAX_OWED, Budget, HeaderBlock
from ._windows import Windows

__all__ = ["Call", "Connection", "Metadata", "grpc_message"]

#: A call's gRPC metadata: (name, value) pairs sent as headers.
Metadata = tuple[tuple[bytes, bytes], ...]


_REFILL = 1 << 30  # received bytes after which a window is topped up again


class Connection(asyncio.Protocol):
    """One HTTP/2 connection to a member (see the module docstring).

    Args:
        authority: ``host:port`` for the ``:authority`` header.
        scheme: ``http`` or ``https``.
    """

    def __init__(self, authority: str, scheme: str) -> None:
        self.loop = asyncio.get_running_loop()
        self._authority = authority.encode()
        self._scheme = scheme.encode()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._calls: dict[int, Call] = {}
        self._next = 1
        self._decoder = Decoder()
        self._block: HeaderBlock | None = None  # a header block being received
        self._idle = Budget(self.loop.time)  # frames that carry nothing for a call
        self._paused = False  # the transport paused this side's writes
        self._owed = 0  # acknowledgements written since
        self._windows = Windows()  # the member's, for what this side sends
        self._received = 0
        self._heard = False  # the member's first settings arrived
        #: Resolved when the member's first settings arrive (it speaks at all).
        self.heard: asyncio.Future[None] = self.loop.create_future()
        self.closed = False
        self._error: BaseException | None = None
        self._blocks: dict[tuple[str, Metadata], bytes] = {}  # request header blocks

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's too
        transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, SETTINGS_SENT)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", BIG - 65535))
        )

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buffer = self._buffer
        buffer += data
        if not self._heard and len(buffer) >= 9:
            if buffer[3] != SETTINGS or buffer[4] & ACK or buffer[5:9] != b"\0\0\0\0":
                shown = bytes(buffer[:40]).decode(errors="replace").strip()
                self._end(NotEtcd(f"it does not speak HTTP/2 ({shown!r})"))
                return
            self._heard = True
            self.heard.set_result(None)
        at = 0  # frames are cut off the buffer once, after the loop (not one by one)
        try:
            while len(buffer) - at >= 9 and not self.closed:
                size, kind, flags, stream = head(buffer, at)  # judged before it is buffered
                end = at + 9 + size
                if len(buffer) < end:
                    break
                payload = bytes(buffer[at + 9 : end])
                at = end
                self._frame(kind, flags, stream, payload)
        except Misbehaved as exc:
            self._end(exc)
        except (HpackError, struct.error, IndexError, ValueError) as exc:
            self._end(Misbehaved(f"it broke HTTP/2 ({exc})"))
        if not self.closed:
            del buffer[:at]

    def eof_received(self) -> bool | None:
        return False

    def pause_writing(self) -> None:
        # The member does not read what this side writes: nothing more is read from it
        # (so no more frames that ask for an acknowledgement) until it does.
        self._paused = True
        self._owed = 0
        if not self.closed and self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if not self.closed and self._transport is not None:
            self._transport.resume_reading()

    @property
    def writing_paused(self) -> bool:
        """Whether the member leaves what this side writes unread (the transport's buffer
        is over its high-water mark)."""
        return self._paused

    def connection_lost(self, exc: Exception | None) -> None:
        failure = None if exc is None else tls_failure(exc)
        if failure is not None:
            self._end(failure)
        elif self._heard:
            self._end(Transient(f"the connection was lost ({exc or 'closed'})"))
        else:
            self._end(Hangup("it closed the connection without an answer"))

    # -- calls ----------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Whether a new call may start here."""
        return not self.closed and self._next < BIG - 2

    def call(
        self,
        method: str,
        message: bytes | None,
        metadata: Metadata = (),
        end: bool = True,
        on_message: Callable[[bytes], None] | None = None,
    ) -> Call:
        """Start a call of ``method`` with its first ``message`` (``end``: its only one;
        ``None``: none yet, a stream's headers only).

        Raises:
            Transient: The connection is closed or ending.
        """
        if not self.usable or self._transport is None:
            raise self._error or Transient("the connection is closed")
        stream = self._next
        self._next += 2
        call = Call(self, stream, on_message)
        self._calls[stream] = call
        block = self._blocks.get((method, metadata))
        if block is None:  # the same few methods, every call: encoded once a connection
            block = self._blocks[(method, metadata)] = encode(
                (
                    (b":method", b"POST"), (b":scheme", self._scheme),
                    (b":path", method.encode()), (b":authority", self._authority),
                    (b"content-type", b"application/grpc"), (b"te", b"trailers"), *metadata,
                )
            )  # fmt: skip
        self._transport.write(frame(HEADERS, END_HEADERS, stream, block))
        self._idle.earn(1)
        if message is not None:
            self.send_data(call, grpc_message(message), end)
        return call

    def send_data(self, call: Call, data: bytes, end: bool) -> None:
        if self._transport is None or self.closed or call.done.done():
            return
        call.backlog += data
        call.end_after_backlog = call.end_after_backlog or end
        out = self._windows.frames(call)
        if out:
            self._transport.write(out)
            self._idle.earn(1 + len(out) // MAX_FRAME)

    @property
    def peer_window(self) -> int:
        """The member's initial stream window (a new call's)."""
        return self._windows.initial

    def reset(self, call: Call) -> None:
        if self._calls.pop(call.stream, None) is not None:
            self.rst(call.stream)
        if not call.done.done():
            call.done.cancel()

    def rst(self, stream: int) -> None:
        """Tell the member this side left ``stream`` (RST_STREAM, CANCEL)."""
        if not self.closed and self._transport is not None:
            self._transport.write(frame(RST_STREAM, 0, stream, struct.pack(">I", 8)))

    def forget(self, call: Call) -> None:
        self._calls.pop(call.stream, None)
        if not self._calls and self._next >= BIG - 2 and not self.closed:
            self.close()  # ended by the member (or out of streams): nothing left on it

    def close(self) -> None:
        """Close the connection (every call left fails). Idempotent."""
        self._end(Transient("the connection was closed"))

    def _end(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.closed = True
        self._buffer.clear()
        if self._transport is not None:
            # abort, not close: a TLS close waits (up to 30 s) for the member's close_notify,
            # keeping the socket open meanwhile
            self._transport.abort()
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.fail(self._error)

    # -- frames ---------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        block = self._block
        if block is not None:
            if kind != CONTINUATION or stream != block.stream:
                raise Misbehaved("it sent another frame inside a header block")
            block.add(payload)
            if flags & END_HEADERS:
                self._headers()
            return
        check(kind, stream, payload)
        if kind in (DATA, HEADERS) and (not stream % 2 or stream >= self._next):
            raise Misbehaved(f"it sent a {name(kind)} frame on stream {stream}, never opened")
        if kind == DATA:
            self._data(flags, stream, payload)
        elif kind == HEADERS:
            fragment = unpadded(payload, flags)
            if flags & PRIORITY_FLAG:
                if len(fragment) < 5:
                    raise Misbehaved("it sent a HEADERS frame too short for its priority")
                fragment = fragment[5:]
            self._block = HeaderBlock(stream, flags, fragment)
            if flags & END_HEADERS:
                self._headers()
        elif kind == SETTINGS:
            self._idle.spend("SETTINGS")
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            self._idle.spend("PING")
            if not flags & ACK:
                self._acknowledge(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._window_update(stream, int.from_bytes(payload, "big") & BIG)
        elif kind == RST_STREAM:
            call = self._calls.get(stream)
            if call is None:
                self._idle.spend("RST_STREAM")
            else:
                code = int.from_bytes(payload, "big")
                call.fail(Transient(f"etcd reset the call's stream (HTTP/2 error {code})"))
        elif kind == GOAWAY:
            self._goaway(payload)
        elif kind in (PUSH_PROMISE, CONTINUATION):
            raise Misbehaved(f"it sent a {name(kind)} frame (a push, or out of a header block)")
        else:  # PRIORITY, or a type this side does not know: ignored (RFC 9113 4.1, 5.3.2)
            self._idle.spend(name(kind))

    def _acknowledge(self, frame: bytes) -> None:
        """Write an acknowledgement (PING, SETTINGS): never more than :data:`MAX_OWED`
        while the member reads nothing."""
        if self._paused:
            self._owed += 1
            if self._owed > MAX_OWED:
                raise Misbehaved(
                    f"it reads nothing of this side's writes while it asks for more "
                    f"acknowledgements (PING, SETTINGS): over {MAX_OWED} wait unsent"
                )
        assert self._transport is not None
        self._transport.write(frame)

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        size = len(payload)  # padding included: it counts against the windows too
        data = unpadded(payload, flags)
        if not data and not flags & END_STREAM:
            self._idle.spend("an empty DATA frame")
        self._received += size
        top_up = b""
        if self._received >= _REFILL:
            top_up = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received))
            self._received = 0
        call = self._calls.get(stream)
        if call is not None:  # (else in flight when this side left the call: dropped)
            call.received += size
            if call.received >= _REFILL:
                top_up += frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", call.received))
                call.received = 0
            if not call.headers_seen:
                call.fail(NotEtcd("an answer without HTTP headers"))
            else:
                call.body(data)
                if flags & END_STREAM:
                    call.fail(NotEtcd("an answer without gRPC's status"))
        if top_up and self._transport is not None:
            self._transport.write(top_up)

    def _headers(self) -> None:
        assert self._block is not None
        block, self._block = self._block, None
        stream, flags = block.stream, block.flags
        call = self._calls.get(stream)
        if call is None:  # (trailers in flight when this side left the call)
            self._idle.spend("a header block for no call", 1 + len(block.fragments) // 256)
        # Decoded even for a call that is gone: the decoder's table must follow the member's.
        headers = dict(self._decoder.decode(bytes(block.fragments), MAX_HEADER_LIST))
        if call is not None:
            call.headers(headers, bool(flags & END_STREAM))

    def _settings(self, payload: bytes) -> None:
        # (Only the initial window matters here: this side's header blocks index nothing,
        # whatever table size the member allows, and its frames are never over 16 KiB.)
        if len(payload) % 6:
            raise Misbehaved(f"it sent a SETTINGS frame of {len(payload)} bytes")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                self._windows.set_initial(value, self._calls.values())
        self._acknowledge(frame(SETTINGS, ACK, 0))
        self._unblock()

    def _window_update(self, stream: int, increment: int) -> None:
        call = self._calls.get(stream)
        if stream and call is None:
            return  # a call that ended
        self._windows.update(call, increment)
        self._unblock()

    def _unblock(self) -> None:
        out = self._windows.unblocked()
        if out and self._transport is not None:
            self._transport.write(out)
            self._idle.earn(1 + len(out) // MAX_FRAME)

    def _goaway(self, payload: bytes) -> None:
        if len(payload) < 8:
            raise Misbehaved(f"it sent a GOAWAY frame of {len(payload)} bytes")
        last = int.from_bytes(payload[:4], "big") & BIG
        code = int.from_bytes(payload[4:8], "big")
        said = payload[8:].decode(errors="replace")
        error = Transient(
            f"etcd ended the connection (HTTP/2 error {code}{': ' * bool(said)}{said})"
        )
        self._error = self._error or error
        self._next = BIG  # no new call
        for stream, call in list(self._calls.items()):
            if stream > last:
                call.fail(error)
        if not self._calls:
            self.close()
