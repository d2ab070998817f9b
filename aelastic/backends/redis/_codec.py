"""The Redis protocol's encoding (RESP2 and RESP3): commands packed, replies parsed.

How it works: :func:`pack` writes one command as an array of bulk strings (recurring
arguments, such as key names and script ids, are kept encoded); :func:`parse` reads one
reply from a buffer, raising :class:`Incomplete` when the buffer ends inside it. RESP3's
types read as Python values (null ``None``, maps ``dict``, sets ``list``, doubles ``float``,
booleans ``bool``), attributes are skipped, and a push (a pub/sub message on a RESP3
connection) is a :class:`Push`, so a connection can tell it from a reply. An error reply
becomes the exception object redis-py's own parser gives (``NoScriptError``,
``ReadOnlyError``...: :data:`ERRORS`, redis-py's table of error codes written with its
public exception classes, held to its parser by ``tests/backends/test_redis_internals.py``);
bytes that are not the protocol raise redis-py's ``InvalidResponse``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import exceptions as _exc
from redis.exceptions import InvalidResponse, ResponseError

__all__ = ["ERRORS", "PING", "Incomplete", "Push", "error", "pack", "parse"]

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
    return error(said.decode("utf-8", "replace"))


def _newer(name: str, older: type[Exception]) -> type[Exception]:
    """redis-py's class ``name``, or the one its older releases raise instead."""
    found = getattr(_exc, name, older)
    return found if isinstance(found, type) and issubclass(found, Exception) else older


_AUTH = _exc.AuthenticationError
_MODULE = _exc.ModuleError
_AUTH_ARGS = _exc.AuthenticationWrongNumberOfArgsError

#: An error reply's code (its first word) to redis-py's exception class; for ``ERR``, the
#: message to the class (any other ``ERR`` is a ``ResponseError``).
ERRORS: dict[str, type[Exception] | dict[str, type[Exception]]] = {
    "ERR": {
        "max number of clients reached": _newer("MaxClientsReachedError", _exc.ConnectionError),
        "Client sent AUTH, but no password is set": _AUTH,
        "invalid password": _AUTH,
        "AUTH <password> called without any password configured for the default user. "
        "Are you sure your configuration is correct?": _AUTH,
        "wrong number of arguments for 'auth' command": _AUTH_ARGS,
        "wrong number of arguments for 'AUTH' command": _AUTH_ARGS,
        "Error loading the extension. Please check the server logs.": _MODULE,
        "Error unloading module: no such module with that name": _MODULE,
        "Error unloading module: operation not possible.": _MODULE,
        "Error unloading module: the module exports one or more module-side data types, "
        "can't unload": _MODULE,
        "problem with LDAP service": _newer("ExternalAuthProviderError", ResponseError),
        "no such fieldset": _newer("NoSuchFieldsetError", ResponseError),
    },
    "OOM": _exc.OutOfMemoryError,
    "WRONGPASS": _AUTH,
    "EXECABORT": _exc.ExecAbortError,
    "LOADING": _exc.BusyLoadingError,
    "NOSCRIPT": _exc.NoScriptError,
    "READONLY": _exc.ReadOnlyError,
    "NOAUTH": _AUTH,
    "NOPERM": _exc.NoPermissionError,
    "ASK": _exc.AskError,
    "TRYAGAIN": _exc.TryAgainError,
    "MOVED": _exc.MovedError,
    "CLUSTERDOWN": _exc.ClusterDownError,
    "CROSSSLOT": _exc.ClusterCrossSlotError,
    "MASTERDOWN": _exc.MasterDownError,
}


def error(text: str) -> Exception:
    """The exception redis-py's parser makes of an error reply's text (without the ``-``)."""
    code = text.split(" ")[0]
    kind = ERRORS.get(code)
    if kind is None:
        return ResponseError(text)
    message = text[len(code) + 1 :]
    if isinstance(kind, dict):
        kind = kind.get(message, ResponseError)
    try:
        return kind(message)
    except (ValueError, IndexError):  # a MOVED or ASK whose slot and address do not parse
        return ResponseError(text)


def _int(buf: bytearray, pos: int, end: int) -> int:
    try:
        return int(buf[pos + 1 : end])
    except ValueError:
        raise InvalidResponse(f"Protocol Error: {bytes(buf[pos:end])!r}") from None
