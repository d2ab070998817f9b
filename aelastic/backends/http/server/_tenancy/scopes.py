"""Who a token lets in: every run (the server's own token) or the runs of one id prefix.

How it works: a server with a token (``AELASTIC_HTTP_TOKEN``) knows three kinds of token.

* **The server's own token**: every run, and the server-wide routes (``/metrics``, the
  pages, the list of every run). It is the operator's.
* **A minted token**: ``aelastic.s1.<prefix>.<mac>``, both parts base64url, the MAC an
  HMAC-SHA256 of the prefix keyed with the server's token (:func:`mint`; ``aelastic serve
  --mint-token PREFIX``). The server checks one by computing the MAC again: there is no
  list to keep, and changing the server's token revokes them all.
* **A listed token**: a line ``TOKEN PREFIX`` of the file given to ``aelastic serve
  --scoped-tokens`` (:func:`load_scoped_tokens`), revoked by removing its line (and
  restarting the server).

:meth:`Scopes.resolve` names the :class:`Scope` of a bearer header, comparing secrets in
constant time (the server's token and a minted token's MAC with ``hmac.compare_digest``; a
listed token is looked up by its SHA-256 digest, then compared). A scoped request may use
the runs whose id starts with its prefix (every route under ``/v1/runs/{run}``, the
messages of its rendezvous channel), list them (``GET /v1/runs`` shows no other run) and
ask ``/v1/health``; anything else (another run, ``/metrics``) is refused ``403`` naming the
rule (:func:`check_route`, :func:`check_run`). The bearer middleware (:mod:`.._app`) keeps
each request's scope (:func:`scope_of`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ...wire import API_PREFIX, CHANNEL_PATH, TOKEN_ENV, SchemaError, require_run_id
from .limits import Refused

__all__ = [
    "EVERY_RUN",
    "MINTED",
    "SCOPE",
    "Scope",
    "Scopes",
    "check_route",
    "check_run",
    "load_scoped_tokens",
    "mint",
    "read_token_file",
    "scope_of",
    "warn_if_open",
]

log = logging.getLogger("aelastic.backends.http.server")

#: How a minted token begins (the version of its form).
MINTED = "aelastic.s1."
#: What a minted token's MAC covers besides the prefix (no other HMAC of the key matches).
_DOMAIN = b"aelastic scoped token, version 1\x00"
#: Fewest characters of a listed token (a short one could be guessed).
_MIN_LISTED = 16
#: The routes without a run that a scoped token may use.
_OPEN_ROUTES = frozenset({API_PREFIX + "/health", API_PREFIX + "/runs", CHANNEL_PATH})


@dataclass(frozen=True)
class Scope:
    """The runs a token may use.

    Attributes:
        prefix: Their id's prefix (``None``: every run, and the server-wide routes).
        name: How messages and quotas name the token (never the token itself).
    """

    prefix: str | None = None
    name: str = "the server's token"

    @property
    def everything(self) -> bool:
        """Whether it is the server's own token (or the server has none)."""
        return self.prefix is None

    def allows(self, run_id: str) -> bool:
        """Whether run ``run_id`` is one of its runs."""
        return self.prefix is None or run_id.startswith(self.prefix)


#: The scope of the server's own token, and of every request to a server without one.
EVERY_RUN = Scope()


def _request_key() -> Any:
    """The key a request's scope is kept under: a typed ``web.RequestKey`` where aiohttp has
    it (its recent releases, which warn of a plain string), a string on the older releases
    ``pyproject.toml`` admits (3.10.4 on, which have no ``RequestKey``)."""
    key_type = getattr(web, "RequestKey", None)
    return "aelastic_scope" if key_type is None else key_type("aelastic_scope", Scope)


#: The scope of a request, set by the bearer check.
SCOPE: Any = _request_key()


def scope_of(request: web.Request) -> Scope:
    """The scope of ``request``'s token (every run when the server checks no token)."""
    scope = request.get(SCOPE)
    return EVERY_RUN if not isinstance(scope, Scope) else scope


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: bytes) -> bytes:
    return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))


def _mac(secret: bytes, prefix: str) -> str:
    return _b64(hmac.new(secret, _DOMAIN + prefix.encode("utf-8"), hashlib.sha256).digest())


def _check_prefix(prefix: str) -> str:
    try:
        return require_run_id(prefix)
    except SchemaError:
        raise ValueError(
            f"a run-id prefix must be 1 to 256 characters of text without NUL: {prefix!r}"
        ) from None


def mint(secret: str, prefix: str) -> str:
    """The token for the runs whose id starts with ``prefix``, on a server whose own token is
    ``secret`` (what ``aelastic serve --mint-token PREFIX`` prints).

    Raises:
        ValueError: ``secret`` is empty, or ``prefix`` is not 1..256 characters of text.
    """
    if not secret:
        raise ValueError(f"minting a token needs the server's token ({TOKEN_ENV})")
    _check_prefix(prefix)
    return f"{MINTED}{_b64(prefix.encode('utf-8'))}.{_mac(secret.encode('utf-8'), prefix)}"


