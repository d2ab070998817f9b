"""A channel message that repeats the last one but for its id: read without parsing it.

How it works: a node sends the same keep-alive every beat until its status moves, each
with a new id first (``{"id":N,...}``, compact, as aelastic's client writes it). Once such
a message was parsed and checked, :func:`tail` gives its text after the id (when that text
holds no other id); a later message is a repeat when its text after the id is that tail
and its id is a plain JSON integer in range (:func:`repeat_id`): the channel then takes it
with the fields checked the first time.

Why: ``json.loads``, the schema checks and making the request again were a quarter of the
server's CPU per held heartbeat (measured, ``benchmarks/beat_cost_http.py``; figures in
docs/benchmarks.md). The id is read as strictly as JSON would read it.
"""

from __future__ import annotations

import json

__all__ = ["repeat_id", "tail"]

_PREFIX = '{"id":'
_AT = len(_PREFIX)
_MAX_ID = 2**53


def _plain_id(digits: str) -> int | None:
    """The id written as ``digits`` (a JSON integer in range), else ``None``."""
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 16):
        return None
    if digits[0] == "0" and len(digits) > 1:
        return None  # not JSON
    value = int(digits)
    return value if value < _MAX_ID else None


def tail(data: str, msg_id: int) -> str | None:
    """The text of message ``data`` (id ``msg_id``) after its id, when its repeats may be
    known by it: the id comes first, alone, and nothing after it names another."""
    if not data.startswith(_PREFIX):
        return None
    comma = data.find(",", _AT)
    if comma <= _AT or _plain_id(data[_AT:comma]) != msg_id:
        return None
    rest = data[comma:]
    try:
        doc = json.loads("{" + rest[1:])
    except (ValueError, RecursionError):
        return None
    return rest if isinstance(doc, dict) and "id" not in doc else None


def repeat_id(data: str, known: str) -> int | None:
    """The id of message ``data`` if it is ``known`` (a :func:`tail`) after its id."""
    if not data.startswith(_PREFIX):
        return None
    comma = data.find(",", _AT)
    if comma <= _AT or data[comma:] != known:
        return None
    return _plain_id(data[_AT:comma])
