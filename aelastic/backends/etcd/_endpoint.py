"""Where the etcd cluster is and how to log in: endpoint and config parsing.

How it works: :func:`parse_endpoint` reads torch's endpoint form, ``host[:port]`` with the
default port 2379, several members separated by commas (``h1:2379,h2:2379,h3:2379``); a
member may also be written as a URL (``http://h1:2379``, ``https://...``). torch's
``--rdzv-conf`` keys apply: ``protocol`` (``http`` or ``https``), ``cacert``, ``cert``,
``key`` (TLS files) and ``etcd_prefix`` (where aelastic's keys live; ``/aelastic`` by
default). A user and password for etcd's authentication come from the environment only
(:data:`ENV_USERNAME`, :data:`ENV_PASSWORD`): never from the command line, never shown
(:attr:`EtcdEndpoint.display`, which every message uses, has no credentials; ``repr`` hides
the password).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ...core.params import parse_rendezvous_endpoint

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "ENV_PASSWORD",
    "ENV_USERNAME",
    "EtcdEndpoint",
    "parse_endpoint",
]

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/aelastic"
ENV_USERNAME = "AELASTIC_ETCD_USERNAME"
ENV_PASSWORD = "AELASTIC_ETCD_PASSWORD"

#: Config keys that would put a credential on a command line: refused.
_SECRET_KEYS = ("password", "etcd_password")


@dataclass(frozen=True)
class EtcdEndpoint:
    """The members of an etcd cluster, the TLS files, the key prefix and the login.

    Attributes:
        members: ``(host, port)`` of every member given, in order.
        tls: Whether to speak HTTPS (``protocol=https`` or ``https://`` members).
        cacert: CA bundle that signs the members' certificates (``cacert``).
        cert: Client certificate (``cert``).
        key: The client certificate's key (``key``).
        prefix: Where aelastic's keys live (``etcd_prefix``), without a trailing slash.
        username: etcd user (from :data:`ENV_USERNAME`), if any.
        password: Its password (from :data:`ENV_PASSWORD`; never shown).
    """

    members: tuple[tuple[str, int], ...]
    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = DEFAULT_PREFIX
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def urls(self) -> tuple[str, ...]:
        """The base URL of every member."""
        scheme = "https" if self.tls else "http"
        return tuple(f"{scheme}://{_host(h)}:{p}" for h, p in self.members)

    @property
    def display(self) -> str:
        """The members as one line, for messages (no credentials)."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://" + ",".join(f"{_host(h)}:{p}" for h, p in self.members)

    @property
    def identity(self) -> tuple[object, ...]:
        """What makes two endpoints share a client (the login included, never shown)."""
        return (self.members, self.tls, self.cacert, self.cert, self.key, self.username,
                self.password)  # fmt: skip

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the members' connections (``None`` over plain HTTP).

        Raises:
            ValueError: A TLS file cannot be read.
        """
        if not self.tls:
            return None
        for option, path in (("cacert", self.cacert), ("cert", self.cert), ("key", self.key)):
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"The etcd TLS file {option}={path} cannot be read.")
        try:  # hostname checks on (the default context's): a member's name or IP, as given
            context = ssl.create_default_context(cafile=self.cacert)
            if self.cert:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(f"{k}={v}" for k, v in self.tls_files.items())
            raise ValueError(f"The etcd TLS files ({files}) cannot be used: {exc}") from None
        return context

    @property
    def tls_files(self) -> dict[str, str]:
        """The TLS files given, by their ``--rdzv-conf`` key."""
        files = {"cacert": self.cacert, "cert": self.cert, "key": self.key}
        return {k: v for k, v in files.items() if v}


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _member(text: str, tls: bool | None) -> tuple[str, int, bool | None]:
    """``(host, port, tls)`` of one member (``tls`` ``None``: not said by the member)."""
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"The etcd member '{text}' is not host[:port], http://host:port or "
                "https://host:port."
            )
        if parts.username or parts.password:
            raise ValueError(
                f"The etcd endpoint must not carry credentials; set {ENV_USERNAME} and "
                f"{ENV_PASSWORD} instead."
            )
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"The etcd member '{parts.netloc}' has an invalid port.") from None
        return parts.hostname, port, parts.scheme == "https"
    if "@" in text:
        raise ValueError(
            f"The etcd endpoint must not carry credentials; set {ENV_USERNAME} and "
            f"{ENV_PASSWORD} instead."
        )
    host, port = parse_rendezvous_endpoint(text, DEFAULT_PORT)
    return host, port, tls


def parse_endpoint(
    endpoint: str, config: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> EtcdEndpoint:
    """The etcd members and options that ``endpoint`` and ``config`` name.

    Args:
        endpoint: ``host[:port][,host[:port]...]`` (torch's form) or member URLs.
        config: The ``--rdzv-conf`` keys (``protocol``, ``cacert``, ``cert``, ``key``,
            ``etcd_prefix``).
        environ: Where the credentials are read (default: ``os.environ``).

    Raises:
        ValueError: The endpoint or an option is malformed, or a password was given as a
            config key.
    """
    env = os.environ if environ is None else environ
    for secret in _SECRET_KEYS:
        if config.get(secret):
            raise ValueError(
                f"The etcd password must not be given as a config key ('{secret}'): set "
                f"{ENV_PASSWORD} (and {ENV_USERNAME}) in the environment instead."
            )
    protocol = str(config.get("protocol") or "http").lower()
    if protocol not in ("http", "https"):
        raise ValueError(f"The etcd option 'protocol' ({protocol!r}) must be http or https.")
    tls: bool | None = protocol == "https" if config.get("protocol") else None
    members: list[tuple[str, int]] = []
    schemes: set[bool] = set()
    for part in (endpoint or "").split(","):
        text = part.strip()
        if not text and members:
            continue
        host, port, member_tls = _member(text, tls)
        if member_tls is not None:
            schemes.add(member_tls)
        if (host, port) not in members:
            members.append((host, port))
    if len(schemes) > 1:
        raise ValueError("The etcd members mix http:// and https://: use one protocol.")
    secure = schemes.pop() if schemes else bool(tls)
    if tls is not None and tls != secure:
        raise ValueError(f"The etcd option 'protocol={protocol}' contradicts the members' URLs.")
    cacert, cert, key = (config.get(k) or None for k in ("cacert", "cert", "key"))
    if (cacert or cert) and not secure:
        raise ValueError(
            "The etcd TLS files (cacert, cert) need protocol=https (or https:// members)."
        )
    if key and not cert:
        raise ValueError("The etcd option 'key' needs 'cert' (the client certificate).")
    prefix = str(config.get("etcd_prefix") or DEFAULT_PREFIX).rstrip("/")
    if not prefix.startswith("/"):
        prefix = "/" + prefix
    username = env.get(ENV_USERNAME) or None
    password = env.get(ENV_PASSWORD) or None
    if password and not username:
        raise ValueError(f"{ENV_PASSWORD} is set but {ENV_USERNAME} is not.")
    return EtcdEndpoint(
        members=tuple(members),
        tls=secure,
        cacert=str(cacert) if cacert else None,
        cert=str(cert) if cert else None,
        key=str(key) if key else None,
        prefix=prefix,
        username=username,
        password=password,
    )
