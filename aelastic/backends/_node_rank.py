"""Static node ranks: one node per ``--node-rank``, and every duplicate told so.

How it works: in torch's ``static`` rendezvous a node's rank is its node rank, so two nodes
given the same one cannot both take part. :class:`NodeRanks` checks each join's answer:

* a join that finished takes the rank in its round (``static/node-rank/<round>/<rank>``,
  compare-and-set); a second node that finished with the same rank fails naming both, and
  marks the rank (``static/duplicate/<rank>``);
* a join to a rank that is marked fails: the first holder learns it at its next join, which
  comes soon (the node that failed never beats, so the round loses a member);
* a node that waits while the running round holds its rank for another node that stays
  there (a heartbeat window and a half: a dead holder would have been dropped) is a surplus
  duplicate: it fails;
* a static node released by a closed run (torch's graceful exit) ran nothing: it fails,
  naming its rank, instead of exiting as if it had succeeded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from ..core.errors import RendezvousError
from ..core.state import Outcome, Reply, Request, Snapshot

__all__ = ["NodeRanks"]


class _Store(Protocol):
    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    async def kv_set(self, key: str, value: bytes) -> None: ...

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes: ...

    async def snapshot(self) -> Snapshot | None: ...


class NodeRanks:
    """The node rank of one static node, checked at each of its joins.

    Args:
        store: The run's backend (its key-value store and snapshot).
        rank: This node's node rank.
    """

    def __init__(self, store: _Store, rank: int) -> None:
        self._store = store
        self._rank = rank
        self._surplus_since: float | None = None

    def _taken(self, holder: str, node: str) -> RendezvousError:
        return RendezvousError(
            f"two nodes were started with node rank {self._rank} ({holder} and {node}): "
            "give each node its own --node-rank"
        )

    async def check(self, request: Request, reply: Reply) -> None:
        """Check a join's ``reply``.

        Raises:
            RendezvousError: Another node has this node rank, or the run closed before this
                node took part.
        """
        node = request.node.key
        [marked] = await self._store.kv_get([f"static/duplicate/{self._rank}"])
        if marked is not None:
            holder, _, other = marked.decode(errors="replace").partition(" ")
            raise self._taken(holder, other if holder == node else node)
        if reply.outcome is Outcome.FINISH:
            await self._claim(reply.status.round, node)
        elif reply.outcome is Outcome.GRACEFUL_EXIT:
            raise RendezvousError(
                f"the job ended without this node: node rank {self._rank} was another "
                "node's (give each node its own --node-rank); this node ran nothing"
            )
        elif reply.outcome is Outcome.WAIT and reply.status.complete:
            await self._waiting(reply.status.round, node, request.rules.window_ms / 1000)
        else:
            self._surplus_since = None

    async def _claim(self, round_: int, node: str) -> None:
        mine = node.encode()
        held = await self._store.kv_compare_set(self._key(round_), None, mine)
        if held != mine:
            holder = held.decode(errors="replace")
            await self._store.kv_set(f"static/duplicate/{self._rank}", f"{holder} {node}".encode())
            raise self._taken(holder, node)

    async def _waiting(self, round_: int, node: str, window: float) -> None:
        [held] = await self._store.kv_get([self._key(round_)])
        holder = None if held is None else held.decode(errors="replace")
        if holder is None or holder == node:
            self._surplus_since = None
            return
        now = asyncio.get_running_loop().time()
        if self._surplus_since is None:
            self._surplus_since = now
        if now - self._surplus_since < 1.5 * window:
            return
        snapshot = await self._store.snapshot()
        if snapshot is not None and any(e.node.key == holder for e in snapshot.participants):
            raise self._taken(holder, node)

    def _key(self, round_: int) -> str:
        return f"static/node-rank/{round_}/{self._rank}"