class Scopes:
    """The tokens a server takes, and the scope of each (see the module docstring).

    Args:
        secret: The server's own token (``None``: the server checks no token).
        listed: Scoped tokens and their scopes (:func:`load_scoped_tokens`).

    Raises:
        ValueError: Tokens are listed but the server has no token of its own.
    """

    def __init__(self, secret: str | None, listed: Mapping[str, Scope] | None = None) -> None:
        if listed and not secret:
            raise ValueError(
                f"scoped tokens need the server's own token ({TOKEN_ENV}): it is the "
                "operator's, and the key of minted tokens"
            )
        if secret and listed and secret in listed:
            raise ValueError(f"a scoped token is the server's own token ({TOKEN_ENV})")
        self.checked = secret is not None
        self._operator = f"Bearer {secret}".encode() if secret else b""
        self._key = (secret or "").encode("utf-8")
        self._listed = {
            hashlib.sha256(token.encode("utf-8")).digest(): (token.encode("utf-8"), scope)
            for token, scope in (listed or {}).items()
        }

    def resolve(self, header: str | None) -> Scope | None:
        """The scope of an ``Authorization`` header's bearer token (``None``: no token this
        server takes; at once when the server checks none)."""
        if not self.checked:
            return EVERY_RUN
        given = (header or "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, self._operator):
            return EVERY_RUN
        if not given.startswith(b"Bearer "):
            return None
        token = given[len(b"Bearer ") :]
        if token.startswith(MINTED.encode()):
            return self._minted(token[len(MINTED) :])
        found = self._listed.get(hashlib.sha256(token).digest())
        if found is not None and hmac.compare_digest(found[0], token):
            return found[1]
        return None

    def _minted(self, rest: bytes) -> Scope | None:
        parts = rest.split(b".")
        if len(parts) != 2:
            return None
        try:
            prefix = _unb64(parts[0]).decode("utf-8")
            _check_prefix(prefix)
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(parts[1], _mac(self._key, prefix).encode("ascii")):
            return None
        return Scope(prefix, f"the token minted for {prefix!r}")


def check_run(scope: Scope, run_id: str) -> None:
    """Let a request for run ``run_id`` through if its token may use it.

    Raises:
        Refused: ``403``: the run is not one of the token's.
    """
    if not scope.allows(run_id):
        raise Refused(
            403,
            f"{scope.name} may use only the runs whose id starts with {scope.prefix!r} "
            f"(a scoped token): run {run_id!r} is not one of them",
        )


def check_route(request: web.Request, scope: Scope) -> None:
    """Let a scoped request through if its route is one of its runs' (or open to it).

    Raises:
        Refused: ``403``: another run, or a route of the server's own token.
    """
    if scope.everything:
        return
    run_id = request.match_info.get("run_id")
    if run_id is not None:
        check_run(scope, run_id)
    elif request.path not in _OPEN_ROUTES:
        raise Refused(
            403,
            f"{scope.name} may use only the runs whose id starts with {scope.prefix!r} "
            f"(a scoped token): {request.path} needs the server's own token ({TOKEN_ENV})",
        )


def warn_if_open(path: str | os.PathLike[str], what: str) -> None:
    """Log a warning when other users may read or write ``path`` (it holds secrets)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s %s can be read or written by other users of this machine (mode %o): chmod 600 it",
            what,
            path,
            stat.S_IMODE(mode),
        )


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The server's token from a file (its first line, stripped); warns when the file is
    open to other users.

    Raises:
        ValueError: The file cannot be read, or its first line is empty.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token file {path}: {exc}") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"the token file {path} is empty: put the token on its first line")
    warn_if_open(path, "the token file")
    return token


def load_scoped_tokens(path: str | os.PathLike[str]) -> dict[str, Scope]:
    """The scoped tokens listed in ``path``: one ``TOKEN RUN_ID_PREFIX`` a line (blank lines
    and lines starting with ``#`` are skipped); warns when the file is open to other users.

    Raises:
        ValueError: The file cannot be read, or a line is not a token of at least 16
            characters and a prefix, or a token is listed twice or has the minted form.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the scoped tokens file {path}: {exc}") from None
    warn_if_open(path, "the scoped tokens file")
    tokens: dict[str, Scope] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{path}, line {number}"
        if len(fields) != 2:
            raise ValueError(f"{where}: expected 'TOKEN RUN_ID_PREFIX' ({len(fields)} fields)")
        token, prefix = fields
        if len(token) < _MIN_LISTED:
            raise ValueError(f"{where}: a token needs at least {_MIN_LISTED} characters")
        if token.startswith(MINTED):
            raise ValueError(f"{where}: a listed token cannot begin like a minted one")
        if token in tokens:
            raise ValueError(f"{where}: this token is listed twice")
        try:
            _check_prefix(prefix)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        tokens[token] = Scope(prefix, f"the token of {where}")
    return tokens
