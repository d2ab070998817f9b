"""A node's requests to its backend: join until the round completes, and what it publishes.

How it works: :class:`NodeRequests` holds what one node knows of its run (its identity, the
last status, its round) and sends its requests: each is applied by the backend with the
state machine's semantics and answered with a constant-size reply, whose status it keeps
(setting ``_news`` when a field that watchers act on changed). Joining is a loop: ask; the
answer is *finished*, an error, or *wait*: then wait (:mod:`._waits`) until the run's status
changes, the last call ends, or a keep-alive is due, and ask again. Every transition, wait
and failed call is published as a typed event (:mod:`aelastic.core.events`) into
:attr:`NodeRequests.hub`; calls into the backend run under :meth:`NodeRequests.reporting`,
so the backend's own retries reach the same hub with this run, node and round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ..core.clock import SYSTEM_CLOCK, Clock, SystemClock
from ..core.errors import RendezvousConnectionError, RendezvousError, typed
from ..core.events import (
    BackendError,
    Event,
    EventHub,
    EventStream,
    RendezvousEvent,
    RendezvousWaiting,
    reporting,
)
from ..core.health import NodeReport
from ..core.params import RendezvousSettings, free_port
from ..core.protocol import RendezvousBackend
from ..core.race import first_of, wait_within
from ..core.state import NodeDesc, Op, Outcome, Placement, Reply, Request, Status, Transition
from ._heartbeat import Heartbeats
from ._refusals import join_refused, join_unanswered
from ._waits import IdWait, StatusWaits

__all__ = ["HandlerStats", "NodeRequests"]

log = logging.getLogger("aelastic.rendezvous")

_local_ids = itertools.count()

#: Transitions that are not published (a heartbeat, or nothing changed).
_QUIET = frozenset({Transition.NONE, Transition.KEEP_ALIVE})
#: Asked again this long after the last call's end by the backend's clock (absorbs drift).
_LATE = 0.002
#: Seconds after its deadline a join request is given up when the backend has not answered
#: it (a request sent just before the deadline still gets its answer from a backend that
#: answers at all), and that a leave then takes at most.
_UNANSWERED = 1.0
#: Other names a node takes when its own is listed under another secret, before it fails.
_RENAMES = 3


@dataclass
class HandlerStats:
    """What this handler asked of its backend, and how often it was woken."""

    requests: int = 0
    wakeups: int = 0


@dataclass(frozen=True)
class _Round:
    number: int
    rank: int
    world: int


class NodeRequests:
    """One node of a run: its requests, its join loop, its events (the handler's base).

    Args:
        backend: Where the run's state lives.
        settings: Node bounds and timeouts.
        local_addr: This node's address (default: the FQDN).
        clock: Source of time (tests inject a :class:`~aelastic.core.clock.ManualClock`).
        backend_name: Name reported by ``get_backend`` (default: the backend's).
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        settings: RendezvousSettings,
        *,
        local_addr: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        backend_name: str | None = None,
    ) -> None:
        self._backend = backend
        self._settings = settings
        self._rules = settings.rules
        self._clock = clock
        self._backend_name = backend_name or backend.name
        # A backend that holds keep-alives (HTTP) brings news with each heartbeat's answer:
        # the node needs no separate long-poll to watch its round.
        self._holds = bool(getattr(backend, "holds_keep_alive", False))
        self._node = NodeDesc(local_addr or socket.getfqdn(), os.getpid(), next(_local_ids))
        # This node's secret: sent with each of its requests, so no other client can act
        # for it (the backend keeps it from the first join). Never shown, never logged.
        self._secret = secrets.token_hex(16)
        self._status: Status | None = None
        self._round: _Round | None = None
        self._joined = False
        #: Whether this node was ever in the run, or closed it: a closed run is then over
        #: for it (``RendezvousClosedError``); a node new to a run waits for its id instead.
        self._took_part = False
        self._closed_it = False
        self._removed = False
        #: What this node's joins say of its workers, and the port they offer for the
        #: workers' bootstrap (``None``: a free one is picked at each join).
        self._profile: tuple[str, int] = ("default", 1)
        self._id_wait = IdWait(clock.monotonic())
        self._port: int | None = None
        #: Where this node's workers stand in its last completed round.
        self.placement: Placement | None = None
        #: Where this handler, its backend and an agent driving it publish their events.
        self.hub = EventHub()
        self._waits = StatusWaits(backend, clock, self.hub, self.publish)
        self._news = self._waits.news
        self._heartbeats = Heartbeats(
            self, settings, clock, self._holds, f"aelastic-heartbeat-{self._node}"
        )
        self._released = False
        self._shut_down = False
        self.stats = HandlerStats()

    @property
    def round(self) -> int | None:
        """The number of this node's current round (``None`` outside a completed round)."""
        return None if self._round is None else self._round.number

    @property
    def status(self) -> Status | None:
        """The run's status as this node last learned it."""
        return self._status

    def add_listener(self, callback: Callable[[Event], object]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event of this handler (see :attr:`hub`).

        Returns:
            A function that unsubscribes ``callback``.
        """
        return self.hub.add_listener(callback)

    def events(self) -> EventStream:
        """Subscribe now to this handler's events: ``async with handler.events() as events``
        then ``await events.get()`` (or ``async for``)."""
        return self.hub.stream()

    def publish(self, event: Event) -> None:
        """Publish ``event`` with this run, node, round and the clock's time filled in."""
        if not self.hub.listened:
            return
        round_ = event.round
        if round_ is None:
            round_ = self.round if self._status is None else self._status.round
        self.hub.emit(
            dataclasses.replace(
                event,
                at=event.at or self._clock.time(),
                run_id=self._settings.run_id,
                node=str(self._node),
                round=round_,
            )
        )

    def reporting(self) -> reporting:
        """A context manager: within it, what the backend reports (retries) is published by
        this handler (nothing is installed while nobody listens)."""
        return reporting(self.publish if self.hub.listened else None)

    # -- requests -------------------------------------------------------------------------

    async def _request(
        self,
        op: Op,
        *,
        expired: bool = False,
        finished: bool = False,
        port: int = 0,
        hold: float = 0.0,
        seen: str | None = None,
        report: NodeReport | None = None,
    ) -> Reply:
        role, local_world_size = self._profile
        request = Request(
            op,
            self._node,
            self._rules,
            expired=expired,
            finished=finished,
            port=port,
            now_ms=round(self._clock.time() * 1000),
            secret=self._secret,
            role=role,
            local_world_size=local_world_size,
            report=report,
        )
        listened = self.hub.listened
        try:
            if listened:
                with reporting(self.publish):
                    reply = await self._backend.apply(request, hold, seen)
            else:  # the common case without an agent: nothing to install
                reply = await self._backend.apply(request, hold, seen)
        except RendezvousConnectionError as exc:
            self._failed(exc)
            raise
        self.stats.requests += 1
        self._note(reply.status)
        if listened and reply.transition not in _QUIET:
            self.publish(
                RendezvousEvent(
                    op=op.value, transition=reply.transition.value, round=reply.status.round
                )
            )
        return reply

    def _failed(self, exc: RendezvousError) -> None:
        error = typed(exc)
        self.publish(BackendError(backend=self._backend_name, error=error))

    async def keep_alive(self, hold: float) -> Reply:
        """Send this node's keep-alive (the heartbeat task's request)."""
        seen = None if self._status is None else self._status.token
        return await self._request(Op.KEEP_ALIVE, hold=hold, seen=seen)

    def lost_membership(self) -> None:
        """The heartbeat learned that this node is no longer a member."""
        self._removed = True
        self._news.set()

    def _note(self, status: Status) -> None:
        old = self._status
        self._status = status
        if old is None or old.signature() != status.signature():
            self._news.set()

    def set_profile(
        self,
        role: str,
        local_world_size: int,
        port: int | None = None,
        addr: str | None = None,
    ) -> None:
        """What this node's next joins say: its workers' role and how many there are (the
        round's worker ranks are fixed from every member's), the port offered for the
        workers' bootstrap should it become rank 0 (``None``: a free one at each join), and
        the address its workers are reached at (torch's agent ``local_addr``: the node takes
        it as its address if it never joined yet, so that it is rank 0's MASTER_ADDR)."""
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be at least 1, not {local_world_size}")
        self._profile = (role, local_world_size)
        self._port = port
        if addr and addr != self._node.addr and not self._took_part:
            self._node = NodeDesc(addr, self._node.pid, self._node.local_id)

    async def _join(self, deadline: float) -> Reply:
        """Ask to join until the round completes; ``deadline`` is on the monotonic clock."""
        port = self._port or free_port()
        expired = False
        interval = self._settings.keep_alive_interval
        clock = self._clock
        renamed = 0
        while True:
            sent = clock.monotonic()
            hold = max(min(interval, deadline - sent), 0.0)
            reply = await self._join_request(deadline, expired=expired, port=port, hold=hold)
            if reply.restart_deadline:
                deadline = clock.monotonic() + self._settings.join_timeout
            outcome = reply.outcome
            if outcome is Outcome.FINISH:
                self._took_part = True
                return reply
            if outcome is Outcome.ERROR_FORBIDDEN and renamed < _RENAMES:
                renamed += 1
                self._rename()
                continue
            if outcome is not Outcome.WAIT:
                free_in = self._id_wait.free_in(reply, sent, self._took_part)
                if free_in is None or clock.monotonic() + free_in > deadline:
                    raise join_refused(self._settings, self._node, reply)
                self._publish_id_wait(reply, free_in, deadline)
                # Ask again when the id is free (or sooner, if the run's status moves).
                await self._wait_change(reply.status.token, min(free_in, interval) + _LATE)
                continue
            self._took_part = True
            if self.hub.listened:
                self._publish_wait(reply.status, deadline)
            # Ask again when the status changes, the last call ends, the join times out,
            # or a heartbeat is due (asking is this node's keep-alive): whichever is first.
            # Once it timed out, a node still told to wait is a redundant one, which waits
            # without a deadline: it asks once a heartbeat interval, as torch's does.
            due = sent + interval if expired else min(sent + interval, deadline)
            if reply.wake_at_ms is not None:
                until = (reply.wake_at_ms - reply.status.now_ms) / 1000 + _LATE
                due = min(due, clock.monotonic() + until)
            wake = due - clock.monotonic()
            if wake > 0:
                await self._wait_change(reply.status.token, wake)
            expired = clock.monotonic() > deadline

    def _publish_id_wait(self, reply: Reply, free_in: float, deadline: float) -> None:
        what = self._id_wait.waits(reply, free_in, self._settings.run_id, self._node)
        if self.hub.listened:
            self.publish(
                RendezvousWaiting(
                    round=reply.status.round,
                    join_timeout_in=max(deadline - self._clock.monotonic(), 0.0),
                    id_free_in=free_in,
                    id_wait=what,
                )
            )

    async def _join_request(self, deadline: float, **fields: Any) -> Reply:
        """A join request, given up :data:`_UNANSWERED` s after the join's ``deadline`` (on
        the monotonic clock): a backend that does not answer (a store that takes the
        connection and says nothing) holds a node no longer than its join timeout, whatever
        its read timeout. What the join may have written is then left, briefly.

        Raises:
            RendezvousConnectionError: The backend did not answer in time.
        """
        within = max(deadline - self._clock.monotonic(), 0.0) + _UNANSWERED

        async def join() -> Reply:
            return await self._request(Op.JOIN, **fields)

        if isinstance(self._clock, SystemClock):
            with contextlib.suppress(TimeoutError):
                return await wait_within(join(), within)
        else:  # a test's clock: the bound runs on it
            index, reply = await first_of(join, lambda: self._clock.sleep(within))
            if index == 0:
                return reply  # type: ignore[no-any-return]
        await self._leave_quietly(_UNANSWERED / 2)  # a store that said nothing: a short try
        raise join_unanswered(
            self._settings, self._node, self._backend_name, self._backend.endpoint
        )

    def _rename(self) -> None:
        """Take another name: this one is listed under another secret (another process of
        the same address and pid, or a client that took it once the run dropped this node);
        a node is never locked out of its run by its name."""
        old = self._node
        self._node = NodeDesc(old.addr, old.pid, next(_local_ids))
        log.warning(
            "node %s is in run '%s' under another secret (another process with this address "
            "and pid, or a client that took the name once the run dropped this node): joining "
            "as %s",
            old,
            self._settings.run_id,
            self._node,
        )

    def _publish_wait(self, status: Status, deadline: float) -> None:
        last_call = None
        if status.deadline_ms is not None and not status.complete:
            last_call = max((status.deadline_ms - status.now_ms) / 1000, 0.0)
        rules = self._rules
        self.publish(
            RendezvousWaiting(
                round=status.round,
                participants=status.waiting if status.complete else status.participants,
                min_nodes=rules.min_nodes,
                max_nodes=rules.max_nodes,
                waiting=status.complete,
                join_timeout_in=max(deadline - self._clock.monotonic(), 0.0),
                last_call_in=last_call,
            )
        )

    async def _wait_change(
        self, token: str, within: float, news: bool = False, until: asyncio.Event | None = None
    ) -> None:
        """Until the status's token moves or ``within`` seconds pass (or, with ``news``, this
        node's own requests bring news; or ``until`` is set): :class:`~._waits.StatusWaits`."""
        status = await self._waits.wait(token, within, news, until)
        if status is not None:
            if not news:
                self.stats.wakeups += 1
            self._note(status)

    async def _leave_quietly(self, at_most: float | None = None) -> None:
        """Leave what a cancelled or failed join joined; never raises, never hangs (one
        heartbeat timeout at most, or ``at_most`` seconds: a node told to stop must not wait
        for a store that is gone)."""
        timeout = max(min(self._settings.heartbeat_timeout, self._settings.close_timeout), 1.0)
        if at_most is not None:
            timeout = min(timeout, at_most)
        with contextlib.suppress(Exception), anyio.move_on_after(timeout, shield=True):
            await self._request(Op.LEAVE)
