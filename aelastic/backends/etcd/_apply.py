"""Carrying out one request on etcd: read the run, decide (:mod:`._port`), write, answer.

How it works: a request costs one read transaction (the header, this node's three possible
keys, the counts of the lists, the first participant, the cut; all count-only or one key,
so its size does not grow with the job) and, when it changes something, one write
transaction compared against that read: the header's mod revision, this node's keys, and
(when the decision used the participants' count) that no participant joined since. A join
to a forming round changes neither the header nor any shared key, so a thousand joins at
once do not conflict; the header changes only on transitions (the last call starts, the
round completes...), so a write rarely fails, and when it does the failure branch of the
same transaction brings the fresh read and the request is decided again. A blind join
learns the count it made from its own transaction: the join that made ``min_nodes`` or
``max_nodes`` starts the last call or completes the round (any request that finds it
undone does it, :func:`._port.reconcile`).

Leases: every node has one (time to live: the heartbeat window in whole seconds), granted
before its first key is written and kept across rounds; a keep-alive renews it (not a
write: etcd's leader keeps leases, no Raft entry, no watch event).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from ...core.errors import RendezvousConnectionError, RendezvousStateError
from ...core.state import (
    MemberEntry,
    NodeDesc,
    Op,
    Outcome,
    Reply,
    Request,
    Snapshot,
    Status,
    Transition,
)
from ...core.token import new_epoch
from ._client import Compacted, EtcdClient, EtcdError, LeaseNotFound, b64, unb64
from ._layout import Header, RunKeys, decode_header, encode_header, node_of, prefix_end
from ._port import LISTS, Member, Plan, View, decide, needs_names, status_of

__all__ = ["Deadlines", "Leases", "RunPort", "lease_ttl", "range_op"]

#: Attempts of one request whose write found the run changed, before it gives up.
_ATTEMPTS = 64


def lease_ttl(window_ms: int) -> int:
    """A lease's time to live for a heartbeat window: etcd counts whole seconds."""
    return max(1, math.ceil(window_ms / 1000))


def range_op(key: str | bytes, end: str | bytes | None = None, **options: Any) -> dict[str, Any]:
    """A range request of a transaction."""
    body: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        body["range_end"] = b64(end)
    body.update(options)
    return {"request_range": body}


def _members(kvs: list[dict[str, Any]]) -> list[Member]:
    return [
        Member(
            key=unb64(kv.get("key")).decode(errors="replace"),
            mod=int(kv.get("mod_revision", 0)),
            create=int(kv.get("create_revision", 0)),
            value=unb64(kv.get("value")),
            lease=int(kv.get("lease", 0)),
        )
        for kv in kvs
    ]


