"""The Redis protocol's encoding (RESP2 and RESP3): commands packed, replies parsed.

How it works: :func:`pack` writes one command as an array of bulk strings (recurring
arguments, such as key names and script ids, are kept encoded); :func:`parse` reads one
reply from a buffer, raising :class:`Incomplete` when the buffer ends inside it. RESP3's
types read as Python values (null ``None``, maps ``dict``, sets ``list``, doubles ``float``,
booleans ``bool``), attributes are skipped, and a push (a pub/sub message on a RESP3
connection) is a :class:`Push`, so a connection can tell it from a reply. An error reply
becomes the exception object redis-py's own parser gives (``NoScriptError``,
``ReadOnlyError``...), through redis-py's ``parse_error``; bytes that are not the protocol
raise redis-py's ``InvalidResponse``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis._parsers.base import BaseParser
from redis.exceptions import InvalidResponse

__all__ = ["PING", "Incomplete", "Push", "pack", "parse"]

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


class Push(list):  # type: ignore[type-arg]
    """A RESP3 push: out-of-band data (a pub/sub message), not the reply to a command."""


def parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """The reply starting at ``pos`` and where the next one starts.

    Raises:
        Incomplete: More bytes are needed.
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
    if kind == 42 or kind == 62 or kind == 126:  # * array, > push, ~ set
        count = _int(buf, pos, end)
        if count < 0:
            return None, nxt
        items = Push() if kind == 62 else []
        for _ in range(count):
            item, nxt = parse(buf, nxt)
            items.append(item)
        return items, nxt
    if kind == 58:  # : integer
        return _int(buf, pos, end), nxt
    if kind == 43:  # + simple string
        return bytes(buf[pos + 1 : end]), nxt
    if kind == 45:  # - error
        return _error(buf[pos + 1 : end]), nxt
    return _resp3(buf, pos, end, kind)


def _resp3(buf: bytearray, pos: int, end: int, kind: int) -> tuple[Any, int]:
    """The rarer types, RESP3's."""
    nxt = end + 2
    if kind == 95:  # _ null
        return None, nxt
    if kind == 35:  # # boolean
        return buf[pos + 1 : end] == b"t", nxt
    if kind == 44:  # , double
        try:
            return float(buf[pos + 1 : end]), nxt
        except ValueError:
            raise InvalidResponse(f"Protocol Error: {bytes(buf[pos:end])!r}") from None
    if kind == 40:  # ( big number
        return _int(buf, pos, end), nxt
    if kind in (61, 33):  # = verbatim string ("txt:..."), ! blob error
        size = _int(buf, pos, end)
        if len(buf) < nxt + size + 2:
            raise Incomplete
        data = buf[nxt : nxt + size]
        if kind == 33:
            return _error(data), nxt + size + 2
        return bytes(data[4:]), nxt + size + 2
    if kind == 37 or kind == 124:  # % map, | attribute (skipped: the reply follows)
        count = _int(buf, pos, end)
        out = {}
        for _ in range(count):
            key, nxt = parse(buf, nxt)
            value, nxt = parse(buf, nxt)
            out[key if not isinstance(key, list) else tuple(key)] = value
        if kind == 124:
            return parse(buf, nxt)
        return out, nxt
    raise InvalidResponse(f"Protocol Error: {bytes(buf[pos:end])!r}")


def _error(said: bytearray) -> Any:
    text = said.decode("utf-8", "replace")
    return BaseParser.parse_error(text)  # type: ignore[no-untyped-call]


def _int(buf: bytearray, pos: int, end: int) -> int:
    try:
        return int(buf[pos + 1 : end])
    except ValueError:
        raise InvalidResponse(f"Protocol Error: {bytes(buf[pos:end])!r}") from None
