"""Where the Redis server is and how to log in: endpoint parsing and credentials.

How it works: :func:`parse_endpoint` turns ``redis://[user:password@]host:port/db``,
``rediss://...`` (TLS) or a bare ``host[:port]`` into a :class:`RedisEndpoint`. Credentials
come, in order of precedence, from the config keys ``username``/``password``, from the URL,
or from the environment (``AELASTIC_REDIS_USERNAME``/``AELASTIC_REDIS_PASSWORD``), so they
never have to appear on a command line. The password never shows: not in ``repr``, not in
:attr:`RedisEndpoint.display` (which every error message uses).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from ...core.params import parse_rendezvous_endpoint

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "ENV_PASSWORD",
    "ENV_USERNAME",
    "RedisEndpoint",
    "parse_endpoint",
]

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 6379
ENV_USERNAME = "AELASTIC_REDIS_USERNAME"
ENV_PASSWORD = "AELASTIC_REDIS_PASSWORD"

_SCHEMES = {"redis": False, "rediss": True}
_CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True)
class RedisEndpoint:
    """A parsed Redis endpoint with its credentials and TLS options.

    Attributes:
        host: Server host name or address.
        port: Server port.
        db: Database number.
        tls: Whether to connect with TLS (``rediss://``).
        username: ACL user name, if any.
        password: Password, if any (never shown).
        ssl_ca_certs: CA bundle for TLS (config key ``ssl_ca_certs``).
        ssl_certfile: Client certificate for TLS (config key ``ssl_certfile``).
        ssl_keyfile: Client key for TLS (config key ``ssl_keyfile``).
        ssl_cert_reqs: ``none``, ``optional`` or ``required`` (config key ``ssl_cert_reqs``).
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

    @property
    def display(self) -> str:
        """The endpoint as a URL without the password, for logs and error messages."""
        scheme = "rediss" if self.tls else "redis"
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{user}{host}:{self.port}/{self.db}"

    @property
    def identity(self) -> tuple[Any, ...]:
        """What makes two endpoints share connections (the password only as a digest)."""
        secret = hashlib.sha256((self.password or "").encode()).hexdigest()
        return (
            self.host,
            self.port,
            self.db,
            self.tls,
            self.username,
            secret,
            self.ssl_ca_certs,
            self.ssl_certfile,
            self.ssl_keyfile,
            self.ssl_cert_reqs,
        )


def _bad(endpoint: str, why: str) -> ValueError:
    return ValueError(
        f"The Redis rendezvous endpoint '{_scrub(endpoint)}' is not valid: {why}. Expected "
        "redis://[user[:password]@]host[:port][/db], rediss://... (TLS) or host[:port]."
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


def _port(endpoint: str, text: str | None) -> int:
    if text is None:
        return DEFAULT_PORT
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


def _split(endpoint: str) -> tuple[bool, str, int, int, str | None, str | None]:
    """(tls, host, port, db, username, password) of ``endpoint``."""
    if any(c.isspace() for c in endpoint):
        raise _bad(endpoint, "it contains white space")
    try:
        url = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    except ValueError as exc:
        raise _bad(endpoint, str(exc)) from None
    if "://" not in endpoint:
        if url.path or url.query or url.fragment or "@" in endpoint:
            raise _bad(endpoint, "a bare host:port takes no path, query or credentials")
        scheme = "redis"
    else:
        scheme = url.scheme.lower()
        if scheme not in _SCHEMES:
            raise _bad(endpoint, f"the scheme '{url.scheme}' is not redis:// or rediss://")
    if url.query or url.fragment:
        raise _bad(endpoint, "query parameters are not supported (use configuration keys)")
    host, port_text = _host_port(endpoint, url.netloc.rpartition("@")[2])
    if not host:
        raise _bad(endpoint, "the host is missing")
    path = url.path.strip("/")
    if path and (not path.isdigit() or "/" in path):
        raise _bad(endpoint, f"the database '{path}' is not a non-negative integer")
    username = unquote(url.username) if url.username else None
    password = unquote(url.password) if url.password is not None else None
    return _SCHEMES[scheme], host, _port(endpoint, port_text), int(path or 0), username, password


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
        endpoint: ``redis://[user[:password]@]host[:port][/db]``, ``rediss://...`` or
            ``host[:port]``; empty means ``localhost:6379``.
        config: Rendezvous configuration keys: ``username``, ``password``, ``tls``,
            ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``.
        environ: Where to look for ``AELASTIC_REDIS_USERNAME``/``AELASTIC_REDIS_PASSWORD``
            (default: ``os.environ``).

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
        tls, host, port, db, username, password = _split(text)
    else:
        tls, host, port, db, username, password = False, DEFAULT_HOST, DEFAULT_PORT, 0, None, None
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
    return RedisEndpoint(
        host=host,
        port=port,
        db=db,
        tls=tls,
        username=_option(config, "username") or username or environ.get(ENV_USERNAME) or None,
        password=_option(config, "password") or password or environ.get(ENV_PASSWORD) or None,
        ssl_ca_certs=_option(config, "ssl_ca_certs"),
        ssl_certfile=_option(config, "ssl_certfile"),
        ssl_keyfile=_option(config, "ssl_keyfile"),
        ssl_cert_reqs=cert_reqs,
    )