def _range(response: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = response.get("response_range", {})
    return result


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
        self._ids: dict[NodeDesc, tuple[int, float]] = {}

    def of(self, node: NodeDesc) -> int | None:
        entry = self._ids.get(node)
        return None if entry is None else entry[0]

    def forget(self, node: NodeDesc) -> None:
        self._ids.pop(node, None)

    async def grant(self, node: NodeDesc, window_ms: int) -> int:
        ttl = self._ttl or lease_ttl(window_ms)
        answer = await self._client.call("/v3/lease/grant", {"TTL": ttl}, "lease grant")
        lease = int(answer.get("ID", 0))
        if not lease:
            raise RendezvousConnectionError(
                f"etcd at {self._client.display} granted no lease: {answer.get('error')}"
            )
        self._ids[node] = (lease, time.monotonic())
        return lease

    async def ensure(self, node: NodeDesc, window_ms: int) -> int:
        lease = self.of(node)
        return lease if lease is not None else await self.grant(node, window_ms)

    async def renew(self, node: NodeDesc, window_ms: int) -> bool:
        """Renew ``node``'s lease; whether it was still alive. A lease renewed less than a
        fifth of the window ago is not renewed again (a join's beat right after its grant)."""
        entry = self._ids.get(node)
        if entry is None:
            return False
        if time.monotonic() - entry[1] < window_ms / 5000:
            return True
        answer = await self._client.call("/v3/lease/keepalive", {"ID": entry[0]}, "keep-alive")
        alive = int(answer.get("result", answer).get("TTL", 0)) > 0
        if alive:
            self._ids[node] = (entry[0], time.monotonic())
        else:
            self.forget(node)
        return alive

    async def revoke_all(self) -> None:
        ids, self._ids = [lease for lease, _ in self._ids.values()], {}
        for lease in ids:
            with contextlib.suppress(EtcdError, RendezvousConnectionError):
                await self._client.call("/v3/lease/revoke", {"ID": lease}, "lease revoke", 2.0)


class RunPort:
    """The requests of one run's nodes on etcd (see the module docstring).

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
        body = {"success": [range_op(k.header), *(
            range_op(p, prefix_end(p), count_only=True)
            for p in (k.participants, k.waiting, k.redundant, k.finished))]}  # fmt: skip
        try:
            answer = await self._client.call("/v3/kv/txn", body, "status")
            ranges = [_range(r) for r in answer.get("responses", [])]
            headers = _members(ranges[0].get("kvs", []))
            if not headers:
                return None if missing_ok else Status(now_ms=now)
            h = decode_header(headers[0].value, self.where)
        except RendezvousStateError:
            if missing_ok:
                return None
            raise
        counts = [int(r.get("count", 0)) for r in ranges[1:5]]
        deadline = None
        if h.deadline is not None and h.rules is not None:
            deadline = self._deadlines.end(h.epoch, h.deadline[0], h.rules.last_call_ms, now)
        return status_of(h, counts[0], counts[1], counts[2], counts[3], now, deadline)

    # -- reading --------------------------------------------------------------------------

    def _view_ops(self, node: NodeDesc, rank_at: int | None = None) -> list[dict[str, Any]]:
        k = self._keys
        ops = [
            range_op(k.header),
            *(range_op(k.member(w, node)) for w in LISTS),
            *(
                range_op(p, prefix_end(p), count_only=True)
                for p in (k.participants, k.waiting, k.redundant, k.finished)
            ),
            range_op(k.participants, prefix_end(k.participants), limit=1),
            range_op(k.cut, keys_only=True),
        ]
        if rank_at:
            ops.append(
                range_op(k.participants, k.member("p", node), count_only=True, revision=rank_at)
            )
        return ops

    def _view(self, responses: list[dict[str, Any]], revision: int) -> tuple[View, int | None]:
        ranges = [_range(r) for r in responses]
        headers = _members(ranges[0].get("kvs", []))
        header = decode_header(headers[0].value, self.where) if headers else None
        own: dict[str, Member | None] = {}
        for i, where in enumerate(LISTS, start=1):
            found = _members(ranges[i].get("kvs", []))
            own[where] = found[0] if found else None
        counts = [int(ranges[i].get("count", 0)) for i in range(4, 8)]
        first = None
        firsts = _members(ranges[8].get("kvs", []))
        if firsts:
            first = (self._node_of(firsts[0].key, "p/"), _port_of(firsts[0].value))
        cuts = _members(ranges[9].get("kvs", []))
        rank = int(ranges[10].get("count", 0)) if len(ranges) > 10 else None
        view = View(
            revision=revision,
            header=header,
            header_mod=headers[0].mod if headers else 0,
            own=own,
            participants=counts[0],
            waiting=counts[1],
            redundant=counts[2],
            finished=counts[3],
            first=first,
            cut=cuts[0].mod if cuts else 0,
        )
        return view, rank

    def _node_of(self, key: str, where: str) -> NodeDesc:
        try:
            return node_of(key[len(self._keys.base) + len(where) :])
        except ValueError:
            raise RendezvousStateError(
                f"{self.where}: the key {key!r} is not a node's key aelastic wrote; it was "
                "left as it is."
            ) from None

    async def read(self, node: NodeDesc, rank_at: int | None = None) -> tuple[View, int | None]:
        """One read of the run as ``node`` sees it (and its rank at revision ``rank_at``)."""
        body = {"success": self._view_ops(node, rank_at)}
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
        fresh, _ = self._view(responses[:10], int(answer.get("header", {}).get("revision", 0)))
        extras = tuple(_members(_range(responses[10]).get("kvs", [])))
        drop = {m.key for m in extras}
        first = None
        for member in _members(_range(responses[11]).get("kvs", [])):
            if member.key not in drop:
                first = (self._node_of(member.key, "p/"), _port_of(member.value))
                break
        return View(**{**fresh.__dict__, "extras": extras, "first": first})

    async def lost_names(self, view: View, count: int) -> list[str]:
        """The members etcd removed from the complete round since the header's last write,
        in order: deletions of ``p/`` keys after the revision the header accounted for,
        but those of its own write and of the members that left having finished."""
        header = view.header
        assert header is not None
        k = self._keys
        body = {
            "create_request": {
                "key": b64(k.participants),
                "range_end": b64(prefix_end(k.finished)),
                "start_revision": header.accounted + 1,
            }
        }
        names: list[str] = []
        finished: set[tuple[int, str]] = set()
        try:
            async with self._client.stream("/v3/watch", body, timeout=5.0) as messages:
                async for message in _until(messages, 2.0):
                    if message.get("compact_revision") or message.get("canceled"):
                        break
                    for event in message.get("events", []):
                        kv = event.get("kv", {})
                        revision = int(kv.get("mod_revision", 0))
                        if revision > view.revision:
                            return names
                        key = unb64(kv.get("key")).decode(errors="replace")
                        name = key[len(k.base) + 2 :]
                        if key.startswith(k.finished):
                            finished.add((revision, name))
                            continue
                        lost = event.get("type") == "DELETE" and revision != view.header_mod
                        if lost and (revision, name) not in finished:
                            names.append(self._node_of(key, "p/").key)
                            if len(names) >= count:
                                return names
        except (ConnectionError, EtcdError, RendezvousConnectionError, TimeoutError):
            pass  # the names are for the sample only: the counts stay exact
        return names

    async def snapshot(self, now: int) -> Snapshot | None:
        """The whole membership (O(N): for operators), or ``None`` without a state."""
        k = self._keys
        every = [
            range_op(p, prefix_end(p), keys_only=p != k.participants)
            for p in (k.participants, k.waiting, k.redundant)
        ]
        finished = range_op(k.finished, prefix_end(k.finished), count_only=True)
        body = {"success": [range_op(k.header), *every, finished, range_op(k.cut, keys_only=True)]}
        answer = await self._client.call("/v3/kv/txn", body, "snapshot")
        ranges = [_range(r) for r in answer.get("responses", [])]
        headers = _members(ranges[0].get("kvs", []))
        if not headers:
            return None
        h = decode_header(headers[0].value, self.where)
        lists = [_members(ranges[i].get("kvs", [])) for i in (1, 2, 3)]
        done = int(ranges[4].get("count", 0))
        cuts = _members(ranges[5].get("kvs", []))
        ranks: dict[str, int] = {}
        if h.complete and cuts:
            at = {"revision": cuts[0].mod}
            cut_body = {"success": [range_op(k.participants, prefix_end(k.participants),
                                             keys_only=True, **at)]}  # fmt: skip
            try:
                cut = await self._client.call("/v3/kv/txn", cut_body, "snapshot")
                members = _members(_range(cut.get("responses", [{}])[0]).get("kvs", []))
                ranks = {m.key: i for i, m in enumerate(members)}
            except Compacted:
                ranks = {m.key: i for i, m in enumerate(lists[0])}
        participants = lists[0]
        if not h.complete:
            participants = sorted(participants, key=lambda m: m.create)
        deadline = None
        if h.deadline is not None and h.rules is not None:
            deadline = self._deadlines.end(h.epoch, h.deadline[0], h.rules.last_call_ms, now)
        status = status_of(h, len(lists[0]), len(lists[1]), len(lists[2]), done, now, deadline)

        def entry(member: Member, where: str, rank: int | None = None) -> MemberEntry:
            return MemberEntry(self._node_of(member.key, where), now, rank)

        return Snapshot(
            status=status,
            participants=tuple(
                entry(m, "p/", ranks.get(m.key) if h.complete else None) for m in participants
            ),
            wait_list=tuple(entry(m, "w/") for m in lists[1]),
            redundancy_list=tuple(entry(m, "r/") for m in lists[2]),
            master_addr=None if h.master is None else h.master[0],
            master_port=None if h.master is None else h.master[1],
        )

    # -- writing --------------------------------------------------------------------------

    def _write_ops(
        self, view: View, plan: Plan, node: NodeDesc, lease: int | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        k = self._keys
        compare: list[dict[str, Any]] = [
            {"key": b64(k.header), "target": "MOD", "result": "EQUAL",
             "mod_revision": view.header_mod},
        ]  # fmt: skip
        for where in LISTS:
            member = view.own.get(where)
            compare.append(
                {
                    "key": b64(k.member(where, node)),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": 0 if member is None else member.mod,
                }
            )
        if plan.guard:
            compare.append(
                {"key": b64(k.participants), "range_end": b64(prefix_end(k.participants)),
                 "target": "CREATE", "result": "LESS", "create_revision": view.revision + 1}
            )  # fmt: skip
        ops: list[dict[str, Any]] = []
        if "q" in plan.put:  # before the participant's delete: a finished leave's mark
            ops.append({"request_put": {"key": b64(k.member("q", node)), "value": ""}})
        for where in plan.delete:
            ops.append({"request_delete_range": {"key": b64(k.member(where, node))}})
        for key in plan.extras:
            ops.append({"request_delete_range": {"key": b64(key)}})
        for where, value in plan.put.items():
            if where != "q":
                put = {"key": b64(k.member(where, node)), "value": b64(value), "lease": lease}
                ops.append({"request_put": put})
        if plan.header is not None:
            header = plan.header.evolve(accounted=view.revision)
            ops.append({"request_put": {"key": b64(k.header), "value": b64(encode_header(header))}})
            ops.append({"request_delete_range": {"key": b64(k.fresh)}})
        if plan.mark_cut:
            round_ = b"" if plan.header is None else str(plan.header.round).encode()
            ops.append({"request_put": {"key": b64(k.cut), "value": b64(round_)}})
        if plan.clear_finished:
            ops.append(
                {"request_delete_range": {"key": b64(k.finished),
                                          "range_end": b64(prefix_end(k.finished))}}
            )  # fmt: skip
        ops.append(range_op(k.participants, prefix_end(k.participants), count_only=True))
        if plan.rank and plan.mark_cut:
            ops.append(range_op(k.participants, k.member("p", node), count_only=True))
        return compare, ops

    async def _write(
        self, view: View, plan: Plan, node: NodeDesc, window_ms: int
    ) -> tuple[bool, list[dict[str, Any]], int]:
        lease = None
        if any(w != "q" for w in plan.put):
            lease = await self._leases.ensure(node, window_ms)
        for _ in range(3):
            compare, ops = self._write_ops(view, plan, node, lease)
            body = {"compare": compare, "success": ops, "failure": self._view_ops(node)}
            try:
                answer = await self._client.call("/v3/kv/txn", body, "write")
            except LeaseNotFound:  # silent longer than the window (or a new cluster)
                self._leases.forget(node)
                lease = await self._leases.grant(node, window_ms)
                continue
            revision = int(answer.get("header", {}).get("revision", 0))
            return bool(answer.get("succeeded")), answer.get("responses", []), revision
        raise RendezvousConnectionError(
            f"{self.where}: etcd dropped node {node}'s lease three times in a row"
        )

    # -- a request ------------------------------------------------------------------------

    async def first_join(
        self, request: Request, now: int, epoch: str
    ) -> Reply | tuple[View, int | None]:
        """A node's first join, in one transaction and no read: it creates the run (header
        and ``f``) if there is none, or joins round 0 while the run is as its creator left
        it (``f`` there, the header never rewritten): the case of every node of a new job
        starting at once. Otherwise the transaction's failure branch is the read, and the
        join goes on as any request (the view is returned)."""
        k, node, rules = self._keys, request.node, request.rules
        fresh = Header(epoch=epoch, rules=rules)

        def body_of(lease: int) -> dict[str, Any]:
            absent = [
                {
                    "key": b64(k.member(w, node)),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": 0,
                }
                for w in LISTS
            ]
            mine = {"key": b64(k.member("p", node)), "value": b64(str(request.port))}
            me = {"request_put": {**mine, "lease": lease}}
            counts = [
                range_op(p, prefix_end(p), count_only=True)
                for p in (k.participants, k.waiting, k.redundant, k.finished)
            ]
            body = {
                "compare": [
                    {"key": b64(k.header), "target": "CREATE", "result": "EQUAL",
                     "create_revision": 0}, *absent,
                ],
                "success": [
                    {"request_put": {"key": b64(k.header), "value": b64(encode_header(fresh))}},
                    {"request_put": {"key": b64(k.fresh), "value": ""}},
                    me, range_op(k.header), *counts,
                ],
                "failure": [{"request_txn": {
                    "compare": [
                        {"key": b64(k.fresh), "target": "CREATE", "result": "GREATER",
                         "create_revision": 0},
                        {"key": b64(k.header), "target": "VERSION", "result": "EQUAL",
                         "version": 1},
                        *absent,
                    ],
                    "success": [me, range_op(k.header), *counts],
                    "failure": self._view_ops(node),
                }}],
            }  # fmt: skip
            return body

        for attempt in range(3):
            lease = await self._leases.grant(node, rules.window_ms)
            try:
                answer = await self._client.call("/v3/kv/txn", body_of(lease), "join")
                break
            except LeaseNotFound:  # granted on a leader lost before the grant was applied
                self._leases.forget(node)
                if attempt == 2:
                    raise RendezvousConnectionError(
                        f"{self.where}: etcd dropped node {node}'s new lease three times"
                    ) from None
        revision = int(answer.get("header", {}).get("revision", 0))
        responses = answer.get("responses", [])
        if not answer.get("succeeded"):
            nested = responses[0].get("response_txn", {})
            responses = nested.get("responses", [])
            if not nested.get("succeeded"):
                return self._view(responses, revision)
        ranges = [r["response_range"] for r in responses if "response_range" in r]
        header = decode_header(_members(ranges[0].get("kvs", []))[0].value, self.where)
        np, nw, nr, nq = (int(r.get("count", 0)) for r in ranges[1:5])
        self._where_of[node] = "p"
        if np == rules.min_nodes or np >= rules.max_nodes:
            # The last call starts or the round completes: what a join does then (the rest
            # of this request: as a participant's join, it finds it to do).
            reply = await self.apply(request, now, epoch)
            transition = reply.transition
            if reply.outcome is Outcome.WAIT:
                transition = Transition.ADD_TO_PARTICIPANTS
            elif reply.outcome is Outcome.FINISH:
                transition = Transition.MARK_COMPLETE
            return Reply(**{**reply.__dict__, "transition": transition})
        status = status_of(header, np, nw, nr, nq, now, None)
        return Reply(Outcome.WAIT, status, Transition.ADD_TO_PARTICIPANTS, known=True)

    async def apply(self, request: Request, now: int, epoch: str | None = None) -> Reply:
        """Carry out ``request`` at this process's time ``now`` (ms) and answer.

        Raises:
            RendezvousConnectionError: etcd could not be reached within ``read_timeout``.
            RendezvousStateError: The run's keys hold values aelastic did not write.
        """
        node, window = request.node, request.rules.window_ms
        hint = None if self._cut_hint is None else self._cut_hint()
        epoch = epoch or new_epoch()
        first = request.op is Op.JOIN and not request.expired and self._leases.of(node) is None
        if first:
            answer = await self.first_join(request, now, epoch)
            if isinstance(answer, Reply):
                return answer
            view, rank = answer
        else:
            view, rank = await self.read(node, hint)
        clock = self._deadlines.end
        for attempt in range(_ATTEMPTS):
            count = needs_names(view)
            names = await self.lost_names(view, count) if count else []
            plan = decide(view, request, now, epoch, clock, names)
            if plan.need_extras:
                view = await self._with_extras(view, node, plan.need_extras)
                plan = decide(view, request, now, epoch, clock, names)
            writes = plan.header is not None or plan.put or plan.delete or plan.mark_cut
            if not writes:
                break
            ok, responses, revision = await self._write(view, plan, node, window)
            if ok:
                header = plan.header
                if header is not None and header.deadline is not None:
                    self._deadlines.saw(header.epoch, header.deadline[0], header.deadline[1]
                                        - request.rules.last_call_ms)  # fmt: skip
                if plan.rank and plan.mark_cut:
                    rank = int(_range(responses[-1]).get("count", 0))
                    view = View(**{**view.__dict__, "cut": revision})
                await self._follow_up(request, plan, responses, now, epoch)
                break
            view, _ = self._view(responses, revision)
            if attempt >= 3:
                await asyncio.sleep(0.005 * min(attempt, 20))
        else:
            raise RendezvousConnectionError(
                f"{self.where}: the run changed under {_ATTEMPTS} attempts of {request.op.value}"
            )
        if plan.beat:
            try:
                alive = await self._leases.renew(node, window)
            except LeaseNotFound:
                alive = False
            if not alive and request.op is Op.KEEP_ALIVE:
                plan.known = False
        if plan.rank and not plan.mark_cut and (rank is None or view.cut != hint):
            rank = await self._rank(node, view.cut)
        self._where_of[node] = plan.where if plan.known else None
        return self._reply(request, plan, rank)

    async def _rank(self, node: NodeDesc, cut: int) -> int:
        k = self._keys
        body = {"success": [range_op(k.participants, k.member("p", node), count_only=True,
                                     revision=cut)]}  # fmt: skip
        try:
            answer = await self._client.call("/v3/kv/txn", body, "rank")
        except Compacted:
            raise RendezvousStateError(
                f"{self.where}: the revision at which round completed was compacted away "
                "before this node read its rank; compact less often (etcd's "
                "--auto-compaction-retention) or start the job again."
            ) from None
        return int(_range(answer.get("responses", [{}])[0]).get("count", 0))

    async def _follow_up(
        self, request: Request, plan: Plan, responses: list[dict[str, Any]], now: int,
        epoch: str,
    ) -> None:  # fmt: skip
        """A blind join that made ``min_nodes`` or ``max_nodes`` participants does what
        the join would have done (only when joins ran at once: see the module docstring)."""
        if request.op is not Op.JOIN or "p" not in plan.put or plan.guard:
            return
        count_index = len(responses) - 1
        count = int(_range(responses[count_index]).get("count", 0))
        rules = request.rules
        if count == rules.min_nodes or count >= rules.max_nodes:
            status = Request(Op.STATUS, request.node, rules)
            await self.apply(status, now, epoch)

    def _reply(self, request: Request, plan: Plan, rank: int | None) -> Reply:
        finished_join = request.op is Op.JOIN and plan.outcome is Outcome.FINISH
        master = plan.master if finished_join else None
        return Reply(
            outcome=plan.outcome,
            status=plan.status,
            transition=plan.transition,
            rank=rank if finished_join else None,
            master_addr=None if master is None else master[0],
            master_port=None if master is None else master[1],
            wake_at_ms=plan.wake_at_ms,
            restart_deadline=plan.restart,
            known=plan.known,
        )


async def _until(messages: Any, idle: float) -> Any:
    """``messages`` until none came for ``idle`` seconds."""
    iterator = messages.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(iterator.__anext__(), idle)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return


def _port_of(value: bytes) -> int:
    try:
        return int(value or b"0")
    except ValueError:
        return 0
