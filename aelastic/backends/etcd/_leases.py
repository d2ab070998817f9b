"""A node's heartbeat on etcd (its lease), and when this process saw each last call.

How it works: every node has a lease whose time to live is the run's heartbeat window (the
stored rules', never a requester's) in whole seconds; its keys are attached to it, so etcd
deletes them when the node is silent for the window (the etcd leader's clock judges: no
clocks of different machines are compared). A lease is granted before the node's first key
is written and kept across rounds; renewing it is a keep-alive (etcd's leader keeps leases:
no Raft entry, no watch event, nobody woken).
:class:`Deadlines` keeps, per process, when each last call was first seen, so that the
process times the last call from then.
"""

from __future__ import annotations

import contextlib
import math
import time

from ...core.errors import RendezvousConnectionError
from ...core.state import NodeDesc
from ._client import EtcdClient, EtcdError

__all__ = ["Deadlines", "Leases", "lease_ttl"]


def lease_ttl(window_ms: int) -> int:
    """A lease's time to live for a heartbeat window: etcd counts whole seconds."""
    return max(1, math.ceil(window_ms / 1000))


class Deadlines:
    """When this process first saw each last call: it times them from then (ms)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], int] = {}

    def saw(self, epoch: str, deadline_id: int, at_ms: int) -> None:
        """The last call ``deadline_id`` of ``epoch`` was seen (or started) at ``at_ms``."""
        key = (epoch, deadline_id)
        if key not in self._seen:
            if len(self._seen) > 256:
                self._seen.clear()
            self._seen[key] = at_ms

    def end(self, epoch: str, deadline_id: int, last_call_ms: int, now: int) -> int:
        """When the last call ``deadline_id`` ends by this process's clock."""
        self.saw(epoch, deadline_id, now)
        return self._seen[(epoch, deadline_id)] + last_call_ms


class Leases:
    """The leases of the nodes of one backend (a node's heartbeat)."""

    def __init__(self, client: EtcdClient, ttl: int | None = None) -> None:
        self._client = client
        self._ttl = ttl
        #: node -> (lease, when last renewed (monotonic), its time to live in seconds)
        self._ids: dict[NodeDesc, tuple[int, float, int]] = {}

    def of(self, node: NodeDesc) -> int | None:
        entry = self._ids.get(node)
        return None if entry is None else entry[0]

    def forget(self, node: NodeDesc) -> None:
        self._ids.pop(node, None)

    def _ttl_for(self, window_ms: int) -> int:
        return self._ttl or lease_ttl(window_ms)

    async def grant(self, node: NodeDesc, window_ms: int) -> int:
        """A new lease for ``node`` whose time to live is the run's window ``window_ms``."""
        ttl = self._ttl_for(window_ms)
        answer = await self._client.call("/v3/lease/grant", {"TTL": ttl}, "lease grant")
        lease = int(answer.get("ID", 0))
        if not lease:
            raise RendezvousConnectionError(
                f"etcd at {self._client.display} granted no lease: {answer.get('error')}"
            )
        self._ids[node] = (lease, time.monotonic(), ttl)
        return lease

    async def ensure(self, node: NodeDesc, window_ms: int) -> int:
        """``node``'s lease for the run's window ``window_ms`` (a lease of another time to
        live, granted for a request the run refused, is replaced)."""
        entry = self._ids.get(node)
        if entry is not None and entry[2] == self._ttl_for(window_ms):
            return entry[0]
        return await self.grant(node, window_ms)

    async def renew(self, node: NodeDesc) -> bool:
        """Renew ``node``'s lease; whether it was still alive. A lease renewed less than a
        fifth of its time to live ago is not renewed again (a join's beat right after its
        grant)."""
        entry = self._ids.get(node)
        if entry is None:
            return False
        if time.monotonic() - entry[1] < entry[2] / 5:
            return True
        answer = await self._client.call("/v3/lease/keepalive", {"ID": entry[0]}, "keep-alive")
        alive = int(answer.get("result", answer).get("TTL", 0)) > 0
        if alive:
            self._ids[node] = (entry[0], time.monotonic(), entry[2])
        else:
            self.forget(node)
        return alive

    async def revoke_all(self) -> None:
        ids, self._ids = [entry[0] for entry in self._ids.values()], {}
        for lease in ids:
            with contextlib.suppress(EtcdError, RendezvousConnectionError):
                await self._client.call("/v3/lease/revoke", {"ID": lease}, "lease revoke", 2.0)
