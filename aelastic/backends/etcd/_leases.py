"""A node's heartbeat on etcd (its lease), and when this process saw each last call.

How it works: every node has a lease whose time to live is the run's heartbeat window (the
stored rules', never a requester's) in whole seconds, plus :data:`SLACK`; its keys are
attached to it, so etcd deletes them when the node is silent that long (the etcd leader's
clock judges: no clocks of different machines are compared). A node's first lease is
granted right before its first join (:meth:`Leases.grant_request`, with an id the node
picks; a renewal follows the join, so the lease's time to live counts from the join, as the
machine's window counts from a node's join) and kept across rounds; renewing it is a
keep-alive (etcd's leader keeps leases: no Raft entry, no watch event, nobody woken), one
message on the client's keep-alive stream (:mod:`._renewals`).
A join that waits renews the lease only when a fifth of its time to live passed (not right
after the write that granted it); the join that completes a node's round always renews it
(while it reads its rank), and so does every heartbeat.

A live node never loses its lease to its own lateness, nor to etcd's:

* a beat or a wait sends its renewal and is answered at once (:meth:`Leases.renew_soon`;
  the renewal's answer is recorded when it comes, and a lease found gone makes the node's
  next request say so): the renewals go once a beat, whatever etcd takes over each. Before,
  a node sent its next renewal an interval after the answer to the last one, so a busy
  etcd that took 2 s over each answer stretched a 1 s beat to 3 s, a whole window;
* while a request of the node's runs (a join, a read, a write, which a busy etcd takes
  seconds over), its lease is renewed a third of its time to live after the last renewal
  (:meth:`Leases.kept`); so too between a first join's grant and its write. Before, the
  leases of hundreds of nodes of a 1,024-node job ran out between their grant and their
  join's answer, while etcd, starved of CPU by two other processes, carried the joins out;
* etcd (3.4.23 and later) holds a renewal on its leader until its apply loop has caught up
  with the writes committed before it, up to a second: :data:`SLACK`.

:class:`Deadlines` keeps, per process, when each last call was first seen, so that the
process times the last call from then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ...core.errors import RendezvousConnectionError
from ...core.race import cancel_and_wait
from ...core.state import NodeDesc
from ._client import EtcdClient, EtcdError, LeaseNotFound

__all__ = ["Deadlines", "Leases", "lease_ttl"]

log = logging.getLogger(__name__)

#: Seconds a lease lives beyond the heartbeat window: etcd (3.4.23 and later) holds a
#: renewal on its leader until its apply loop has caught up with every write committed
#: before it, for up to a second (its ``applyTimeout``, then it refuses the renewal), so a
#: renewal sent on time may count that much later; a node's lease is not lost to etcd's
#: own delay.
SLACK = 1
#: Renewals of one lease sent and not answered yet, at most (etcd carries the messages of a
#: stream out one after the other: a second waits there while the first waits for etcd).
OUTSTANDING = 2


def lease_ttl(window_ms: int) -> int:
    """A lease's time to live for a heartbeat window: etcd counts whole seconds, and a
    renewal may count up to :data:`SLACK` late."""
    return max(1, math.ceil(window_ms / 1000)) + SLACK


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
        #: node -> (when its last renewal was sent in the background, how many are out)
        self._sent: dict[NodeDesc, tuple[float, int]] = {}
        self._background: set[asyncio.Task[None]] = set()

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

    def grant_request(self, node: NodeDesc, window_ms: int) -> tuple[str, dict[str, Any]]:
        """A request granting ``node`` a new lease of an id picked here (63 random bits):
        sent right before a write that uses it (see the module docstring);
        :meth:`granted` records it once etcd answered."""
        lease = random.randrange(1, 2**63)
        self._client.open_keep_alive()  # ready for the lease's renewals (see ._renewals)
        return "/v3/lease/grant", {"TTL": self._ttl_for(window_ms), "ID": str(lease)}

    def granted(self, node: NodeDesc, request: dict[str, Any], answer: Any) -> bool:
        """Record the lease of ``request`` (a :meth:`grant_request`) if etcd's ``answer``
        granted it; whether it did."""
        lease = int(request["ID"])
        if not isinstance(answer, dict) or int(answer.get("ID", 0)) != lease:
            return False
        self._ids[node] = (lease, time.monotonic(), request["TTL"])
        return True

    def adopt(self, node: NodeDesc, lease: int, window_ms: int) -> None:
        """``node``'s keys live on ``lease`` (read from etcd: it is alive): renew that one
        from now on (a write sent again after its answer was lost may have granted another
        lease than the one its first sending attached)."""
        entry = self._ids.get(node)
        if entry is None or entry[0] != lease:
            self._ids[node] = (lease, 0.0, self._ttl_for(window_ms))

    def renew_request(
        self, node: NodeDesc, at_once: bool = False
    ) -> tuple[str, dict[str, Any]] | None:
        """The keep-alive of ``node``'s lease, or ``None`` when there is no lease or it was
        renewed less than a fifth of its time to live ago (see :meth:`renew`; ``at_once``:
        renewed whenever it was last)."""
        entry = self._ids.get(node)
        if entry is None or (not at_once and time.monotonic() - entry[1] < entry[2] / 5):
            return None
        return "/v3/lease/keepalive", {"ID": entry[0]}

    def renewed(self, node: NodeDesc, answer: Any) -> bool:
        """Record etcd's ``answer`` to :meth:`renew_request`; whether the lease lives."""
        entry = self._ids.get(node)
        if isinstance(answer, LeaseNotFound):
            self.forget(node)
        if entry is None or not isinstance(answer, dict):
            if entry is not None:
                log.warning("etcd did not renew node %s's lease %x: %s", node, entry[0], answer)
            return False
        alive = int(answer.get("TTL", 0)) > 0
        if alive:
            self._ids[node] = (entry[0], time.monotonic(), entry[2])
        else:
            since = time.monotonic() - entry[1]
            log.warning(
                "etcd says node %s's lease %x is gone (renewed %.1f s ago, time to live %d s): %s",
                node, entry[0], since, entry[2], answer,
            )  # fmt: skip
            self.forget(node)
        return alive

    async def ensure(self, node: NodeDesc, window_ms: int) -> int:
        """``node``'s lease for the run's window ``window_ms`` (a lease of another time to
        live, granted for a request the run refused, is replaced)."""
        entry = self._ids.get(node)
        if entry is not None and entry[2] == self._ttl_for(window_ms):
            return entry[0]
        return await self.grant(node, window_ms)

    async def renew(
        self, node: NodeDesc, at_once: bool = False, within: float | None = None
    ) -> bool:
        """Renew ``node``'s lease; whether it was still alive. A lease renewed less than a
        fifth of its time to live ago is not renewed again (a join's beat right after its
        grant), unless ``at_once``: a heartbeat, or the beat of a join that completes (see
        the module docstring)."""
        if node not in self._ids:
            return False
        request = self.renew_request(node, at_once)
        if request is None:
            return True
        return self.renewed(node, await self._client.keep_alive(request[1]["ID"], within))

    def renew_soon(self, node: NodeDesc, at_once: bool = False) -> bool:
        """Send a renewal of ``node``'s lease without waiting for etcd's answer (recorded
        when it comes), unless it was renewed or sent less than a fifth of its time to live
        ago (``at_once``: whenever) or :data:`OUTSTANDING` are out already; whether the
        lease lives as far as this process knows (a renewal's answer that it is gone makes
        the next call say so). A node's requests are answered in their own time, not in the
        time etcd takes over a renewal (see the module docstring)."""
        entry = self._ids.get(node)
        if entry is None:
            return False
        now = time.monotonic()
        sent, out = self._sent.get(node, (0.0, 0))
        if out < OUTSTANDING and (at_once or now - max(entry[1], sent) >= entry[2] / 5):
            self._sent[node] = (now, out + 1)
            task = asyncio.ensure_future(self._renew_in_background(node, entry[2]))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return True

    async def _renew_in_background(self, node: NodeDesc, ttl: int) -> None:
        try:
            # An answer later than the lease's time to live would come too late anyway.
            await self.renew(node, at_once=True, within=ttl)
        except (EtcdError, RendezvousConnectionError) as exc:
            log.warning("etcd did not renew node %s's lease: %s", node, exc)
        finally:
            sent, out = self._sent.get(node, (0.0, 1))
            self._sent[node] = (sent, max(out - 1, 0))

    async def settled(self) -> None:
        """Until the renewals sent in the background have been answered (or failed)."""
        while self._background:
            await asyncio.wait(set(self._background))

    def close(self) -> None:
        """Stop the renewals still out (the backend is closed)."""
        for task in list(self._background):
            task.cancel()

    @asynccontextmanager
    async def kept(self, node: NodeDesc) -> AsyncIterator[None]:
        """While the block runs (a request of ``node``'s, which a busy etcd may take seconds
        over), renew its lease once a third of its time to live passed since it was last
        renewed, in the background: a node that waits for its own request never loses its
        lease to that wait (see the module docstring). A renewal that fails ends it."""
        keeper = asyncio.ensure_future(self._keep(node))
        try:
            yield
        finally:
            await cancel_and_wait(keeper)

    async def _keep(self, node: NodeDesc) -> None:
        while True:
            entry = self._ids.get(node)
            if entry is None:
                return
            due = entry[1] + entry[2] / 3 - time.monotonic()
            if due > 0:
                await asyncio.sleep(due)
                continue
            try:
                if not await self.renew(node, at_once=True):
                    return
            except (EtcdError, RendezvousConnectionError):
                return  # the request itself meets it

    async def revoke_all(self) -> None:
        ids, self._ids = [entry[0] for entry in self._ids.values()], {}
        for lease in ids:
            with contextlib.suppress(EtcdError, RendezvousConnectionError):
                await self._client.call("/v3/lease/revoke", {"ID": lease}, "lease revoke", 2.0)
