"""Who may read the pages: the token, sessions, and where a login or a logout comes from.

How it works: without a token everybody is let in. With one, a request is let in when it
carries ``Authorization: Bearer <token>`` or the cookie of a live session. A login (the
token, right, on the login form) makes a session: a random id (256 bits) sent in an
``HttpOnly``, ``SameSite=Strict`` cookie, ``Secure`` when the browser came over HTTPS (to
this server, or to a trusted proxy: ``aelastic serve --trusted-proxy``). The server keeps
only each id's SHA-256 digest and its expiry (:data:`SESSION_TTL`), at most
:data:`MAX_SESSIONS` (the oldest dropped first); a logout forgets the session, so its
cookie opens nothing afterwards, and a restart forgets them all. A token compared is
compared in constant time, and a failed one (login form: ``login``; bearer header:
``bearer``) is counted for its client, which past a few must wait (``429``: the server's
:class:`~aelastic.backends.http.server.AuthThrottle`, shared with the API). A login and a
logout must come from the pages themselves: a browser's ``Origin`` (or
``Sec-Fetch-Site``) naming another site is refused, as is a logout by ``GET``.

``SameSite=Strict`` rather than ``Lax``: a link to a run's page from elsewhere (a chat, a
mail) shows the login form once more, but no request from another site ever carries the
session, the pages' ``GET`` streams included.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import parse_qs, unquote

from aiohttp import web

from ..backends.http.server import AuthThrottle, Clients
from ..backends.http.wire import SchemaError, require_run_id
from ..core.race import wait_within

__all__ = [
    "COOKIE",
    "MAX_SESSIONS",
    "SESSION_TTL",
    "Gate",
    "Throttled",
    "login_form",
    "next_page",
]

#: The session cookie's name.
COOKIE = "aelastic_session"
#: Seconds a session lasts from its login.
SESSION_TTL = 12 * 3600.0
#: Sessions kept at most (the oldest is dropped for a new one).
MAX_SESSIONS = 1000
#: Where a login may send the browser back to: the runs, or a run's page (its id
#: percent-encoded, as the pages write it).
_NEXT = re.compile(r"(runs/(?:[A-Za-z0-9._~-]|%[0-9A-Fa-f]{2}){1,3072})?")
#: Largest login form read (a token and a path), and the seconds it may take to arrive.
_MAX_FORM = 16 * 1024
_FORM_TIMEOUT = 10.0


def next_page(value: object) -> str:
    """The login's ``next`` (a page of this server), checked.

    Raises:
        SchemaError: It is not a page of this server.
    """
    if value is None:
        return ""
    if not isinstance(value, str) or not _NEXT.fullmatch(value):
        raise SchemaError("'next' must be the runs ('') or a run's page ('runs/<run id>')")
    if value:
        try:
            require_run_id(unquote(value[len("runs/") :], errors="strict"))
        except (SchemaError, UnicodeDecodeError):
            raise SchemaError("'next' must name a valid run id") from None
    return value


async def login_form(request: web.Request) -> dict[str, str]:
    """The fields of a login form (``application/x-www-form-urlencoded``, UTF-8).

    Raises:
        SchemaError: The body is not such a form (or is larger than a login's).
    """
    if request.content_type != "application/x-www-form-urlencoded":
        raise SchemaError("a login is a form (application/x-www-form-urlencoded)")
    if (request.charset or "utf-8").lower() not in ("utf-8", "us-ascii"):
        raise SchemaError("a login form is UTF-8")
    if (request.content_length or 0) > _MAX_FORM:
        raise SchemaError("the form is too large for a login")
    try:
        raw = await wait_within(_body(request), _FORM_TIMEOUT)
    except TimeoutError:
        raise SchemaError(f"the form did not arrive within {_FORM_TIMEOUT:g} s") from None
    try:
        fields = parse_qs(
            raw.decode("ascii"), keep_blank_values=True, max_num_fields=8, errors="strict"
        )
    except (UnicodeDecodeError, ValueError):
        raise SchemaError("the form is not valid (URL-encoded UTF-8, a few fields)") from None
    if any(len(values) > 1 for values in fields.values()):
        raise SchemaError("a field of the form is given more than once")
    return {name: values[0] for name, values in fields.items()}


async def _body(request: web.Request) -> bytes:
    raw = b""
    while len(raw) <= _MAX_FORM:
        chunk = await request.content.read(_MAX_FORM + 1 - len(raw))
        if not chunk:
            return raw
        raw += chunk
    raise SchemaError("the form is too large for a login")


class Throttled(Exception):
    """The client failed too many token checks: it must wait ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"too many failed token checks: retry in {retry_after:.0f} s")
        self.retry_after = retry_after


