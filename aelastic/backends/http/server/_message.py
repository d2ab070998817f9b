"""The schema of a rendezvous channel's message (see :mod:`._channel`): parsed and checked
before anything is applied."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from aiohttp import WSCloseCode

from ....core.state import Op, Request
from ....core.wire import WireError, request_from_json
from ..wire import SchemaError, require_object, require_run_id, require_seconds, require_token

__all__ = ["Closed", "Message", "parse", "read_message"]

_MAX_ID = 2**53
_FIELDS = frozenset({"id", "run", "request", "hold", "seen", "beat", "broken"})
_MAX_BEAT_KEY = 256


class Closed(Exception):
    """A message broke the channel's rules: close it with this code and reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def parse(data: str) -> tuple[int, dict[str, Any]]:
    """A message's id and JSON object.

    Raises:
        Closed: It is not a JSON object with a valid ``id`` (the channel closes).
    """
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise Closed(WSCloseCode.INVALID_TEXT, "a message that is not JSON") from None
    if not isinstance(doc, dict):
        raise Closed(WSCloseCode.INVALID_TEXT, "a message that is not a JSON object")
    msg_id = doc.get("id")
    if type(msg_id) is not int or not 0 <= msg_id < _MAX_ID:
        raise Closed(WSCloseCode.INVALID_TEXT, "a message without a valid 'id'")
    return msg_id, doc


class Message(NamedTuple):
    """A rendezvous request's message, checked."""

    run_id: str
    request: Request
    hold: float
    seen: str | None
    key: str  # a keep-alive's beat key ('' : none)
    broken: bool  # a keep-alive saying the node's workers' collective broke


def read_message(doc: dict[str, Any]) -> Message:
    """The checked fields of a request's message.

    Raises:
        SchemaError: A field is unknown or does not fit (answered 400).
    """
    unknown = set(doc) - _FIELDS
    if unknown:
        raise SchemaError(f"unknown field(s): {', '.join(sorted(map(repr, unknown)))}")
    run_id = require_run_id(doc.get("run"))
    hold = require_seconds(doc.get("hold", 0), "'hold'")
    seen = None if doc.get("seen") is None else require_token(doc["seen"], "'seen'")
    key = doc.get("beat", "")
    if not isinstance(key, str) or len(key) > _MAX_BEAT_KEY:
        raise SchemaError(f"'beat' must be a string of at most {_MAX_BEAT_KEY} characters")
    try:
        request = request_from_json(require_object(doc.get("request")))
    except WireError as exc:
        raise SchemaError(str(exc)) from None
    broken = doc.get("broken", False)
    if broken is not False and (broken is not True or request.op is not Op.KEEP_ALIVE):
        raise SchemaError("'broken' is true, with a keep-alive, or absent")
    return Message(run_id, request, hold, seen, key, broken)
