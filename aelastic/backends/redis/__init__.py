"""The Redis rendezvous backend (``backend="redis"``): production rendezvous across machines.

Endpoints:

* a standalone server (or a proxy): ``redis://[user[:password]@]host[:port][/db]``,
  ``rediss://...`` for TLS, or a bare ``host[:port]`` (default port 6379);
* Redis Sentinel: ``redis+sentinel://[user[:password]@]host:port[,host:port...]/service[/db]``
  (the sentinels, default port 26379, and the name they know the primary by;
  ``rediss+sentinel://`` for TLS): the primary is asked of the sentinels, and found again
  after a failover;
* Redis Cluster: ``redis+cluster://[user[:password]@]host:port[,host:port...]`` (some nodes;
  ``rediss+cluster://`` for TLS): a run's keys share one hash slot.

Credentials of the data nodes may also come from the config keys ``username``/``password``
or the environment (``AELASTIC_REDIS_USERNAME``, ``AELASTIC_REDIS_PASSWORD``); those of the
sentinels from ``sentinel_username``/``sentinel_password`` or
``AELASTIC_REDIS_SENTINEL_PASSWORD``. Other config keys (seconds unless said):

* ``wait_replicas`` (1 with Sentinel or Cluster, 0 standalone): replicas that must hold a
  membership change or a store write before its reply is given (``WAIT``, up to 1 s; when
  they do not answer in time, the backend stops waiting for a while rather than stalling);
  0 never waits;

* ``read_timeout`` (60): how long a call keeps retrying before ``RendezvousConnectionError``;
* ``key_ttl`` (86400): the run's keys expire this long after their last write;
* ``recheck_interval`` (5): re-check period of a store wait, and of a status wait while
  pub/sub is down (changes wake waiters through pub/sub at once);
* ``max_connections`` (16): command connections per endpoint and event loop;
* ``share_connections`` (true): backends of one event loop share connections; false gives
  each its own (what separate hosts have);
* ``key_prefix`` ("aelastic"): namespace of the keys (``<prefix>:{<run id>}:...``);
* ``tls``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``: TLS.

See :mod:`._scripts` for the key layout, :mod:`._lua` for the state machine's Lua port,
:mod:`._client` for the shared connections and notifications, :mod:`._calls` for retries
and errors, :mod:`._servers` for the three kinds of endpoint, :mod:`._backend` for the
operations. ``docs/production-store.md`` compares them and what each survives.
"""

from __future__ import annotations

from ...core.params import RendezvousParameters
from ._backend import RedisBackend
from ._endpoint import (
    ENV_PASSWORD,
    ENV_SENTINEL_PASSWORD,
    ENV_USERNAME,
    STANDALONE,
    RedisEndpoint,
    parse_endpoint,
)
from ._scripts import RunKeys

__all__ = [
    "ENV_PASSWORD",
    "ENV_SENTINEL_PASSWORD",
    "ENV_USERNAME",
    "RedisBackend",
    "RedisEndpoint",
    "RunKeys",
    "create_backend",
    "parse_endpoint",
]


def create_backend(params: RendezvousParameters) -> RedisBackend:
    """Create the Redis backend for ``params.run_id`` at ``params.endpoint``.

    Args:
        params: Endpoint, run id and config keys (see the module documentation).

    Returns:
        A backend; it connects on first use and shares connections with the other
        backends of the same event loop and endpoint.

    Raises:
        ValueError: The endpoint or an option is malformed.
    """
    endpoint = parse_endpoint(params.endpoint, params.config)
    read_timeout = params.get_as_float("read_timeout", 60.0)
    key_ttl = params.get_as_float("key_ttl", 24 * 3600.0)
    recheck = params.get_as_float("recheck_interval", 5.0)
    max_connections = params.get_as_int("max_connections", 16)
    wait_replicas = params.get_as_int("wait_replicas", 0 if endpoint.kind == STANDALONE else 1)
    assert read_timeout is not None and key_ttl is not None and recheck is not None
    assert max_connections is not None and wait_replicas is not None
    return RedisBackend(
        params.run_id,
        endpoint,
        read_timeout=read_timeout,
        key_ttl=key_ttl,
        recheck_interval=recheck,
        max_connections=max_connections,
        key_prefix=str(params.get("key_prefix", "aelastic") or "aelastic"),
        share_connections=bool(params.get_as_bool("share_connections", True)),
        wait_replicas=wait_replicas,
    )