def _digest(session: str) -> bytes:
    return hashlib.sha256(session.encode("utf-8", "surrogateescape")).digest()


class Gate:
    """Who may read the pages (see the module docstring).

    Args:
        token: The token; ``None`` or empty lets everybody in.
        clients: How the server names its clients (trusted proxies).
        throttle: Failed token checks per client (shared with the API's check).
        clock: Monotonic seconds (session expiry).
    """

    def __init__(
        self,
        token: str | None,
        clients: Clients | None = None,
        throttle: AuthThrottle | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.token = token or None
        self.clients = clients or Clients()
        self.throttle = throttle or AuthThrottle()
        self._clock = clock
        self._sessions: OrderedDict[bytes, float] = OrderedDict()  # digest -> expiry

    @property
    def sessions(self) -> int:
        """Sessions kept now (some may have expired)."""
        return len(self._sessions)

    def allows(self, request: web.Request) -> bool:
        """Whether ``request`` carries the bearer token or a live session's cookie.

        Raises:
            Throttled: It carries a bearer token, and its client must wait first.
        """
        if self.token is None:
            return True
        if self._session_of(request) is not None:
            return True
        given = request.headers.get("Authorization")
        if given is None:
            return False
        client = self.clients.key(request)
        if wait := self.throttle.wait(client, "bearer"):
            raise Throttled(wait)
        if self._same(given, f"Bearer {self.token}"):
            return True
        self.throttle.failed(client, "bearer")
        return False

    def login(self, request: web.Request, given: str) -> str | None:
        """A new session's id if ``given`` is the token, else ``None`` (counted).

        Raises:
            Throttled: The client must wait before its token is checked.
        """
        client = self.clients.key(request)
        if wait := self.throttle.wait(client, "login"):
            raise Throttled(wait)
        if self.token is None or not self._same(given, self.token):
            self.throttle.failed(client, "login")
            return None
        session = secrets.token_urlsafe(32)
        now = self._clock()
        self._sessions[_digest(session)] = now + SESSION_TTL
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def logout(self, request: web.Request) -> None:
        """Forget the session ``request``'s cookie names (if any)."""
        digest = self._session_of(request)
        if digest is not None:
            del self._sessions[digest]

    def _session_of(self, request: web.Request) -> bytes | None:
        cookie = request.cookies.get(COOKIE)
        if not cookie:
            return None
        digest = _digest(cookie)
        expiry = self._sessions.get(digest)
        if expiry is None:
            return None
        if self._clock() >= expiry:
            del self._sessions[digest]
            return None
        return digest

    def from_here(self, request: web.Request) -> bool:
        """Whether a browser sent ``request`` from the pages themselves (a form's ``POST``):
        no ``Origin`` or ``Sec-Fetch-Site`` names another site."""
        origin = request.headers.get("Origin")
        if origin is not None and not self.clients.same_origin(request, origin):
            return False
        site = request.headers.get("Sec-Fetch-Site")
        return site is None or site == "same-origin"

    def secure(self, request: web.Request) -> bool:
        """Whether the session cookie gets ``Secure`` (the browser came over HTTPS)."""
        return self.clients.secure(request)

    @staticmethod
    def _same(given: str, expected: str) -> bool:
        encode = "utf-8", "surrogateescape"
        return hmac.compare_digest(given.encode(*encode), expected.encode(*encode))
