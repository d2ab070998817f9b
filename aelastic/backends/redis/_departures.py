"""The Redis backend's departures: named connections, and the survivor's report.

How it works: once a node's join succeeded its process's named connection to the run
(:class:`~._presence.Presence`, one per client and run, shared by the nodes of the process)
carries it; a lost one that comes back makes the backend send the node's beat at once (the
last keep-alive it knows: the node's rules and secret). When a worker's collective broke,
:meth:`NamedConnections.report_departures` lists the clients of the run's server, reports
each member whose name is gone as a departure (the operator's word: whoever holds this
Redis' credentials may close the run anyway). A name still gone when looked for again a
moment later (:data:`_CONFIRM_AFTER`), of at most half the members, is a *confirmed*
departure: the member is lost at once unless heard from since the first look (a live node's
connection is named again at once and its beat follows it). Otherwise (more than half gone:
a server that restarted or failed over, or names coming back) the report is applied again
once the machine's grace has passed, so that a dead member is lost about a second after the
check rather than after the heartbeat window. See :mod:`._presence` for what is and is not
reported.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from ...core.errors import RendezvousConnectionError
from ...core.machine import confirmable
from ...core.state import NodeDesc, Op, Outcome, Reply, Request, Snapshot, Transition
from ._presence import Presence, absent_members, parse_client_list

__all__ = ["NamedConnections"]

log = logging.getLogger("aelastic.backends.redis")

#: Pauses (seconds) before each check of the client list of one report: a socket closed a
#: moment ago may not be read by a busy server yet (nothing waits on the later checks: the
#: agent waits for the group change anyway).
_CHECKS = (0.0, 0.25, 0.75)

#: Seconds before a name found gone is looked for again: still gone then, the departure is
#: confirmed (a survivor's collective broke, and the member's connection stays gone).
_CONFIRM_AFTER = 0.25

#: How long one survivor's check keeps the others of the run from checking too (ms): when a
#: member dies every survivor's collective breaks at once, and each ``CLIENT LIST`` is
#: O(clients): N survivors listing N clients would make a loss cost the server O(N^2).
_CLAIM_MS = "2000"


#: The named connections of each client, by run (``RunKeys.base``).
_presences: weakref.WeakKeyDictionary[Any, dict[str, Presence]] = weakref.WeakKeyDictionary()


class NamedConnections:
    """Mixin of :class:`~._backend.RedisBackend` (its ``_bind``, ``_keys``, ``_ttl_ms``,
    ``_call``, ``apply`` and ``snapshot``)."""

    _presence: Presence | None = None
    _presence_node: NodeDesc | None = None
    _beat: Request | None = None
    _list_refused = False

    if TYPE_CHECKING:  # provided by RedisBackend
        _keys: Any
        _ttl_ms: str

        async def _bind(self) -> Any: ...
        async def _call(self, what: str, attempt: Any) -> Any: ...
        async def apply(self, request: Request, hold: float = 0.0, seen: Any = None) -> Reply: ...
        async def snapshot(self) -> Snapshot | None: ...

    @property
    def _named_key(self) -> str:
        return f"{self._keys.base}:named"

    def _after_reply(self, request: Request, reply: Reply) -> None:
        """A node that joined is carried by its process's named connection; its beat is
        remembered (sent again when that connection is named again)."""
        if request.op is Op.JOIN and reply.outcome in (Outcome.FINISH, Outcome.WAIT):
            self._beat = Request(Op.KEEP_ALIVE, request.node, request.rules, secret=request.secret)
            if self._presence_node != request.node:
                self._carry(request.node)

    def _carry(self, node: NodeDesc) -> None:
        client = getattr(self, "_client", None)
        if client is None:
            return
        runs = _presences.setdefault(client, {})
        presence = runs.get(self._keys.base)
        if presence is None:
            marker = (self._named_key, self._ttl_ms)
            presence = Presence(client.server, self._keys.base, marker, self._keys.state)
            runs[self._keys.base] = presence
        old, self._presence, self._presence_node = self._presence_node, presence, node
        presence.add(node, self._beat_again)
        if old is not None and old != node:  # (the same run: the same presence)
            presence.nodes.pop(old.key, None)

    async def _beat_again(self) -> None:
        beat = self._beat
        if beat is not None:
            await self.apply(beat)

    def _drop_node(self) -> Presence | None:
        """Stop carrying this backend's node; the presence if nobody else uses it."""
        presence, node = self._presence, self._presence_node
        self._presence, self._presence_node = None, None
        if presence is None or node is None:
            return None
        presence.nodes.pop(node.key, None)
        if presence.nodes:
            return None
        client = getattr(self, "_client", None)
        runs = _presences.get(client) if client is not None else None
        if runs is not None and runs.get(self._keys.base) is presence:
            del runs[self._keys.base]
        return presence

    async def _stop_presence(self) -> None:
        if (presence := self._drop_node()) is not None:
            await presence.aclose()

    async def report_departures(self, me: NodeDesc) -> int:
        """Report the members whose named connection is gone from the run's server (see
        :mod:`._presence`) and, once the machine's grace has passed, apply the reports again.

        Returns:
            How many members these reports made lost (none when another survivor of the run
            checks at the same time: its report's loss wakes this one too).
        """
        if not await self._claim_check(me):
            return 0
        for pause in _CHECKS:
            await asyncio.sleep(pause)
            found = await self._check_names(me)
            if found is None:
                return 0
            absent, since, members = found
            if absent:
                return len(await self._confirm_or_depart(me, absent, since, members))
        return 0

    async def _confirm_or_depart(
        self, me: NodeDesc, absent: list[NodeDesc], since: int, members: int
    ) -> list[NodeDesc]:
        """Names still gone a moment later, of at most half the members, are confirmed (a
        live node's connection is named again at once, and its beat follows); the rest
        take the grace."""
        await asyncio.sleep(_CONFIRM_AFTER)
        again = await self._check_names(me)
        if again is None or not confirmable(len(absent), members):
            return await self._depart(absent, since)
        still = [n for n in absent if n in again[0]]
        return await self._depart(still, since, confirmed=True) if still else []

    async def _claim_check(self, me: NodeDesc) -> bool:
        """Whether this survivor is the one of the run to check now (``SET NX``)."""
        client, _ = await self._bind()
        key = f"{self._keys.base}:checking"

        async def claim(within: float) -> Any:
            return await client.command("SET", key, me.key, "NX", "PX", _CLAIM_MS, within=within)

        return await self._call("departure check", claim) is not None

    async def _check_names(self, me: NodeDesc) -> tuple[list[NodeDesc], int, int] | None:
        """The members whose names are gone, the moment to report, and how many members
        there are (``None``: the server cannot tell)."""
        if self._list_refused:
            return None
        client, _ = await self._bind()
        route = self._keys.state

        async def ask(within: float) -> tuple[Any, Any, Any]:
            replies = await asyncio.gather(
                client.command("TIME", within=within, route=route),
                # (every type: a node's named connection is its client's subscriber on RESP3)
                client.command("CLIENT", "LIST", within=within, route=route),
                client.command("HGETALL", self._named_key, within=within),
            )
            return replies[0], replies[1], replies[2]

        try:
            time_, listing, named = await self._call("client list", ask)
        except (ResponseError, RendezvousConnectionError) as exc:
            if "permission" not in str(exc).lower() and "NOPERM" not in str(exc):
                raise
            self._list_refused = True
            log.warning(
                "Redis refused CLIENT LIST (%s): a lost member is known by the heartbeat window "
                "only; allow 'client|list' and 'client|setname' (docs/production-store.md)",
                exc,
            )
            return None
        since = int(time_[0]) * 1000 + int(time_[1]) // 1000 - 1
        text = listing.decode(errors="replace") if isinstance(listing, bytes) else str(listing)
        flat = named if isinstance(named, list) else []
        odd, even = flat[::2], flat[1::2]
        pairs = named.items() if isinstance(named, dict) else zip(odd, even, strict=False)
        said = {_text(k): _text(v) for k, v in pairs}
        snapshot = await self.snapshot()
        if snapshot is None:
            return None
        members = [e.node for e in snapshot.members()]
        listed = parse_client_list(text)
        absent = absent_members(listed, said, members, me)
        log.info(
            "run %s: %d of %d members' connections named, %d of them gone",
            self._keys.tag,
            len(said),
            len(members),
            len(absent),
        )
        return absent, since, len(members)

    async def _depart(
        self, absent: list[NodeDesc], since: int, confirmed: bool = False
    ) -> list[NodeDesc]:
        lost: list[NodeDesc] = []
        while absent:
            replies = await asyncio.gather(
                *(self.apply(Request.departure(n, since, confirmed=confirmed)) for n in absent)
            )
            waiting, due = [], 0
            for node, reply in zip(absent, replies, strict=True):
                if reply.transition is Transition.REMOVE:
                    log.info("member %s: its named connection went and it was not heard from", node)
                    lost.append(node)
                elif reply.outcome is Outcome.WAIT and reply.wake_at_ms is not None:
                    waiting.append(node)
                    due = max(due, reply.wake_at_ms - reply.status.now_ms)
            absent = waiting
            if absent:
                await asyncio.sleep(due / 1000 + 0.005)
        return lost


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
