"""Real servers for the benchmarks: redis-server, aelastic's HTTP server, etcd, on loopback.

The same helpers the tests use (``tests/_redis_server.py``, ``tests/_http_server.py``,
``tests/_etcd_server.py``): each starts a real server on a free loopback port and stops it
afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic.backends import BUILTINS

__all__ = ["SERVER_BACKENDS", "server_endpoint"]

#: The built-in backends nodes on several machines can share (the registry's rows).
SERVER_BACKENDS = tuple(info.name for info in BUILTINS if info.multi_node)


@contextmanager
def server_endpoint(backend: str) -> Iterator[str]:
    """Start the server ``backend`` needs; yield the endpoint to give the handlers."""
    if backend == "redis":
        from tests._redis_server import RedisServer

        with RedisServer() as redis:
            yield redis.url
    elif backend == "http":
        from tests._http_server import HttpServer

        with HttpServer() as http:
            yield http.url
    elif backend == "etcd":
        from tests._etcd_server import EtcdServer

        with EtcdServer() as etcd:
            yield etcd.endpoint
    else:
        raise ValueError(f"no server for backend {backend!r}")
