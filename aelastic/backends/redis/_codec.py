"""The Redis protocol's encoding (RESP2): commands packed, replies parsed.

How it works: :func:`pack` writes one command as an array of bulk strings (recurring
arguments, such as key names and script ids, are kept encoded); :func:`parse` reads one
reply from a buffer, raising :class:`Incomplete` when the buffer ends inside it. An error
reply becomes the exception object redis-py's own parser gives (``NoScriptError``,
``ReadOnlyError``...), through redis-py's ``parse_error``; bytes that are not the protocol
raise redis-py's ``InvalidResponse``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis._parsers.base import BaseParser
from redis.exceptions import InvalidResponse

__all__ = ["PING", "Incomplete", "pack", "parse"]

_CRLF = b"\r\n"
PING = b"*1\r\n$4\r\nPING\r\n"


def pack(args: Sequence[Any]) -> bytes:
    """One command in the protocol's form (``str`` as UTF-8, ``int`` and ``float`` as text)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)
        if kind is str or kind is int:
            part = _PARTS.get(arg)
            if part is None:
                part = _part(arg.encode() if kind is str else b"%d" % arg)
                if len(part) < 256:  # names, keys, script ids, small numbers recur
                    if len(_PARTS) >= _PARTS_SIZE:
                        _PARTS.clear()
                    _PARTS[arg] = part
            out.append(part)
        elif kind is bytes:
            out.append(_part(arg))
        elif isinstance(arg, str):
            out.append(_part(arg.encode()))
        elif isinstance(arg, bytes | bytearray | memoryview):
            out.append(_part(bytes(arg)))
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            out.append(_part(repr(arg).encode()))
        else:
            raise TypeError(f"cannot send {type(arg).__name__} to Redis")
    return b"".join(out)


def _part(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


#: Encoded arguments seen before (``str`` and ``int`` only; emptied when it holds
#: :data:`_PARTS_SIZE`).
_PARTS: dict[Any, bytes] = {}
_PARTS_SIZE = 4096


class Incomplete(Exception):
    """The buffer ends inside a reply."""


def parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """The reply starting at ``pos`` and where the next one starts.

    Raises:
        _Incomplete: More bytes are needed.
        InvalidResponse: The bytes are not the Redis protocol.
    """
    end = buf.find(_CRLF, pos)
    if end < 0:
        if len(buf) - pos > 65536:  # no reply header is that long
            raise InvalidResponse(f"Protocol Error: {bytes(buf[pos : pos + 60])!r}")
        raise Incomplete
    kind = buf[pos]
    nxt = end + 2
    if kind == 36:  # $ bulk string
        size = _int(buf, pos, end)
        if size < 0:
            return None, nxt
        if len(buf) < nxt + size + 2:
            raise Incomplete
        return bytes(buf[nxt : nxt + size]), nxt + size + 2
    if kind == 42:  # * array
        count = _int(buf, pos, end)
        if count < 0:
            return None, nxt
        items = []
        for _ in range(count):
            item, nxt = parse(buf, nxt)
            items.append(item)
        return items, nxt
    if kind == 58:  # : integer
        return _int(buf, pos, end), nxt
    if kind == 43:  # + simple string
        return bytes(buf[pos + 1 : end]), nxt
    if kind == 45:  # - error
        said = buf[pos + 1 : end].decode("utf-8", "replace")
        return BaseParser.parse_error(said), nxt  # type: ignore[no-untyped-call]
    raise InvalidResponse(f"Protocol Error: {bytes(buf[pos:end])!r}")


def _int(buf: bytearray, pos: int, end: int) -> int:
    try:
        return int(buf[pos + 1 : end])
    except ValueError:
        raise InvalidResponse(f"Protocol Error: {bytes(buf[pos:end])!r}") from None
