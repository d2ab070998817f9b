"""Who may take the operator's routes of the server (closing and deleting a run).

How it works: with a token, the token (checked for every route by the bearer middleware):
every token holder is an operator. Without one, a request from the server's own machine
only: its client (:mod:`._clients`: the peer, or behind a ``--trusted-proxy`` the address
it forwarded) is a loopback address, and a request from an untrusted peer carries none of
the headers a proxy adds (``Forwarded``, ``X-Forwarded-For``, ``X-Real-IP``): a proxy on
the same machine that adds them makes its clients' requests remote, as they are. Else
``403``, saying what to do. See ``docs/security.md``.
"""

from __future__ import annotations

import ipaddress

from aiohttp import web

from ..wire import TOKEN_ENV
from ._clients import CLIENTS

__all__ = ["HAS_TOKEN", "is_loopback", "require_operator"]

#: Whether the server checks a token (its operator's routes are then open to token holders).
HAS_TOKEN = web.AppKey("aelastic_has_token", bool)
#: Headers a proxy adds: a request carrying one came from elsewhere, whatever its peer.
_FORWARDED = ("Forwarded", "X-Forwarded-For", "X-Real-IP")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, IPv4 mapped in IPv6 too, or ``localhost``) is this
    machine's loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def require_operator(request: web.Request) -> None:
    """Let an operator's request through: a token holder's, or (no token) one from this
    machine that no proxy forwarded.

    Raises:
        web.HTTPForbidden: It is neither.
    """
    if request.app[HAS_TOKEN]:
        return  # the token was checked
    clients = request.app[CLIENTS]
    local = clients.is_loopback(request)
    if not clients.proxied(request):
        local = local and not any(h in request.headers for h in _FORWARDED)
    if not local:
        raise web.HTTPForbidden(
            reason="this server has no token: a run is closed or deleted only from the "
            "server's own machine (loopback); run `aelastic status --close/--reset` there, "
            f"or start the server with a token ({TOKEN_ENV})"
        )
