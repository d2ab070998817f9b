"""Where the Redis server is and how to log in: endpoint parsing and credentials.

How it works: :func:`parse_endpoint` turns one of three kinds of endpoint into a
:class:`RedisEndpoint`:

* a standalone server (or a proxy): ``redis://[user:password@]host:port/db``,
  ``rediss://...`` (TLS) or a bare ``host[:port]``;
* a primary found by Redis Sentinel:
  ``redis+sentinel://[user:password@]host1:port1[,host2:port2...]/service[/db]`` (the hosts
  are sentinels, port 26379 by default; ``rediss+sentinel://`` for TLS);
* a Redis Cluster: ``redis+cluster://[user:password@]host:port[,host:port...]`` (any nodes of
  it; ``rediss+cluster://`` for TLS).

The credentials of the data nodes come, in order of precedence, from the config keys
``username``/``password``, from the URL, or from the environment
(``AELASTIC_REDIS_USERNAME``/``AELASTIC_REDIS_PASSWORD``); those of the sentinels from the
config keys ``sentinel_username``/``sentinel_password`` or the environment
(``AELASTIC_REDIS_SENTINEL_PASSWORD``), so none has to appear on a command line. No password
ever shows: not in ``repr``, not in :attr:`RedisEndpoint.display` (which every error message
uses).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from ...core.params import parse_rendezvous_endpoint

__all__ = [
    "CLUSTER",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_SENTINEL_PORT",
    "ENV_PASSWORD",
    "ENV_SENTINEL_PASSWORD",
    "ENV_USERNAME",
    "SENTINEL",
    "STANDALONE",
    "RedisEndpoint",
    "parse_endpoint",
]

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
ENV_USERNAME = "AELASTIC_REDIS_USERNAME"
ENV_PASSWORD = "AELASTIC_REDIS_PASSWORD"
ENV_SENTINEL_PASSWORD = "AELASTIC_REDIS_SENTINEL_PASSWORD"

#: The kinds of endpoint.
STANDALONE, SENTINEL, CLUSTER = "standalone", "sentinel", "cluster"

#: scheme -> (kind, TLS)
_SCHEMES = {
    "redis": (STANDALONE, False),
    "rediss": (STANDALONE, True),
    "redis+sentinel": (SENTINEL, False),
    "rediss+sentinel": (SENTINEL, True),
    "redis+cluster": (CLUSTER, False),
    "rediss+cluster": (CLUSTER, True),
}
_EXPECTED = (
    "redis://[user[:password]@]host[:port][/db], rediss://... (TLS), host[:port], "
    "redis+sentinel://[user[:password]@]host:port[,host:port...]/service[/db] or "
    "redis+cluster://[user[:password]@]host:port[,host:port...]"
)
_CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True)
class RedisEndpoint:
    """A parsed Redis endpoint with its credentials and TLS options.

    Attributes:
        host: Server host name or address (the first sentinel or cluster node).
        port: Server port (likewise).
        db: Database number.
        tls: Whether to connect with TLS (``rediss://``, ``rediss+sentinel://``...).
        username: ACL user name of the data nodes, if any.
        password: Password of the data nodes, if any (never shown).
        ssl_ca_certs: CA bundle for TLS (config key ``ssl_ca_certs``).
        ssl_certfile: Client certificate for TLS (config key ``ssl_certfile``).
        ssl_keyfile: Client key for TLS (config key ``ssl_keyfile``).
        ssl_cert_reqs: ``none``, ``optional`` or ``required`` (config key ``ssl_cert_reqs``).
        kind: ``"standalone"``, ``"sentinel"`` or ``"cluster"``.
        hosts: Every address given: the sentinels, or the cluster's startup nodes (for a
            standalone server, its one address).
        service: The name Sentinel knows the primary by (``kind == "sentinel"``).
        sentinel_username: ACL user name of the sentinels, if any.
        sentinel_password: Password of the sentinels, if any (never shown).
    """

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"
    kind: str = STANDALONE
    hosts: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.hosts:
            object.__setattr__(self, "hosts", ((self.host, self.port),))

    @property
    def addresses(self) -> str:
        """``host:port[,host:port...]`` of :attr:`hosts` (IPv6 addresses in brackets)."""
        return ",".join(_address(host, port) for host, port in self.hosts)

    @property
    def display(self) -> str:
        """The endpoint as a URL without the password, for logs and error messages."""
        scheme = "rediss" if self.tls else "redis"
        user = f"{self.username}@" if self.username else ""
        if self.kind == SENTINEL:
            return f"{scheme}+sentinel://{user}{self.addresses}/{self.service}/{self.db}"
        if self.kind == CLUSTER:
            return f"{scheme}+cluster://{user}{self.addresses}"
        return f"{scheme}://{user}{_address(self.host, self.port)}/{self.db}"

    @property
    def identity(self) -> tuple[Any, ...]:
        """What makes two endpoints share connections (passwords only as digests)."""
        secret = hashlib.sha256((self.password or "").encode()).hexdigest()
        sentinel_secret = hashlib.sha256((self.sentinel_password or "").encode()).hexdigest()
        return (
            self.kind,
            self.hosts,
            self.service,
            self.db,
            self.tls,
            self.username,
            secret,
            self.sentinel_username,
            sentinel_secret,
            self.ssl_ca_certs,
            self.ssl_certfile,
            self.ssl_keyfile,
            self.ssl_cert_reqs,
        )


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bad(endpoint: str, why: str) -> ValueError:
    return ValueError(
        f"The Redis rendezvous endpoint '{_scrub(endpoint)}' is not valid: {why}. Expected "
        f"{_EXPECTED}."
    )


def _scrub(endpoint: str) -> str:
    """``endpoint`` with any password in it masked (for error messages)."""
    head, sep, tail = endpoint.rpartition("@")
    if not sep:
        return endpoint
    scheme, dsep, userinfo = head.partition("://")
    if not dsep:
        scheme, userinfo = "", head
    user = userinfo.split(":", 1)[0]
    masked = f"{user}:***" if ":" in userinfo else user
    return f"{scheme}{dsep}{masked}@{tail}"


def _port(endpoint: str, text: str | None, default: int = DEFAULT_PORT) -> int:
    if text is None:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad(endpoint, f"the port '{text}' is not a number between 1 and 65535")
    return int(text)


def _host_port(endpoint: str, hostinfo: str) -> tuple[str, str | None]:
    """(host, port text) of ``host[:port]`` or ``[v6 address][:port]``."""
    if hostinfo.startswith("["):
        host, bracket, rest = hostinfo[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise _bad(endpoint, "the IPv6 address is not closed by ']'")
        return host, rest[1:] if rest else None
    host, colon, port = hostinfo.partition(":")
    if ":" in port:
        raise _bad(endpoint, "an IPv6 address must be written in brackets")
    return host, port if colon else None


@dataclass
class _Parts:
    kind: str
    tls: bool
    hosts: list[tuple[str, int]]
    db: int
    service: str | None
    username: str | None
    password: str | None


def _urlsplit(endpoint: str) -> SplitResult:
    """``endpoint`` split as a URL whose network location may list several hosts.

    The location is cut out before ``urlsplit`` sees it: Python's later security fixes
    (Debian's 3.11.2 has them) refuse a location where an IPv6 address in brackets is not
    the first host, as in ``redis+sentinel://h1:1,[::1]:2/svc``."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = "", endpoint
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    try:
        url = urlsplit(f"{scheme}://host{tail}" if scheme else f"//host{tail}")
    except ValueError as exc:
        raise _bad(endpoint, str(exc)) from None
    return url._replace(netloc=netloc)


def _split(endpoint: str) -> _Parts:
    """The parts of ``endpoint`` (a URL of one of the three kinds, or a bare host:port)."""
    if any(c.isspace() for c in endpoint):
        raise _bad(endpoint, "it contains white space")
    url = _urlsplit(endpoint)
    if "://" not in endpoint:
        if url.path or url.query or url.fragment or "@" in endpoint:
            raise _bad(endpoint, "a bare host:port takes no path, query or credentials")
        kind, tls = STANDALONE, False
    else:
        scheme = url.scheme.lower()
        if scheme not in _SCHEMES:
            raise _bad(endpoint, f"the scheme '{url.scheme}' is not one of {', '.join(_SCHEMES)}")
        kind, tls = _SCHEMES[scheme]
    if url.query or url.fragment:
        raise _bad(endpoint, "query parameters are not supported (use configuration keys)")
    default = DEFAULT_SENTINEL_PORT if kind == SENTINEL else DEFAULT_PORT
    hosts = []
    for hostinfo in url.netloc.rpartition("@")[2].split(","):
        host, port_text = _host_port(endpoint, hostinfo)
        if not host:
            raise _bad(endpoint, "a host is missing")
        hosts.append((host, _port(endpoint, port_text, default)))
    if len(hosts) > 1 and kind == STANDALONE:
        raise _bad(endpoint, "several hosts need redis+sentinel:// or redis+cluster://")
    db, service = _path(endpoint, kind, url.path)
    username = unquote(url.username) if url.username else None
    password = unquote(url.password) if url.password is not None else None
    return _Parts(kind, tls, hosts, db, service, username, password)


def _path(endpoint: str, kind: str, path: str) -> tuple[int, str | None]:
    """(database, service name) of the URL's path."""
    segments = path.strip("/").split("/") if path.strip("/") else []
    service = None
    if kind == SENTINEL:
        if not segments or not segments[0]:
            raise _bad(endpoint, "the Sentinel service name (the primary's name) is missing")
        service = unquote(segments.pop(0))
    elif kind == CLUSTER and segments:
        raise _bad(endpoint, "a cluster takes no path (it has database 0 only)")
    if len(segments) > 1 or (segments and not segments[0].isdigit()):
        raise _bad(endpoint, f"the database '{'/'.join(segments)}' is not a non-negative integer")
    return int(segments[0]) if segments else 0, service


def _option(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is None or value == "":
        return None
    return str(value)


def parse_endpoint(
    endpoint: str | None,
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RedisEndpoint:
    """Parse a Redis endpoint and gather its credentials.

    Args:
        endpoint: ``redis://[user[:password]@]host[:port][/db]``, ``rediss://...``,
            ``host[:port]``, ``redis+sentinel://[user[:password]@]host:port[,...]/service[/db]``
            or ``redis+cluster://[user[:password]@]host:port[,...]`` (``rediss+...`` for TLS);
            empty means ``localhost:6379``.
        config: Rendezvous configuration keys: ``username``, ``password``,
            ``sentinel_username``, ``sentinel_password``, ``tls``, ``ssl_ca_certs``,
            ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``.
        environ: Where to look for ``AELASTIC_REDIS_USERNAME``/``AELASTIC_REDIS_PASSWORD``
            and ``AELASTIC_REDIS_SENTINEL_PASSWORD`` (default: ``os.environ``).

    Returns:
        The endpoint. Credentials: config keys win over the URL, the URL over the environment.

    Raises:
        ValueError: The endpoint or an option is malformed (the message hides passwords).
    """
    config = config or {}
    environ = os.environ if environ is None else environ
    text = (endpoint or "").strip()
    if text and "://" not in text and "@" not in text:
        parse_rendezvous_endpoint(text, DEFAULT_PORT)  # a bare host:port: torch's rules
    if text:
        parts = _split(text)
    else:
        parts = _Parts(STANDALONE, False, [(DEFAULT_HOST, DEFAULT_PORT)], 0, None, None, None)
    tls = parts.tls
    tls_option = _option(config, "tls")
    if tls_option is not None:
        if tls_option.lower() not in ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"):
            raise ValueError("The rendezvous configuration option 'tls' must be a boolean.")
        tls = tls or tls_option.lower() in ("1", "true", "t", "yes", "y")
    cert_reqs = (_option(config, "ssl_cert_reqs") or "required").lower()
    if cert_reqs not in _CERT_REQS:
        raise ValueError(
            f"The rendezvous configuration option 'ssl_cert_reqs' must be one of {_CERT_REQS}."
        )
    sentinel = parts.kind == SENTINEL
    return RedisEndpoint(
        host=parts.hosts[0][0],
        port=parts.hosts[0][1],
        db=parts.db,
        tls=tls,
        username=_option(config, "username") or parts.username or environ.get(ENV_USERNAME) or None,
        password=_option(config, "password") or parts.password or environ.get(ENV_PASSWORD) or None,
        ssl_ca_certs=_option(config, "ssl_ca_certs"),
        ssl_certfile=_option(config, "ssl_certfile"),
        ssl_keyfile=_option(config, "ssl_keyfile"),
        ssl_cert_reqs=cert_reqs,
        kind=parts.kind,
        hosts=tuple(parts.hosts),
        service=parts.service,
        sentinel_username=_option(config, "sentinel_username") if sentinel else None,
        sentinel_password=(
            (_option(config, "sentinel_password") or environ.get(ENV_SENTINEL_PASSWORD) or None)
            if sentinel
            else None
        ),
    )
