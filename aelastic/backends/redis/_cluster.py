"""A run's keys on a Redis Cluster (the :mod:`._servers` surface on ``RedisCluster``).

How it works: :class:`Cluster` uses redis-py's ``RedisCluster``, which routes each script by
the run's hash tag (every key of a run is in one slot), follows ``MOVED``/``ASK``, and reads
the slot map again after a failover (so does :meth:`Cluster.execute` when a node failed). A
batch's ``WAIT`` goes to the primary of each slot it wrote. A classic ``PUBLISH`` reaches the
subscribers of every node of a cluster, so the listener subscribes on any node and moves to
the next one it knows when that one fails.

One piece is our own, for a measured reason: redis-py reads the server's whole command table
(``COMMAND``, some hundred kilobytes to parse) each time a client initializes, and again at
each re-initialization after a failover. With one client per rendezvous node, 256 nodes in a
few processes spent most of a 6 s formation, and most of a 12 s re-formation after a
failover, doing that (``benchmarks/redis_ha.py``). :mod:`._internals` (the one module that
touches redis-py's internals) reads it once per process and cluster: 1.0 s and 5.5-6.8 s
then.
"""

from __future__ import annotations

import contextlib
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._internals import close_every_node, share_command_table
from ._options import accepted, connection_kwargs
from ._servers import Batch, Standalone, acked

__all__ = ["Cluster", "is_retryable"]

#: Errors after which a cluster's slot map is read again.
_CLUSTER_REFRESH = (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError)


class Cluster(Standalone):
    """A Redis Cluster. See the module docstring."""

    combines = False  # commands go through redis-py's client, routed by slot

    def _command_client(self, max_connections: int) -> Any:
        options = connection_kwargs(self.endpoint)
        kwargs = {k: v for k, v in options.items() if k in _cluster_options()}
        kwargs["ssl"] = self.endpoint.tls
        self._turn = 0
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self.endpoint.hosts],
            max_connections=max_connections,
            **kwargs,
        )
        share_command_table(cluster, self.endpoint.hosts)
        return cluster

    def send_now(self, batch: Batch, done: Any) -> bool:
        return False  # routed by redis-py's client: always :meth:`execute`

    async def scan(self, pattern: str, limit: int) -> list[bytes]:
        """Keys matching ``pattern`` on every primary (redis-py's ``scan_iter``)."""
        found: list[bytes] = []
        await self.redis.initialize()
        keys = self.redis.scan_iter(match=pattern, count=1000)
        async with contextlib.aclosing(keys):
            async for key in keys:
                found.append(key if isinstance(key, bytes) else str(key).encode())
                if len(found) >= limit:
                    break
        return found

    async def execute(self, batch: Batch, wait: tuple[int, int] | None) -> tuple[list[Any], int]:
        cluster = self.redis
        try:
            await cluster.initialize()
            pipe = cluster.pipeline()
            for args, route in zip(batch.commands, batch.routes, strict=True):
                if route is None:
                    pipe.execute_command(*args)
                else:
                    pipe.execute_command(*args, target_nodes=cluster.get_node_from_key(route))
            nodes = {}
            if wait is not None:
                for key in batch.durable:
                    node = cluster.get_node_from_key(key)
                    nodes[node.name] = node
                for node in nodes.values():
                    pipe.execute_command("WAIT", *wait, target_nodes=node)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        except _CLUSTER_REFRESH:
            await cluster.aclose()  # the next call reads the slot map again
            raise
        if any(isinstance(reply, _CLUSTER_REFRESH) for reply in replies):
            await cluster.aclose()
        count = len(batch.commands)
        if not nodes:
            return replies, -1
        return replies[:count], min(acked(reply) for reply in replies[count:])

    async def pubsub_address(self) -> tuple[str, int]:
        """The next node of the cluster (the nodes given when none is known)."""
        addresses: list[tuple[str, int]] = []
        try:
            await self.redis.initialize()
            addresses = [(str(n.host), int(n.port)) for n in self.redis.get_nodes()]
        except (RedisError, RedisClusterException, OSError):
            pass
        addresses = sorted(addresses) or list(self.endpoint.hosts)
        self._turn += 1
        return addresses[self._turn % len(addresses)]

    async def combined(self) -> None:
        """None: a Cluster's commands go through redis-py's client (a node's name needs a
        connection of its own to the primary of the run's slot)."""
        return None

    async def presence_address(self, route: str) -> tuple[str, int]:
        """The primary of ``route``'s slot."""
        await self.redis.initialize()
        node = self.redis.get_node_from_key(route)
        return str(node.host), int(node.port)

    def address_now(self, route: str) -> tuple[str, int] | None:
        try:
            node = self.redis.get_node_from_key(route)
        except (RedisError, RedisClusterException, AttributeError, IndexError, KeyError):
            return None  # no slot map at hand: not a reason to move
        return None if node is None else (str(node.host), int(node.port))

    async def explain(self, exc: BaseException) -> str | None:
        if isinstance(exc, RedisClusterException) and not _unreachable(exc):
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"Redis Cluster at {self.endpoint.display} cannot be used: {said}"
        return await super().explain(exc)

    def describe(self, exc: BaseException) -> str:
        if isinstance(exc, RedisClusterException) and _unreachable(exc):
            return f"none of the nodes {self.endpoint.addresses} answered"
        if isinstance(exc, ClusterDownError):
            return f"the cluster is down ({exc})"
        if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
            return (
                "the node serving the run's slot does not answer and no replica took its "
                f"place: the cluster is down for this run ({exc or type(exc).__name__})"
            )
        return super().describe(exc)

    async def aclose(self) -> None:
        await self.redis.aclose()
        await close_every_node(self.redis)


def is_retryable(exc: BaseException) -> bool:
    """Cluster errors that a moment later may be gone (no node reachable, slots moving)."""
    return isinstance(exc, SlotNotCoveredError) or (
        isinstance(exc, RedisClusterException) and _unreachable(exc)
    )


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, SlotNotCoveredError) or "cannot be connected" in str(exc)


def _cluster_options() -> set[str]:
    return accepted(RedisCluster) - {"host", "port", "startup_nodes", "db", "self"}
