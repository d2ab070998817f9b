"""What the HTTP rendezvous server and client say to each other: routes, limits, schemas.

How it works: every request and response body is a JSON object; bytes (store values) travel
base64-encoded; rendezvous requests, replies, statuses and snapshots have the JSON forms of
:mod:`aelastic.core.wire`. The server validates each body and query against the small
schemas here (``require_*``) and answers ``400`` with ``{"error": ...}`` when one does not
fit, before touching any stored data. Version tokens are :mod:`aelastic.core.token`'s.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

from ...core.token import is_valid

__all__ = [
    "API_PREFIX",
    "API_VERSION",
    "CHANNEL_PATH",
    "DEFAULT_PORT",
    "MAX_BODY",
    "MAX_KEYS",
    "MAX_KEY_LENGTH",
    "MAX_LISTED_RUNS",
    "MAX_RUN_ID_LENGTH",
    "MAX_WAIT",
    "TOKEN_ENV",
    "SchemaError",
    "b64decode",
    "b64encode",
    "require_bytes",
    "require_int",
    "require_key",
    "require_keys",
    "require_object",
    "require_optional_bytes",
    "require_run_id",
    "require_seconds",
    "require_token",
]

#: The server's default port (torchrun's default rendezvous port).
DEFAULT_PORT = 29400
#: Every route lives under this prefix (the API version).
API_PREFIX = "/v1"
#: Environment variable holding the bearer token, on the server and on the client.
TOKEN_ENV = "AELASTIC_HTTP_TOKEN"
#: Default largest request body the server accepts (bytes).
MAX_BODY = 4 * 1024 * 1024
#: Longest run id and key (characters), most keys in one request.
MAX_RUN_ID_LENGTH = 256
MAX_KEY_LENGTH = 1024
MAX_KEYS = 4096
#: Most runs one ``GET /v1/runs`` names.
MAX_LISTED_RUNS = 10_000
#: Longest a single long-poll may be held by the server (seconds).
MAX_WAIT = 300.0
_MAX_TOKEN_LENGTH = 96
_MAX_AMOUNT = 2**63 - 1
#: Version of the API (routes under ``/v1``; version 2 of the rendezvous state).
API_VERSION = 2
#: The rendezvous channel: a WebSocket carrying a client's rendezvous requests as messages.
CHANNEL_PATH = API_PREFIX + "/channel"


class SchemaError(ValueError):
    """A request or response does not fit the wire schema."""


def b64encode(data: bytes) -> str:
    """Bytes as standard base64 text."""
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str, what: str) -> bytes:
    """Decode strict base64 text.

    Raises:
        SchemaError: ``text`` is not valid base64.
    """
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise SchemaError(f"'{what}' must be base64 text") from None


def require_object(doc: Any) -> Mapping[str, Any]:
    """``doc`` itself if it is a JSON object.

    Raises:
        SchemaError: It is not.
    """
    if not isinstance(doc, dict):
        raise SchemaError("the body must be a JSON object")
    return doc


def _field(doc: Mapping[str, Any], name: str) -> Any:
    if name not in doc:
        raise SchemaError(f"missing field '{name}'")
    return doc[name]


def require_bytes(doc: Mapping[str, Any], name: str) -> bytes:
    """Field ``name`` of ``doc``, base64 text decoded.

    Raises:
        SchemaError: Missing or not base64 text.
    """
    value = _field(doc, name)
    if not isinstance(value, str):
        raise SchemaError(f"'{name}' must be base64 text")
    return b64decode(value, name)


def require_optional_bytes(doc: Mapping[str, Any], name: str) -> bytes | None:
    """Like :func:`require_bytes`, but ``null`` gives ``None``."""
    if _field(doc, name) is None:
        return None
    return require_bytes(doc, name)


def require_int(doc: Mapping[str, Any], name: str) -> int:
    """Field ``name`` of ``doc`` as a 64-bit signed integer (not a bool, not a float).

    Raises:
        SchemaError: Missing, not an integer, or out of range.
    """
    value = _field(doc, name)
    if type(value) is not int or not -_MAX_AMOUNT - 1 <= value <= _MAX_AMOUNT:
        raise SchemaError(f"'{name}' must be a 64-bit integer")
    return value


def _check_text(value: Any, what: str, limit: int, *, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (not value and not empty):
        raise SchemaError(
            f"{what} must be a {'' if empty else 'non-empty '}string of at most {limit} characters"
        )
    if "\x00" in value:
        raise SchemaError(f"{what} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(f"{what} must be valid Unicode text") from None
    return value


def require_run_id(value: Any) -> str:
    """A run id: 1..256 characters of valid Unicode, no NUL.

    Raises:
        SchemaError: It is not.
    """
    return _check_text(value, "the run id", MAX_RUN_ID_LENGTH)


def require_key(doc: Mapping[str, Any], name: str = "key") -> str:
    """Field ``name`` of ``doc`` as a store key (up to 1024 characters, may be empty).

    Raises:
        SchemaError: Missing or not a valid key.
    """
    return _check_text(_field(doc, name), f"'{name}'", MAX_KEY_LENGTH, empty=True)


def require_keys(doc: Mapping[str, Any], name: str = "keys") -> list[str]:
    """Field ``name`` of ``doc`` as a list of 1..4096 store keys.

    Raises:
        SchemaError: Missing, empty, too long, or an item is not a valid key.
    """
    value = _field(doc, name)
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_KEYS:
        raise SchemaError(f"'{name}' must be a list of 1 to {MAX_KEYS} keys")
    return [_check_text(k, f"each of '{name}'", MAX_KEY_LENGTH, empty=True) for k in value]


def require_token(value: Any, what: str = "'token'") -> str:
    """A state token: ``""`` (no state) or ``"<hex epoch>.<version>"``.

    Raises:
        SchemaError: It is neither.
    """
    if not isinstance(value, str) or len(value) > _MAX_TOKEN_LENGTH:
        raise SchemaError(f"{what} must be a state token string")
    if not is_valid(value):
        raise SchemaError(f"{what} is not a token this server issued")
    return value


def require_seconds(value: Any, what: str, limit: float = MAX_WAIT) -> float:
    """A finite number of seconds in ``[0, limit]`` (JSON number or decimal text).

    Raises:
        SchemaError: It is not.
    """
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SchemaError(f"{what} must be a number of seconds") from None
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= limit:
        raise SchemaError(f"{what} must be a number of seconds between 0 and {limit:g}")
    return float(value)
