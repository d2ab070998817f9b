"""Carrying out one request on etcd: read the run, decide (:mod:`._port`), write, answer.

How it works: a request costs one read transaction (:meth:`._reads.RunReads.read`: its
size does not grow with the job) and, when it changes something, one write
transaction compared against that read: the header's mod revision, this node's keys, and
(when the decision used the participants' count) that no participant joined since. A join
to a forming round changes neither the header nor any shared key, so a thousand joins at
once do not conflict; the header changes only on transitions (the last call starts, the
round completes...), so a write rarely fails, and when it does the failure branch of the
same transaction brings the fresh read and the request is decided again. A blind join
learns the count it made from its own transaction: the join that made ``min_nodes`` or
``max_nodes`` starts the last call or completes the round (any request that finds it
undone does it, :func:`._port.reconcile`). A node's first join is one transaction and no
read (:meth:`RunPort.first_join`). A node's keys live on its lease (:mod:`._leases`). The
transactions' bodies are made in :mod:`._txns`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...core.errors import RendezvousConnectionError
from ...core.state import NodeDesc, Op, Outcome, Reply, Request, Status, Transition
from ...core.token import new_epoch
from ._client import Compacted, EtcdError, LeaseNotFound
from ._control import Seat, placement_of
from ._decide import decide
from ._layout import Header, decode_header, member_parts, sort_key
from ._plan import Plan, View
from ._port import needs_names, status_of
from ._ranges import members_of, range_of, range_op, seat_of, seat_ops
from ._reads import RunReads
from ._txns import first_join_txn, write_txn

__all__ = ["RunPort"]

_RENEW = "/v3/lease/keepalive"

#: Attempts of one request whose write found the run changed, before it gives up.
_ATTEMPTS = 64


class RunPort(RunReads):
    """The requests of one run's nodes on etcd (see the module docstring; the reads are
    :class:`~._reads.RunReads`')."""

    async def _write(
        self, view: View, plan: Plan, node: NodeDesc, window_ms: int, count: bool
    ) -> tuple[bool, list[dict[str, Any]], int]:
        lease = None
        if any(w not in ("q", "l") for w in plan.put):  # (the marks have no lease)
            lease = await self._leases.ensure(node, window_ms)
        for _ in range(3):
            compare, ops = write_txn(self._keys, view, plan, node, lease, count)
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

    async def first_join(self, request: Request, now: int, epoch: str) -> Reply | None:
        """A node's first join, in one transaction and no read: it creates the run (header
        and ``b``) if there is none, or joins round 0 while the run is as its creator left
        it (``b`` there: the run is not empty; the header never rewritten), moving ``b``
        onto its own lease: the case of every node of a new job starting at once. Otherwise
        (``None``) the join goes on as any request, from a read: so does a join with other
        rules or another profile than the run's (``b`` holds them), or for a name already
        listed. The read is not in the transaction's failure branch: the read's
        eleven ranges made the transaction of every node's first join a third larger
        (measured at 1,024 nodes through etcd's JSON gateway, which aelastic spoke before
        gRPC: decoding requests' JSON took a fifth of etcd's CPU during formation). Nor does a
        join that does not create the run count the participants in its write: etcd
        carries out a write's ranges in its one apply loop and counts a range by walking
        its index (O(N)); at 1,024 joins that counting was nearly all the loop's work, and
        a keep-alive on the leader first waits for the loop to catch up. The join reads the
        count at its own revision afterwards (:meth:`participants_at`): the same count,
        read beside the loop; and only when it may have made ``min_nodes``: the revisions
        written since the run's header bound the count (each write creates one key at
        most), so the joins of a forming round but its last few read nothing (one request
        fewer a node; the count such a join reports is that bound, exact while only joins
        wrote to etcd since the run began)."""
        k, node, rules = self._keys, request.node, request.rules
        fresh = Header(epoch=epoch, rules=rules, profile=(request.role, request.local_world_size))

        def body_of(lease: str) -> dict[str, Any]:
            return first_join_txn(k, request, fresh, lease)

        answer = await self._grant_and_join(node, rules.window_ms, body_of)
        revision = int(answer.get("header", {}).get("revision", 0))
        self.revision_of[node] = revision
        responses = answer.get("responses", [])
        if not answer.get("succeeded"):
            nested = responses[0].get("response_txn", {})
            responses = nested.get("responses", [])
            if not nested.get("succeeded"):
                return None
        ranges = [r["response_range"] for r in responses if "response_range" in r]
        stored = members_of(ranges[0].get("kvs", []))[0]
        header = decode_header(stored.value, self.where)
        counts = [int(r.get("count", 0)) for r in ranges[1:]]
        if len(counts) == 3:  # joined a run: the count its join made
            # Each write is one revision and creates at most one participant's key, and
            # every key under p/ was made since the run's header: so at most this many.
            # (aelastic's writes; a foreign write of several keys at once under p/ would
            # leave a completion undone until some node's next full request.)
            most = revision - stored.create + 1
            if most < rules.min_nodes:  # it cannot have made min_nodes: nothing to do
                counts.insert(0, most)
            else:  # read after the join (see the docstring)
                counts.insert(0, await self.participants_at(revision))
        np, nw, nr, nq = counts
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
        status = status_of(header, np, nw, nr, nq, 0, now, None)
        return Reply(Outcome.WAIT, status, Transition.ADD_TO_PARTICIPANTS, known=True)

    async def _grant_and_join(
        self, node: NodeDesc, window_ms: int, body_of: Callable[[str], dict[str, Any]]
    ) -> dict[str, Any]:
        """A new lease for ``node``, the join ``body_of(lease)`` and a renewal of the lease,
        each sent once the one before was answered (see :mod:`._leases`); the join's
        answer. A busy etcd takes its time over each call (the grant is one too): the
        renewal makes the lease's time to live count from the join, and while etcd takes
        longer over the join than a third of that time, the lease is renewed meanwhile
        (:meth:`~._leases.Leases.kept`; before, the leases of hundreds of nodes of a 1,024-node
        job ran out while etcd, starved of CPU, carried their joins out)."""
        sent: list[dict[str, Any]] = []

        def grant() -> list[tuple[str, dict[str, Any]]]:
            path, request = self._leases.grant_request(node, window_ms)
            sent[:] = [request]  # each attempt of the call picks another id
            return [(path, request)]

        for _ in range(3):
            [granted] = await self._client.call_many(grant, "lease grant")
            if not self._leases.granted(node, sent[0], granted):
                continue  # its id was taken (a grant whose answer was lost): another
            lease = sent[0]["ID"]
            calls = [("/v3/kv/txn", body_of(lease)), (_RENEW, {"ID": lease})]
            async with self._leases.kept(node):  # however long etcd takes over the join
                answer, renewed = await self._client.call_many(calls.copy, "join")
            if isinstance(answer, LeaseNotFound):
                self._leases.forget(node)
                continue  # granted on a leader lost before the grant was applied: again
            if isinstance(answer, EtcdError):
                raise answer
            self._leases.renewed(node, renewed)
            return answer
        raise RendezvousConnectionError(
            f"{self.where}: etcd dropped node {node}'s new lease three times"
        )

    async def finish(
        self, node: NodeDesc, header: Header, cut: int, status: Status
    ) -> Reply | None:
        """The join of a participant whose round the watch says completed (``header``, at
        revision ``cut``): its rank and the round's bootstrap address, read at the cut in
        one small transaction (its keep-alive sent with it), instead of a
        full read; what the full read would add is the pruning that the round's sentinels
        do anyway (:mod:`._changes`). ``None`` when the node's key was not in the round or
        its lease is gone (the request is then carried out in full)."""
        k = self._keys
        mine = k.member("p", node)

        def read(serializable: bool) -> dict[str, Any]:
            # At the cut, which the member whose watch told of it has applied (etcd's apply
            # loop is busy with the completion: see read_applied). Its seat (rank and
            # profile marks: an empty range in a uniform job) and whether it is in it.
            at = {"revision": cut, "count_only": True, "serializable": serializable}
            rank, marks = seat_ops(k, node, cut, serializable=serializable)
            return {"success": [rank, marks, range_op(mine, None, **at)]}

        # The renewal (see ._leases): on the keep-alive stream while the rank is read, or
        # sent with the read (no stream opened yet for this node).
        ahead = None if self._client.streaming else self._leases.renew_request(node, True)
        renewal = None
        if ahead is None:
            renewal = asyncio.ensure_future(self._leases.renew(node, at_once=True))
        try:
            answer, renewed = await self.read_applied("/v3/kv/txn", read, "rank", ahead)
        except BaseException as exc:
            if renewal is not None:
                renewal.cancel()
                await asyncio.gather(renewal, return_exceptions=True)
            if isinstance(exc, Compacted):
                return None
            raise
        alive = await renewal if renewal is not None else self._leases.renewed(node, renewed)
        if not alive:
            return None
        ranges = [range_of(r) for r in answer.get("responses", [])]
        if len(ranges) != 3 or int(ranges[2].get("count", 0)) != 1:
            return None
        seat = seat_of(k, ranges[0], ranges[1])
        master = header.master
        return Reply(
            outcome=Outcome.FINISH,
            status=status,
            transition=Transition.NONE,
            rank=seat.rank,
            master_addr=None if master is None else master[0],
            master_port=None if master is None else master[1],
            known=True,
            placement=placement_of(seat, sort_key(node), header.world, header.profile),
        )

    async def apply(self, request: Request, now: int, epoch: str | None = None) -> Reply:
        """Carry out ``request`` at this process's time ``now`` (ms) and answer.

        Raises:
            RendezvousConnectionError: etcd could not be reached within ``read_timeout``.
            RendezvousStateError: The run's keys hold values aelastic did not write.
        """
        node = request.node
        hint = None if self._cut_hint is None else self._cut_hint()
        epoch = epoch or new_epoch()
        first = request.op is Op.JOIN and not request.expired and self._leases.of(node) is None
        if first:
            reply = await self.first_join(request, now, epoch)
            if reply is not None:
                return reply
        async with self._leases.kept(node):  # however long etcd takes over the request
            return await self._carry_out(request, now, epoch, hint)

    async def _carry_out(self, request: Request, now: int, epoch: str, hint: int | None) -> Reply:
        """:meth:`apply` from a read: read, decide, write (again while the run changed)."""
        node = request.node
        view, seat = await self.read(node, hint)
        self.revision_of[node] = view.revision
        self._adopt(view, request)
        clock = self._deadlines.end
        for attempt in range(_ATTEMPTS):
            count = needs_names(view)
            names = await self.lost_names(view, count) if count else []
            view = await self._context(view, request, count > 0, seat if hint == view.cut else None)
            plan = decide(view, request, now, epoch, clock, names)
            if plan.need_extras:
                view = await self._with_extras(view, node, plan.need_extras)
                view = await self._context(view, request, count > 0, None)
                plan = decide(view, request, now, epoch, clock, names)
            writes = (
                plan.header is not None or plan.put or plan.delete or plan.mark_cut
                or plan.health is not None or plan.fail_mark is not None or plan.reset_health
            )  # fmt: skip
            if not writes:
                break
            blind = _blind_join(request, plan)
            ok, responses, revision = await self._write(
                view, plan, node, plan.rules.window_ms, blind
            )
            if ok:
                self.revision_of[node] = revision
                header = plan.header
                if header is not None and header.deadline is not None:
                    self._deadlines.saw(header.epoch, header.deadline[0], header.deadline[1]
                                        - plan.rules.last_call_ms)  # fmt: skip
                    if view.header is None or view.header.deadline != header.deadline:
                        self.last_calls[node] = (header.epoch, header.deadline[0])
                if plan.rank and plan.mark_cut:
                    seat = seat_of(self._keys, range_of(responses[-2]), range_of(responses[-1]))
                    view = replace(view, cut=revision)
                    hint = revision
                await self._follow_up(request, plan, responses, now, epoch)
                await self._after_marked(request, view, plan, revision, now, epoch)
                await self._after_left(request, view, plan, revision, now, epoch)
                break
            view, _ = self._view(responses, revision)
            self.revision_of[node] = revision
            if attempt >= 3:
                await asyncio.sleep(0.005 * min(attempt, 20))
        else:
            raise RendezvousConnectionError(
                f"{self.where}: the run changed under {_ATTEMPTS} attempts of {request.op.value}"
            )
        if plan.beat:
            # A heartbeat, and a join that completes (the heartbeats start after it),
            # renew at once (see ._leases).
            completes = request.op is Op.JOIN and plan.outcome is Outcome.FINISH
            try:
                alive = await self._leases.renew(
                    node, at_once=completes or request.op is Op.KEEP_ALIVE
                )
            except LeaseNotFound:
                alive = False
            if not alive and request.op is Op.KEEP_ALIVE:
                plan.known = False
        if plan.rank and (seat is None or view.cut != hint):
            seat = await self.seat(node, view.cut)
        if plan.outcome is not Outcome.ERROR_FORBIDDEN:  # another client's: not this one's
            self._where_of[node] = plan.where if plan.known else None
        return plan.reply(request, seat)

    async def _context(self, view: View, request: Request, losses: bool, seat: Seat | None) -> View:
        """``view`` with what the request's decision needs beyond the read: the health key
        (a report, or ``losses`` etcd made to account for) and the node's rank at the cut
        (a failure report; ``seat``: read at the cut already)."""
        report = request.report if request.op is Op.REPORT else None
        listed = view.where() is not None
        health = await self.health_read() if (report is not None and listed) or losses else None
        rank = None
        h = view.header
        member = h is not None and h.complete and view.own.get("p") is not None
        if report is not None and report.failure is not None and member:
            rank = seat.rank if seat is not None else (await self.seat(request.node, view.cut)).rank
        if health is None and rank is None:
            return view
        return replace(view, health=health, rank=rank)

    async def _after_marked(
        self, request: Request, view: View, plan: Plan, revision: int, now: int, epoch: str
    ) -> None:
        """A write that marked a member done or finished (its ``q/`` key) without writing
        the header may have been the last of the round, its read not counting others done
        at once: when the revisions since its read leave room for it (each write makes one
        ``q/`` key at most), count them at its revision (beside etcd's apply loop) and, if
        every member is done, have the header say so (a status request: its decision
        writes it)."""
        if "q" not in plan.put or plan.header is not None or not plan.world:
            return
        most = view.finished + 1 + (revision - view.revision - 1)
        if most < plan.world or await self.count_at(self._keys.finished, revision) < plan.world:
            return
        await self.apply(Request(Op.STATUS, request.node, plan.rules), now, epoch)

    async def _after_left(
        self, request: Request, view: View, plan: Plan, revision: int, now: int, epoch: str
    ) -> None:
        """A member's leave that did not open the next round may have been the round's last
        all the same (one compared against its own keys alone does not see the others
        leaving at once; one that wrote the header, those that wrote their own keys since
        its read): when the revisions since its read leave room for it (a write removes one
        participant at most), count them at its revision and, if none is left, have a status
        request open the next round, as the last leave's decision would have."""
        h = view.header
        if request.op is not Op.LEAVE or h is None or not h.complete or view.where() != "p":
            return
        if plan.header is not None and not plan.header.complete:
            return  # it opened the next round itself
        if view.participants > revision - view.revision:
            return
        if await self.count_at(self._keys.participants, revision) == 0:
            await self.apply(Request(Op.STATUS, request.node, plan.rules), now, epoch)

    def _adopt(self, view: View, request: Request) -> None:
        """Renew the lease the node's keys are on, if it is not the one this process
        holds for it (see :meth:`._leases.Leases.adopt`); only keys holding its secret."""
        rules = view.header.rules if view.header is not None else None
        for member in view.own.values():
            if member is None or not member.lease or rules is None:
                continue
            if member.lease != self._leases.of(request.node) and hmac.compare_digest(
                member_parts(member.value)[1], request.secret.encode()
            ):
                self._leases.adopt(request.node, member.lease, rules.window_ms)

    async def _follow_up(
        self, request: Request, plan: Plan, responses: list[dict[str, Any]], now: int,
        epoch: str,
    ) -> None:  # fmt: skip
        """A blind join that made ``min_nodes`` or ``max_nodes`` participants does what
        the join would have done (only when joins ran at once: see the module docstring)."""
        if not _blind_join(request, plan):
            return
        count_index = len(responses) - 1
        count = int(range_of(responses[count_index]).get("count", 0))
        rules = plan.rules
        if count == rules.min_nodes or count >= rules.max_nodes:
            status = Request(Op.STATUS, request.node, rules)
            await self.apply(status, now, epoch)


def _blind_join(request: Request, plan: Plan) -> bool:
    """Whether ``plan`` is a join decided without the participants' count (its write
    counts them: the count it made, see :meth:`RunPort._follow_up`); no other write
    counts them (etcd counts a write's ranges in its apply loop, O(N) each: at 1,024
    nodes, the writes of nodes whose round lost a member held that loop up long enough
    for leases to run out)."""
    return request.op is Op.JOIN and "p" in plan.put and not plan.guard
