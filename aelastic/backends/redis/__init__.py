"""The Redis rendezvous backend (``backend="redis"``): production rendezvous across machines.

Endpoint ``redis://[user[:password]@]host[:port][/db]``, ``rediss://...`` for TLS, or a
bare ``host[:port]`` (default port 6379). Credentials may also come from the config keys
``username``/``password`` or the environment (``AELASTIC_REDIS_USERNAME``,
``AELASTIC_REDIS_PASSWORD``). Other config keys (seconds unless said):

* ``read_timeout`` (60): how long a call keeps retrying before ``RendezvousConnectionError``;
* ``key_ttl`` (86400): the run's keys expire this long after their last write;
* ``recheck_interval`` (5): safety-net re-read period while waiting (changes wake waiters
  through pub/sub at once; this only bounds the delay if a notification were lost);
* ``max_connections`` (16): command connections per endpoint and event loop;
* ``key_prefix`` ("aelastic"): namespace of the keys (``<prefix>:{<run id>}:...``);
* ``tls``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``: TLS.

See :mod:`._scripts` for the key layout, :mod:`._shared` for how handlers of one process
share connections, :mod:`._watch` for notifications and local waiters, :mod:`._backend`
for the operations. Needs a standalone Redis (or a primary); Redis Cluster and Sentinel
discovery are not supported (the run's keys share one hash tag, so a cluster-aware proxy
works).
"""

from __future__ import annotations

from ...rendezvous.api import RendezvousParameters
from ._backend import RedisBackend
from ._endpoint import ENV_PASSWORD, ENV_USERNAME, RedisEndpoint, parse_endpoint
from ._scripts import RunKeys

__all__ = [
    "CONFIG_KEYS",
    "ENV_PASSWORD",
    "ENV_USERNAME",
    "RedisBackend",
    "RedisEndpoint",
    "RunKeys",
    "create_backend",
    "parse_endpoint",
]

#: The ``--rdzv-conf`` keys this backend reads, beyond the rendezvous settings (the CLI
#: warns about any other key).
CONFIG_KEYS = (
    "username",
    "password",
    "key_ttl",
    "recheck_interval",
    "max_connections",
    "key_prefix",
    "tls",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "sentinel_username",
    "sentinel_password",
    "wait_replicas",
    "share_connections",
)


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
    assert read_timeout is not None and key_ttl is not None and recheck is not None
    assert max_connections is not None
    return RedisBackend(
        params.run_id,
        endpoint,
        read_timeout=read_timeout,
        key_ttl=key_ttl,
        recheck_interval=recheck,
        max_connections=max_connections,
        key_prefix=str(params.get("key_prefix", "aelastic") or "aelastic"),
    )
