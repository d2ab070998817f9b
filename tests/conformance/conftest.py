"""The backends every conformance test runs on: memory, a real redis-server, a real HTTP server,
a real etcd, and torch's ``c10d`` hosted by an agent.

Servers are started once per session on free loopback ports; each test uses its own run id,
so tests never see each other's state. Redis runs three ways: a standalone server, a primary
found through Sentinel (``redis+sentinel``: a primary, a replica, three sentinels) and a
Redis Cluster (``redis+cluster``: three primaries with a replica each); etcd runs as one
member and as a 3-member cluster (``etcd+cluster``, every node naming every member).
``c10d`` is hosted as an agent hosts it (``is_host=true``: the HTTP server inside that
process's event loop, here a loop of its own in a thread of the test process, for the
session); the tests' nodes are guests (``is_host=false``), so closing them freely never
stops the host.

``static`` is not in the suite: a node's rank there is its ``--node-rank``, not its place in
the round, so the suite's scenarios (ranks by join order, latecomers, elastic sizes) do not
apply; its rank rules and hosting are tested with real nodes by ``tests/cli/test_kubeflow.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aelastic import RendezvousParameters
from aelastic.backends import BUILTINS, backend_info

#: Every built-in backend (the registry's rows) but ``static`` (see the module docstring).
BACKENDS = [info.name for info in BUILTINS if info.name != "static"]
#: Ways to deploy a backend's server that the suite runs on too, beside the plain one.
DEPLOYMENTS = {"redis": ["redis+sentinel", "redis+cluster"], "etcd": ["etcd+cluster"]}

MakeParams = Callable[..., RendezvousParameters]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    from tests._redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_sentinel_url() -> Iterator[str]:
    from tests._redis_ha import SentinelGroup

    with SentinelGroup() as group:
        yield group.endpoint


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    from tests._redis_ha import RedisCluster

    with RedisCluster() as cluster:
        yield cluster.endpoint


@pytest.fixture(scope="session")
def etcd_url() -> Iterator[str]:
    from tests._etcd_server import EtcdServer

    with EtcdServer() as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def etcd_cluster_url() -> Iterator[str]:
    from tests._etcd_server import EtcdCluster

    with EtcdCluster(3) as cluster:
        yield cluster.endpoint


@pytest.fixture(scope="session")
def http_url() -> Iterator[str]:
    from tests._http_server import HttpServer

    with HttpServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def c10d_url() -> Iterator[str]:
    from tests._hosted import HostingAgent

    with HostingAgent("c10d") as host:
        yield host.endpoint


@pytest.fixture(params=[d for name in BACKENDS for d in [name, *DEPLOYMENTS.get(name, [])]])
def deployment(request: pytest.FixtureRequest) -> str:
    """A backend name, or ``name+kind`` for another way to run its server."""
    name: str = request.param
    return name


@pytest.fixture
def backend(deployment: str) -> str:
    return deployment.partition("+")[0]


@pytest.fixture
def endpoint(backend: str, deployment: str, request: pytest.FixtureRequest) -> str:
    info = backend_info(backend)
    if info is not None and not info.multi_node:
        return "conformance"
    url: str = request.getfixturevalue(f"{deployment.replace('+', '_')}_url")
    return url


@pytest.fixture
def make_params(backend: str, endpoint: str, run_id: str) -> MakeParams:
    """Parameters for this test's run on the backend under test (small timeouts)."""

    def make(min_nodes: int, max_nodes: int, **config: Any) -> RendezvousParameters:
        conf: dict[str, Any] = {"join_timeout": 20, "last_call_timeout": 0.2, "read_timeout": 10}
        if backend == "c10d":
            conf["is_host"] = "false"  # the session's host serves; the test's nodes are guests
        conf.update(config)
        return RendezvousParameters(
            backend, endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", **conf
        )

    return make
