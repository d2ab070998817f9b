"""Who sent a request: its client's address, and the scheme and host its browser used.

How it works: a request's client is its connection's peer, unless that peer is a trusted
proxy (``aelastic serve --trusted-proxy ADDRESS|NETWORK``). Then the client is the
right-most address of ``X-Forwarded-For`` that is not itself a trusted proxy, the scheme
the first value of ``X-Forwarded-Proto`` and the host ``X-Forwarded-Host`` (or ``Host``).
The same headers from any other peer are ignored: anyone can send them. The limits kept
per client (failed token checks: :mod:`._throttle`; nodes added: :mod:`._quota`; the
pages' streams) count by :meth:`Clients.key`: the address, or for IPv6 its /64 network
(one host usually holds a whole /64, and would otherwise have 2**64 fresh names).

Hand-written (three header reads) rather than aiohttp-remotes: its strict middleware
refuses requests whose peer is not the proxy (nodes reach the server directly while
browsers come through the proxy), the relaxed one believes anyone, and both clone every
request, the nodes' heartbeats included.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from functools import lru_cache

from aiohttp import web
from yarl import URL

__all__ = ["CLIENTS", "Clients", "parse_networks"]

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
#: Addresses of ``X-Forwarded-For`` read at most (a longer chain is cut from the left).
_MAX_HOPS = 16


def parse_networks(values: Iterable[str]) -> tuple[_Network, ...]:
    """Addresses or networks (``10.0.0.5``, ``10.0.0.0/8``, ``::1``), parsed.

    Raises:
        ValueError: A value is neither, naming it.
    """
    networks = []
    for value in values:
        text = value.strip()
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(
                f"{value!r} is not an IP address or network (e.g. 127.0.0.1, 10.0.0.0/8, ::1)"
            ) from None
    return tuple(networks)


@lru_cache(maxsize=4096)
def _address(text: str) -> _Address | None:
    try:
        address = ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _forwarded(request: web.Request, name: str) -> list[str]:
    values = ",".join(request.headers.getall(name, ()))
    return [v.strip() for v in values.split(",") if v.strip()]


class Clients:
    """How a server names its clients (see the module docstring).

    Args:
        trusted_proxies: Addresses or networks of the proxies whose ``X-Forwarded-*``
            headers are believed.
    """

    def __init__(self, trusted_proxies: Iterable[str] = ()) -> None:
        self.trusted = parse_networks(trusted_proxies)

    def _trusts(self, address: _Address | None) -> bool:
        return address is not None and any(address in net for net in self.trusted)

    def _peer(self, request: web.Request) -> _Address | None:
        return _address(request.remote or "")

    def proxied(self, request: web.Request) -> bool:
        """Whether ``request`` came through a trusted proxy (its connection may carry
        requests of other clients)."""
        return bool(self.trusted) and self._trusts(self._peer(request))

    def address(self, request: web.Request) -> _Address | None:
        """The client's address (``None`` when the peer has none: a Unix socket)."""
        peer = self._peer(request)
        if not self.proxied(request):
            return peer
        hops = _forwarded(request, "X-Forwarded-For")[-_MAX_HOPS:]
        for text in reversed(hops):
            hop = _address(text)
            if hop is None:
                break  # a hop that is not an address: trust nothing further left
            if not self._trusts(hop):
                return hop
            peer = hop
        return peer

    def key(self, request: web.Request) -> str:
        """The name limits per client count by (an address, or an IPv6 /64)."""
        return _key(self.address(request))

    def is_loopback(self, request: web.Request) -> bool:
        """Whether the client is on this machine."""
        address = self.address(request)
        return address is None or address.is_loopback

    def scheme(self, request: web.Request) -> str:
        """``https`` or ``http``, as the client's browser connected."""
        if self.proxied(request):
            proto = _forwarded(request, "X-Forwarded-Proto")
            if proto and proto[0].lower() in ("http", "https"):
                return proto[0].lower()
        return request.scheme

    def secure(self, request: web.Request) -> bool:
        """Whether the browser reached this server over HTTPS (itself or a trusted proxy)."""
        return request.secure or self.scheme(request) == "https"

    def host(self, request: web.Request) -> str:
        """The host (and port) the browser asked for."""
        if self.proxied(request):
            hosts = _forwarded(request, "X-Forwarded-Host")
            if hosts:
                return hosts[0]
        return request.host

    def same_origin(self, request: web.Request, origin: str) -> bool:
        """Whether ``origin`` (an ``Origin`` header) is this server as the browser sees it."""
        return _origin(origin) == _origin(f"{self.scheme(request)}://{self.host(request)}")


def _key(address: _Address | None) -> str:
    if address is None:
        return "local"
    if isinstance(address, ipaddress.IPv6Address) and not address.is_loopback:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _origin(text: str) -> tuple[str, str, int | None] | None:
    try:
        url = URL(text)
    except (ValueError, TypeError):
        return None
    if not url.absolute or url.host is None:
        return None
    try:
        port = url.port
    except ValueError:
        return None
    return url.scheme.lower(), url.host.lower(), port


#: The server's :class:`Clients` (the pages read it; an app without one names clients by
#: their peers).
CLIENTS = web.AppKey("aelastic_clients", Clients)
