"""How many nodes one client may have in the runs: bounded, so no client fills them alone.

How it works: a join from a node the run does not know yet adds a node (to the
participants, the wait list or the redundancy list). Before it is applied, the join is
counted for its client (:meth:`._clients.Clients.key`): the client's table holds the
(run, node) pairs it brought. At :data:`DEFAULT_MAX_NODES_PER_CLIENT` pairs, the pairs
whose node has gone (left, pruned, its run closed or forgotten) are dropped first (at most
once a second per client: a cost of one lookup per pair); if the client is still at the
limit the join is refused with :class:`NodeQuotaError` (``429``, the reason and the flag in
the message) and changes nothing. Requests of nodes already in their run (heartbeats,
joins of the next round, leaves) are never counted or refused. Clients on this machine
(loopback) are not counted: the scale benchmark and the tests run thousands of nodes from
``127.0.0.1``; behind a proxy every client looks like the proxy unless ``--trusted-proxy``
names it. :meth:`NodeQuota.sweep` (with the runs' expiry sweep) forgets
the pairs of nodes that went.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from ....core.state import NodeDesc, Op, Request
from ..._engine import Engine
from ._clients import Clients

__all__ = ["DEFAULT_MAX_NODES_PER_CLIENT", "QUOTA", "NodeQuota", "NodeQuotaError"]

#: Nodes one client (an address, an IPv6 /64) may have in the runs at once.
DEFAULT_MAX_NODES_PER_CLIENT = 1024
#: Seconds between two recounts of one client at its limit.
_RECOUNT_EVERY = 1.0


class NodeQuotaError(RuntimeError):
    """A client has as many nodes in the runs as it may (answered ``429``)."""


class _Client:
    __slots__ = ("counted", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, NodeDesc], None] = {}
        self.counted = -_RECOUNT_EVERY


class NodeQuota:
    """Nodes per client (see the module docstring).

    Args:
        engine: The server's runs.
        limit: Nodes one client may have in the runs (``0``: no limit).
        clients: How the server names its clients.
        clock: Monotonic seconds.

    Raises:
        ValueError: ``limit`` is negative.
    """

    def __init__(
        self,
        engine: Engine,
        limit: int,
        clients: Clients,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 0:
            raise ValueError(f"max_nodes_per_client ({limit}) must be >= 0 (0: no limit)")
        self.engine = engine
        self.limit = limit
        self.clients = clients
        self._clock = clock
        self._clients: dict[str, _Client] = {}
        #: Joins refused since the start.
        self.refused = 0

    def admit(self, peer: web.Request, run_id: str, request: Request) -> None:
        """Count ``request``'s node for the client of ``peer`` if it adds one to ``run_id``.

        Args:
            peer: The HTTP request (the request itself, or the upgrade of its channel).
            run_id: The run.
            request: The rendezvous request (only joins are counted).

        Raises:
            NodeQuotaError: The client has its limit of nodes in the runs.
        """
        if not self.limit or request.op is not Op.JOIN:
            return
        node = request.node
        if self.engine.knows(run_id, node) or self.clients.is_loopback(peer):
            return  # a node of the run (its next round), or a client on this machine
        client = self.clients.key(peer)
        mine = self._clients.get(client)
        if mine is None:
            mine = self._clients[client] = _Client()
        pair = (run_id, node)
        if pair in mine.nodes:
            return
        if len(mine.nodes) >= self.limit:
            now = self._clock()
            if now - mine.counted >= _RECOUNT_EVERY:
                mine.counted = now
                self._recount(mine)
            if len(mine.nodes) >= self.limit:
                self.refused += 1
                raise NodeQuotaError(
                    f"client {client} has {len(mine.nodes)} nodes in the runs of this "
                    f"server, its limit (aelastic serve --max-nodes-per-client); a node "
                    "that leaves or is pruned frees its place"
                )
        mine.nodes[pair] = None

    def _present(self, run_id: str, node: NodeDesc) -> bool:
        engine = self.engine
        with engine.lock:
            run = engine.runs.get(run_id)
            state = None if run is None else run.state
            return state is not None and not state.closed and state.knows(node)

    def _recount(self, client: _Client) -> None:
        client.nodes = {pair: None for pair in client.nodes if self._present(*pair)}

    def sweep(self) -> None:
        """Forget the nodes that went, and the clients left with none."""
        for key, client in list(self._clients.items()):
            self._recount(client)
            if not client.nodes:
                del self._clients[key]

    def count(self, client: str) -> int:
        """Nodes counted for ``client`` (some may have gone since the last recount)."""
        mine = self._clients.get(client)
        return 0 if mine is None else len(mine.nodes)


#: The server's :class:`NodeQuota`.
QUOTA = web.AppKey("aelastic_node_quota", NodeQuota)
