"""The etcd rendezvous backend (``backend="etcd"``, also torch's ``etcd-v2``): etcd's v3 API.

torch's own etcd backends speak etcd's v2 API, which etcd 3.4 serves only with
``--enable-v2`` and 3.6 removed; this one speaks v3, over gRPC (every member serves it on
its client port) through a small HTTP/2 client of its own (:mod:`._h2`, :mod:`._proto`),
so it needs no extra package.

Endpoint: torch's form, ``host[:port]`` (port 2379), several members separated by commas
(``etcd-0:2379,etcd-1:2379,etcd-2:2379``); every node may name any or all of them, and a
node moves to another member when one is lost. Config keys (``--rdzv-conf``):

* ``protocol`` (``http``), ``cacert``, ``cert``, ``key``: torch's TLS keys (``https``:
  the members' certificates are checked against ``cacert``, or the system's CAs, and must
  name the host given, a name or an IP; ``cert`` and ``key``: a client certificate, for
  an etcd that requires one);
* ``etcd_prefix`` (``/aelastic``): where the keys live (``<prefix>/<run id>/...``);
* ``read_timeout`` (60): how long a call keeps retrying (from member to member) before
  ``RendezvousConnectionError``;
* ``recheck_interval`` (5): re-check period of a store wait, and of a status wait while
  the watch is down (changes wake waiters through the watch at once);
* ``share_connections`` (true): backends of one event loop share a client and watch.

With authentication enabled in etcd, the user and password come from the environment,
``AELASTIC_ETCD_USERNAME`` and ``AELASTIC_ETCD_PASSWORD`` (never from the command line).

See :mod:`._layout` for the keys, :mod:`._port` for the state machine's port (and why no
clocks of different machines are compared), :mod:`._apply` for a request's reads and
writes, :mod:`._changes` for the watch, :mod:`._client` for the members, retries and
errors, :mod:`._store` for the members' store. ``docs/production-store.md`` says what a
3-member cluster survives.
"""

from __future__ import annotations

from ...core.params import RendezvousParameters
from ._backend import EtcdBackend
from ._endpoint import (
    DEFAULT_PORT,
    DEFAULT_PREFIX,
    ENV_PASSWORD,
    ENV_USERNAME,
    EtcdEndpoint,
    parse_endpoint,
)
from ._layout import RunKeys

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "ENV_PASSWORD",
    "ENV_USERNAME",
    "EtcdBackend",
    "EtcdEndpoint",
    "RunKeys",
    "create_backend",
    "parse_endpoint",
]


def create_backend(params: RendezvousParameters) -> EtcdBackend:
    """Create the etcd backend for ``params.run_id`` at ``params.endpoint``.

    Args:
        params: Endpoint, run id and config keys (see the module documentation).

    Returns:
        A backend; it connects on first use and shares its client with the other backends
        of the same event loop and endpoint.

    Raises:
        ValueError: The endpoint or an option is malformed, or a TLS file cannot be used.
    """
    endpoint = parse_endpoint(params.endpoint, params.config)
    endpoint.ssl_context()  # TLS files that cannot be used: one line now, not at first use
    read_timeout = params.get_as_float("read_timeout", 60.0)
    recheck = params.get_as_float("recheck_interval", 5.0)
    assert read_timeout is not None and recheck is not None
    return EtcdBackend(
        params.run_id,
        endpoint,
        read_timeout=read_timeout,
        recheck_interval=recheck,
        share_connections=bool(params.get_as_bool("share_connections", True)),
    )
