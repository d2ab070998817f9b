"""Options of the clients that stay redis-py's: the sentinels' (``Sentinel``) and a
Cluster's (``RedisCluster``). Each connection spares the optional round trips of its
handshake where redis-py allows it, and never retries on its own (:mod:`._calls` does).
"""

from __future__ import annotations

import inspect
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ._endpoint import RedisEndpoint
from ._resp import CONNECT_TIMEOUT

__all__ = ["accepted", "connection_kwargs", "sentinel_kwargs"]


def accepted(*classes: type) -> set[str]:
    """Keyword arguments the ``__init__`` of ``classes`` (and their bases) take."""
    names: set[str] = set()
    for cls in classes:
        for base in cls.__mro__:
            init = base.__dict__.get("__init__")
            if init is not None:
                names.update(inspect.signature(init).parameters)
    return names


def _quiet_handshake() -> dict[str, Any]:
    """Options that spare a new connection's optional round trips, where redis-py has them."""
    # The options are taken by a base class's __init__ (Connection's own takes **kwargs).
    options = accepted(Connection)
    quiet: dict[str, Any] = {}
    if "driver_info" in options:  # no CLIENT SETINFO lib-name/lib-ver
        quiet["driver_info"] = None
    if "maint_notifications_config" in options:
        from redis.maint_notifications import MaintNotificationsConfig

        quiet["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return quiet


_QUIET = _quiet_handshake()


def connection_kwargs(endpoint: RedisEndpoint) -> dict[str, Any]:
    """Options of a connection to a data node of ``endpoint`` (host and port aside)."""
    kwargs: dict[str, Any] = {
        "db": endpoint.db,
        "username": endpoint.username,
        "password": endpoint.password,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": CONNECT_TIMEOUT,
        "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 0),
        "connection_class": Connection,
        "protocol": 2,  # RESP2: no HELLO round trip on connect
    }
    kwargs.update(_QUIET)
    if endpoint.tls:
        kwargs.update(
            connection_class=SSLConnection,
            ssl_ca_certs=endpoint.ssl_ca_certs,
            ssl_certfile=endpoint.ssl_certfile,
            ssl_keyfile=endpoint.ssl_keyfile,
            ssl_cert_reqs=endpoint.ssl_cert_reqs,
        )
    return kwargs


def sentinel_kwargs(endpoint: RedisEndpoint, data: dict[str, Any]) -> dict[str, Any]:
    """Options of the clients of the sentinels: their own login, the data nodes' TLS."""
    options = accepted(Redis)
    kwargs = {k: v for k, v in data.items() if k in options and k not in ("db", "retry")}
    kwargs.pop("connection_class", None)
    kwargs.update(username=endpoint.sentinel_username, password=endpoint.sentinel_password)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    if endpoint.tls:
        kwargs["ssl"] = True
    return kwargs
