"""Reading a run on etcd: one node's view of it, the lost members' names, a snapshot.

How it works: :meth:`RunReads.read` is one read transaction of constant size (the header,
the node's possible keys, count-only ranges of the lists, the first participant, the cut,
and the node's seat at the cut when the process knows it: its rank and the profile marks),
turned into a :class:`~._port.View`. The other reads are rarer: the newest participants
when more joined a forming round than it admits, the history of the participants'
deletions (the names of members etcd dropped), the job's health (:meth:`health_read`: for
the requests that may change it, and :meth:`health`), and the whole membership for
operators.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ...core.errors import RendezvousStateError
from ...core.health import JobHealth
from ...core.state import MemberEntry, NodeDesc, Snapshot, Status
from ._client import Compacted, EtcdClient, EtcdError, b64
from ._control import HealthRead, Seat
from ._layout import RunKeys, decode_header, node_of, prefix_end
from ._leases import Deadlines, Leases
from ._losses import lost_names
from ._plan import LISTS, Member, View
from ._port import status_of
from ._ranges import count_ops, members_of, port_of, range_of, range_op, seat_of, seat_ops

__all__ = ["SHOWN_BEATS", "RunReads"]

#: The ranges of a node's read before its seat (see :meth:`RunReads._view_ops`).
_VIEW_RANGES = 13

#: A snapshot of at most this many nodes shows when each last renewed its lease.
SHOWN_BEATS = 64


_Call = tuple[str, dict[str, Any]]  # one request: its API path and its body


class RunReads:
    """The reads of one run (the base of :class:`~._apply.RunPort`).

    Args:
        client: The etcd client.
        keys: The run's keys.
        leases: The nodes' leases.
        deadlines: This process's record of the last calls.
        cut_hint: The cut of the current round as this process heard it (from the watch),
            so that a finished join reads its rank in the same read.
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        leases: Leases,
        deadlines: Deadlines,
        cut_hint: Callable[[], int | None] | None = None,
    ) -> None:
        self._client = client
        self._keys = keys
        self._leases = leases
        self._deadlines = deadlines
        self._cut_hint = cut_hint
        self._where_of: dict[NodeDesc, str | None] = {}
        #: The revision each node's last request read or wrote the run at.
        self.revision_of: dict[NodeDesc, int] = {}
        #: The last call each node's own request started, (epoch, its id): that node
        #: completes the round when it ends (:mod:`._waits`).
        self.last_calls: dict[NodeDesc, tuple[str, int]] = {}
        self.where = f"The rendezvous state of run '{keys.run_id}' at {client.display}"

    @property
    def client(self) -> EtcdClient:
        return self._client

    @property
    def leases(self) -> Leases:
        return self._leases

    @property
    def deadlines(self) -> Deadlines:
        return self._deadlines

    def where_of(self, node: NodeDesc) -> str | None:
        """The list ``node`` was in after its last request (``p``, ``w``, ``r``)."""
        return self._where_of.get(node)

    async def status(self, now: int, missing_ok: bool = False) -> Status | None:
        """The run's status (header and counts; an empty status, or ``None`` with
        ``missing_ok``, when it has no state)."""
        k = self._keys
        body = {"success": [range_op(k.header), *count_ops(k)]}
        try:
            answer = await self._client.call("/v3/kv/txn", body, "status")
            ranges = [range_of(r) for r in answer.get("responses", [])]
            headers = members_of(ranges[0].get("kvs", []))
            if not headers:
                return None if missing_ok else Status(now_ms=now)
            h = decode_header(headers[0].value, self.where)
        except RendezvousStateError:
            if missing_ok:
                return None
            raise
        np, nw, nr, nq, nd = (int(r.get("count", 0)) for r in ranges[1:6])
        deadline = None
        if h.deadline is not None and h.rules is not None:
            deadline = self._deadlines.end(h.epoch, h.deadline[0], h.rules.last_call_ms, now)
        return status_of(h, np, nw, nr, nq, nd, now, deadline)

    # -- reading --------------------------------------------------------------------------

    def _view_ops(self, node: NodeDesc, seat_at: int | None = None) -> list[dict[str, Any]]:
        k = self._keys
        ops = [
            range_op(k.header),
            *(range_op(k.member(w, node)) for w in (*LISTS, "pd")),
            *count_ops(k),
            range_op(k.participants, prefix_end(k.participants), limit=1),
            range_op(k.cut, keys_only=True),
            range_op(k.left, prefix_end(k.left), count_only=True),
        ]
        if seat_at:
            ops.extend(seat_ops(k, node, seat_at))
        return ops

    def _view(self, responses: list[dict[str, Any]], revision: int) -> tuple[View, Seat | None]:
        ranges = [range_of(r) for r in responses]
        headers = members_of(ranges[0].get("kvs", []))
        header = decode_header(headers[0].value, self.where) if headers else None
        own: dict[str, Member | None] = {}
        for i, where in enumerate((*LISTS, "pd"), start=1):
            found = members_of(ranges[i].get("kvs", []))
            own[where] = found[0] if found else None
        counts = [int(ranges[i].get("count", 0)) for i in range(5, 10)]
        first = None
        firsts = members_of(ranges[10].get("kvs", []))
        if firsts:
            first = (self._node_of(firsts[0].key, "p/"), port_of(firsts[0].value))
        cuts = members_of(ranges[11].get("kvs", []))
        left = int(ranges[12].get("count", 0))
        seat = None
        if len(ranges) > _VIEW_RANGES + 1:
            seat = seat_of(self._keys, ranges[_VIEW_RANGES], ranges[_VIEW_RANGES + 1])
        view = View(
            revision=revision,
            header=header,
            header_mod=headers[0].mod if headers else 0,
            header_create=headers[0].create if headers else 0,
            own=own,
            participants=counts[0],
            waiting=counts[1],
            redundant=counts[2],
            finished=counts[3],
            done=counts[4],
            left=left,
            first=first,
            cut=cuts[0].mod if cuts else 0,
        )
        return view, seat

    def _node_of(self, key: str, where: str) -> NodeDesc:
        try:
            return node_of(key[len(self._keys.base) + len(where) :])
        except ValueError:
            raise RendezvousStateError(
                f"{self.where}: the key {key!r} is not a node's key aelastic wrote; it was "
                "left as it is."
            ) from None

    async def read(self, node: NodeDesc, seat_at: int | None = None) -> tuple[View, Seat | None]:
        """One read of the run as ``node`` sees it (and its seat at revision ``seat_at``)."""
        body = {"success": self._view_ops(node, seat_at)}
        try:
            answer = await self._client.call("/v3/kv/txn", body, "read")
        except Compacted:
            answer = await self._client.call(
                "/v3/kv/txn", {"success": self._view_ops(node)}, "read"
            )
        revision = int(answer.get("header", {}).get("revision", 0))
        return self._view(answer.get("responses", []), revision)

    async def _with_extras(self, view: View, node: NodeDesc, count: int) -> View:
        """``view`` with the ``count`` newest participants (the completion sends them back)."""
        k = self._keys
        body = {
            "success": [
                *self._view_ops(node),
                range_op(
                    k.participants,
                    prefix_end(k.participants),
                    sort_target="CREATE",
                    sort_order="DESCEND",
                    limit=count,
                    keys_only=True,
                ),
                range_op(k.participants, prefix_end(k.participants), limit=count + 1),
            ]
        }
        answer = await self._client.call("/v3/kv/txn", body, "read")
        responses = answer.get("responses", [])
        revision = int(answer.get("header", {}).get("revision", 0))
        fresh, _ = self._view(responses[:_VIEW_RANGES], revision)
        extras = tuple(members_of(range_of(responses[_VIEW_RANGES]).get("kvs", [])))
        drop = {m.key for m in extras}
        first = None
        for member in members_of(range_of(responses[_VIEW_RANGES + 1]).get("kvs", [])):
            if member.key not in drop:
                first = (self._node_of(member.key, "p/"), port_of(member.value))
                break
        return View(**{**fresh.__dict__, "extras": extras, "first": first})

    async def lost_names(self, view: View, count: int) -> list[str]:
        """Up to ``count`` members etcd removed from the complete round since the header's
        last write, in order (:func:`._losses.lost_names`)."""
        return await lost_names(
            self._client, self._keys, view, count, lambda key: self._node_of(key, "p/").key
        )

    async def health_read(self) -> HealthRead:
        """The health key as it is now (:class:`~._control.HealthRead`).

        Raises:
            RendezvousStateError: It holds a document aelastic did not write.
        """
        k = self._keys
        body = {"success": [
            range_op(k.health), range_op(k.failures, prefix_end(k.failures), count_only=True),
        ]}  # fmt: skip
        answer = await self._client.call("/v3/kv/txn", body, "health")
        return self._health_of([range_of(r) for r in answer.get("responses", [])])

    def _health_of(self, ranges: list[dict[str, Any]]) -> HealthRead:
        found = members_of(ranges[0].get("kvs", []))
        if not found:
            return HealthRead(JobHealth(), 0, int(ranges[1].get("count", 0)))
        try:
            stored = JobHealth.decode(found[0].value)
        except ValueError as exc:
            raise RendezvousStateError(
                f"{self.where}: the job's health is not a document of this aelastic ({exc}); "
                "it was left as it is."
            ) from None
        return HealthRead(stored, found[0].mod, int(ranges[1].get("count", 0)))

    async def health(self) -> JobHealth | None:
        """The job's health, or ``None`` when the run has no state."""
        k = self._keys
        body = {"success": [
            range_op(k.header, keys_only=True), range_op(k.health),
            range_op(k.failures, prefix_end(k.failures), count_only=True),
        ]}  # fmt: skip
        answer = await self._client.call("/v3/kv/txn", body, "health")
        ranges = [range_of(r) for r in answer.get("responses", [])]
        if not ranges[0].get("kvs"):
            return None
        return self._health_of(ranges[1:]).health

    async def snapshot(self, now: int) -> Snapshot | None:
        """The whole membership (O(N): for operators), or ``None`` without a state."""
        k = self._keys
        every = [
            range_op(p, prefix_end(p), keys_only=p != k.participants)
            for p in (k.participants, k.waiting, k.redundant)
        ]
        marked = count_ops(k)[3:]  # done or finished, done
        body = {"success": [range_op(k.header), *every, *marked, range_op(k.cut, keys_only=True)]}
        answer = await self._client.call("/v3/kv/txn", body, "snapshot")
        ranges = [range_of(r) for r in answer.get("responses", [])]
        headers = members_of(ranges[0].get("kvs", []))
        if not headers:
            return None
        h = decode_header(headers[0].value, self.where)
        lists = [members_of(ranges[i].get("kvs", [])) for i in (1, 2, 3)]
        finished, done = int(ranges[4].get("count", 0)), int(ranges[5].get("count", 0))
        cuts = members_of(ranges[6].get("kvs", []))
        ranks: dict[str, int] = {}
        if h.complete and cuts:
            at = {"revision": cuts[0].mod}
            cut_body = {"success": [range_op(k.participants, prefix_end(k.participants),
                                             keys_only=True, **at)]}  # fmt: skip
            try:
                cut = await self._client.call("/v3/kv/txn", cut_body, "snapshot")
                members = members_of(range_of(cut.get("responses", [{}])[0]).get("kvs", []))
                ranks = {m.key: i for i, m in enumerate(members)}
            except Compacted:
                ranks = {m.key: i for i, m in enumerate(lists[0])}
        participants = lists[0]
        if not h.complete:
            participants = sorted(participants, key=lambda m: m.create)
        deadline = None
        if h.deadline is not None and h.rules is not None:
            deadline = self._deadlines.end(h.epoch, h.deadline[0], h.rules.last_call_ms, now)
        status = status_of(
            h, len(lists[0]), len(lists[1]), len(lists[2]), finished, done, now, deadline
        )

        beats = await self._beats([m.lease for group in lists for m in group], now)

        def entry(member: Member, where: str, rank: int | None = None) -> MemberEntry:
            return MemberEntry(self._node_of(member.key, where), beats.get(member.lease, now), rank)

        return Snapshot(
            status=status,
            participants=tuple(
                entry(m, "p/", ranks.get(m.key) if h.complete else None) for m in participants
            ),
            wait_list=tuple(entry(m, "w/") for m in lists[1]),
            redundancy_list=tuple(entry(m, "r/") for m in lists[2]),
            master_addr=None if h.master is None else h.master[0],
            master_port=None if h.master is None else h.master[1],
            rules=h.rules,
        )

    async def _beats(self, leases: list[int], now: int) -> dict[int, int]:
        """When each lease was last renewed, by this process's clock (etcd says how long
        each has left, in whole seconds): for a run of at most :data:`SHOWN_BEATS` nodes;
        a larger one's members show as just renewed (etcd drops them when they are not)."""
        unique = sorted({lease for lease in leases if lease})
        if not unique or len(unique) > SHOWN_BEATS:
            return {}

        async def beat(lease: int) -> tuple[int, int]:
            answer = await self._client.call("/v3/lease/timetolive", {"ID": lease}, "snapshot")
            granted, left = int(answer.get("grantedTTL", 0)), int(answer.get("TTL", 0))
            return lease, now - max(granted - left - 1, 0) * 1000

        return dict(await asyncio.gather(*(beat(lease) for lease in unique)))

    # -- writing --------------------------------------------------------------------------

    async def read_applied(
        self, path: str, body: Callable[[bool], Any], what: str, ahead: _Call | None = None
    ) -> tuple[dict[str, Any], dict[str, Any] | EtcdError | None]:
        """A read at a revision this client saw written (``body(serializable)``):
        serializable, no wait for etcd's apply loop, since the member that answered applied
        it; linearizable at a member that has not yet (a failover between the two); ``ahead``
        sent with it (at once). Its answer and ``ahead``'s; raises etcd's refusal of it."""
        first = [] if ahead is None else [ahead]
        answers = await self._client.call_many(
            lambda: [*first, (path, body(True))], what, ordered=False
        )
        answer = answers[-1]
        if isinstance(answer, EtcdError):
            if isinstance(answer, Compacted) or "future revision" not in str(answer):
                raise answer
            answer = await self._client.call(path, body(False), what)
        return answer, answers[0] if ahead is not None else None

    async def participants_at(self, revision: int) -> int:
        """How many participants the run had at ``revision``: for a join written at it, the
        count that join made. Read beside etcd's apply loop, not in it (see
        :meth:`._apply.RunPort.first_join`; :meth:`read_applied`)."""
        return await self.count_at(self._keys.participants, revision)

    async def count_at(self, prefix: str, revision: int) -> int:
        """How many keys under ``prefix`` the run had at ``revision`` (one this client
        wrote), read beside etcd's apply loop (:meth:`read_applied`)."""
        body: dict[str, Any] = {
            "key": b64(prefix), "range_end": b64(prefix_end(prefix)), "count_only": True,
        }  # fmt: skip
        try:
            answer, _ = await self.read_applied(
                "/v3/kv/range", lambda s: {**body, "revision": revision, "serializable": s}, "count"
            )
        except Compacted:  # compacted since the write (a second ago): count it now
            answer = await self._client.call("/v3/kv/range", body, "count")
        return int(answer.get("count", 0))

    async def seat(self, node: NodeDesc, cut: int) -> Seat:
        """``node``'s seat at revision ``cut`` (its round's): its rank and the profile marks.

        Raises:
            RendezvousStateError: That revision was compacted away.
        """
        k = self._keys
        body = {"success": seat_ops(k, node, cut)}
        try:
            answer = await self._client.call("/v3/kv/txn", body, "rank")
        except Compacted:
            raise RendezvousStateError(
                f"{self.where}: the revision at which round completed was compacted away "
                "before this node read its rank; compact less often (etcd's "
                "--auto-compaction-retention) or start the job again."
            ) from None
        ranges = [range_of(r) for r in answer.get("responses", [])]
        return seat_of(k, ranges[0], ranges[1])
