"""HTTP/2 frames (RFC 9113 4 and 6) as the client's connection (:mod:`._h2`) reads and
writes them: their types and flags, a frame's bytes, and the checks every frame passes
before the connection acts on it.

How it works: a frame is a 9-byte head (its payload's size in 24 bits, its type, its flags,
its stream) and its payload. :func:`frame` writes one; :func:`head` reads a head and
refuses a size over :data:`~._limits.MAX_FRAME` before the payload is buffered;
:func:`check` refuses a frame on the wrong stream (the connection's frames on stream 0,
a stream's frames elsewhere) or of a fixed-size type with another size; :func:`unpadded`
takes a DATA or HEADERS frame's padding off. What breaks the protocol raises
:class:`~._answers.Misbehaved`, which says what the member sent. Nothing here does I/O.
"""

from __future__ import annotations

import struct

from ._answers import Misbehaved
from ._limits import MAX_FRAME, MAX_HEADER_LIST

__all__ = [
    "ACK",
    "BIG",
    "CONTINUATION",
    "DATA",
    "END_HEADERS",
    "END_STREAM",
    "GOAWAY",
    "HEADERS",
    "PADDED",
    "PING",
    "PREFACE",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PUSH_PROMISE",
    "RST_STREAM",
    "SETTINGS",
    "SETTINGS_SENT",
    "WINDOW_UPDATE",
    "check",
    "frame",
    "head",
    "name",
    "unpadded",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
BIG = (1 << 31) - 1  # the largest window (and stream id)
#: This side's settings: no push, large stream windows, the largest frame and header list
#: it takes (:mod:`._limits`).
SETTINGS_SENT = struct.pack(">HIHIHIHI", 2, 0, 4, BIG, 5, MAX_FRAME, 6, MAX_HEADER_LIST)

_HEAD = struct.Struct(">BHBBI")  # length (24 bits as 1 + 2 bytes), type, flags, stream
_NAMES = ("DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING",
          "GOAWAY", "WINDOW_UPDATE", "CONTINUATION")  # fmt: skip
#: The payload size that frames of these types must have.
_SIZES = {PRIORITY: 5, RST_STREAM: 4, PING: 8, WINDOW_UPDATE: 4}
#: The frame types of the connection itself (stream 0); WINDOW_UPDATE goes on either.
_OF_CONNECTION = frozenset((SETTINGS, PING, GOAWAY))


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    size = len(payload)
    return _HEAD.pack(size >> 16, size & 0xFFFF, kind, flags, stream) + payload


def name(kind: int) -> str:
    """A frame type's name (``type 42`` for one this side does not know)."""
    return _NAMES[kind] if kind < len(_NAMES) else f"type {kind}"


def head(buffer: bytearray, at: int) -> tuple[int, int, int, int]:
    """The frame head at ``at``: its payload's size, type, flags and stream.

    Raises:
        Misbehaved: The payload is larger than this side takes (:data:`MAX_FRAME`).
    """
    high, low, kind, flags, stream = _HEAD.unpack_from(buffer, at)
    size = high << 16 | low
    if size > MAX_FRAME:
        raise Misbehaved(
            f"it sent a {name(kind)} frame of {size} bytes (at most {MAX_FRAME}, as this "
            "side advertised)"
        )
    return size, kind, flags, stream & BIG


def check(kind: int, stream: int, payload: bytes) -> None:
    """Refuse a frame of a known type on the wrong stream or of the wrong size.

    Raises:
        Misbehaved: It is.
    """
    if kind >= len(_NAMES):
        return  # unknown types are ignored (RFC 9113 4.1)
    if kind != WINDOW_UPDATE and (stream == 0) != (kind in _OF_CONNECTION):
        raise Misbehaved(f"it sent a {name(kind)} frame on stream {stream}")
    size = _SIZES.get(kind)
    if size is not None and len(payload) != size:
        raise Misbehaved(f"it sent a {name(kind)} frame of {len(payload)} bytes (not {size})")


def unpadded(payload: bytes, flags: int) -> bytes:
    """A DATA or HEADERS frame's payload without its padding.

    Raises:
        Misbehaved: The padding is longer than the frame.
    """
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise Misbehaved("it sent a frame whose padding is longer than the frame")
    return payload[1 : len(payload) - payload[0]]
