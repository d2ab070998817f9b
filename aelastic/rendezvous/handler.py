"""The async rendezvous handler: sends this node's requests and waits for round transitions.

How it works: the backend applies the state machine (``core.machine.step``) to the run's
state atomically and answers each request with a constant-size reply. Joining is a loop:
ask to join; the answer is *finished* (with this node's rank, the world size and where rank
0's workers bootstrap), an error, or *wait*: then wait until the run's status changes (the
backend wakes the waiter), the last call ends, or a heartbeat is due, and ask again. After a
round completes, a heartbeat task sends this node's keep-alive once an interval; its answer
also tells when the oldest heartbeat of the run expires, and the task asks the backend to
prune a silent node at that moment. :meth:`watch` returns when the round's group changed (a
node waiting, a member lost or finished, this node removed, the run closed), woken by the
backend's notification, which only round transitions send.

The handler reads time and sleeps only through its :class:`~aelastic.core.clock.Clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from ..core.clock import SYSTEM_CLOCK, Clock, SystemClock
from ..core.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from ..core.params import RendezvousInfo, RendezvousSettings, RendezvousStoreInfo
from ..core.protocol import RendezvousBackend
from ..core.state import NodeDesc, Op, Outcome, Reply, Request, Status, Transition
from ..core.store import Store
from ..core.view import MembershipView, view_of

__all__ = ["DynamicRendezvousHandler", "HandlerStats", "RendezvousEvent"]

log = logging.getLogger("aelastic.rendezvous")

_local_ids = itertools.count()

#: Longest single wait for a change; a safety net, not a poll period.
_MAX_WAIT = 300.0
#: Asked again this long after the last call's end by the backend's clock (absorbs drift).
_LATE = 0.002


@dataclass(frozen=True)
class RendezvousEvent:
    """A state transition this handler made (for logs and metrics hooks)."""

    run_id: str
    node: NodeDesc
    op: str
    transition: str
    round: int
    at: float


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


class DynamicRendezvousHandler:
    """Async rendezvous with torch's ``DynamicRendezvousHandler`` semantics.

    Args:
        backend: Where the run's state lives.
        settings: Node bounds and timeouts.
        local_addr: This node's address (default: the FQDN).
        clock: Source of time (tests inject a :class:`~aelastic.core.clock.ManualClock`).
        backend_name: Name reported by :meth:`get_backend` (default: the backend's).
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
        self._status: Status | None = None
        self._round: _Round | None = None
        self._joined = False
        self._removed = False
        self._news = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._listeners: list[asyncio.Queue[RendezvousEvent]] = []
        self._released = False
        self._shut_down = False
        self.stats = HandlerStats()

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self._settings.run_id!r}, node={self._node}, "
            f"backend={self._backend_name!r})"
        )

    # -- torch's RendezvousHandler API ----------------------------------------------------

    @property
    def settings(self) -> RendezvousSettings:
        """The settings of this rendezvous."""
        return self._settings

    @property
    def node(self) -> NodeDesc:
        """This node's identity in the run's state."""
        return self._node

    @property
    def backend(self) -> RendezvousBackend:
        """The backend this handler drives."""
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        """Always ``False``: workers bootstrap their own store at MASTER_ADDR:MASTER_PORT."""
        return False

    def get_backend(self) -> str:
        """Name of the rendezvous backend."""
        return self._backend_name

    def get_run_id(self) -> str:
        """The run id of the rendezvous."""
        return self._settings.run_id

    async def next_rendezvous(self) -> RendezvousInfo[Store]:
        """Leave the previous round (if any) and join the next one.

        Returns:
            The store of the round, this node's rank, the world size and where the
            workers bootstrap (rank 0's address and a port free on its host).

        Raises:
            RendezvousClosedError: The rendezvous is closed.
            RendezvousTimeoutError: The round did not complete within ``join_timeout``.
            RendezvousGracefulExitError: The node was redundant when the run closed.
            RendezvousConnectionError: The backend could not be reached.
            RendezvousStateError: The stored state is foreign, corrupt or of another version.
        """
        if self._shut_down:
            raise RendezvousClosedError(f"The rendezvous '{self.get_run_id()}' is closed.")
        await self._stop_heartbeats()
        self._round, self._removed = None, False
        started = self._clock.monotonic()
        try:
            if self._joined:
                await self._request(Op.LEAVE)
            self._joined = True
            reply = await self._join(started + self._settings.join_timeout)
        except BaseException as exc:
            # Cancelled (or broken) half-way: leave what was joined. A rendezvous error
            # already left the state as it should be (the machine removed this node).
            if not isinstance(exc, RendezvousError | ValueError):
                await self._leave_quietly()
            raise
        status = reply.status
        assert reply.rank is not None
        self._round = _Round(status.round, reply.rank, status.world)
        self._start_heartbeats()
        log.info(
            "node %s joined round %d of '%s' as rank %d of %d in %.3f s",
            self._node,
            status.round,
            self._settings.run_id,
            reply.rank,
            status.world,
            self._clock.monotonic() - started,
        )
        bootstrap = RendezvousStoreInfo(
            reply.master_addr or self._node.addr, reply.master_port or 0
        )
        store = Store(self._backend, prefix=f"r{status.round}/")
        return RendezvousInfo(store, reply.rank, status.world, bootstrap)

    async def is_closed(self) -> bool:
        """Whether the rendezvous has been closed."""
        if self._shut_down:
            return True
        return (await self._request(Op.STATUS)).status.closed

    async def set_closed(self) -> None:
        """Mark the rendezvous as closed: later joins fail with ``RendezvousClosedError``."""
        if not self._shut_down:
            await self._request(Op.CLOSE)

    async def num_nodes_waiting(self) -> int:
        """Number of nodes waiting to join the next round (late arrivals)."""
        if self._shut_down:
            return 0
        return (await self._request(Op.STATUS)).status.waiting

    async def shutdown(self) -> bool:
        """Stop heartbeats, close the rendezvous for every node, release the backend.

        Calling it again is harmless (``True``); afterwards the handler still answers:
        closed, nobody waiting, and ``next_rendezvous`` raises ``RendezvousClosedError``.

        Returns:
            ``True`` if the rendezvous is closed, ``False`` if closing failed.
        """
        if self._shut_down:
            return True
        await self._stop_heartbeats()
        try:
            await self._request(Op.CLOSE)
        except RendezvousError as exc:
            log.warning("node %s could not close '%s': %s", self._node, self.get_run_id(), exc)
            return False
        finally:
            await self.aclose()
        self._shut_down = True
        return True

    # -- aelastic extensions --------------------------------------------------------------

    async def leave(self, finished: bool = False) -> None:
        """Stop heartbeats and leave the rendezvous without closing it for the others.

        Args:
            finished: This node's workers succeeded: the other members need not act on
                its departure.
        """
        await self._stop_heartbeats()
        self._round, self._joined = None, False
        if not self._released:
            await self._request(Op.LEAVE, finished=finished)

    async def aclose(self) -> None:
        """Stop heartbeats and release the backend (the shared state is left as it is)."""
        await self._stop_heartbeats()
        if not self._released:
            self._released = True
            await self._backend.aclose()

    async def __aenter__(self) -> DynamicRendezvousHandler:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def watch(
        self, min_interval: float = 0.0, since: MembershipView | None = None
    ) -> MembershipView:
        """Wait until the group of the last completed round changes.

        Returns when a node waits to join (``num_nodes_waiting() > 0``), a member of the
        round left or went silent for the heartbeat window, this node was removed, or the
        run closed. Woken by the backend's notification of the change (heartbeats notify
        nobody), or by this node's own heartbeat learning that it was removed.

        Args:
            min_interval: Least time between two wake-ups (debounce).
            since: A view returned before: return only when the group looks different
                (lets a caller that chose to ignore a change wait for the next one).

        Raises:
            RendezvousError: No round has completed (call ``next_rendezvous`` first).
        """
        round_ = self._round
        if round_ is None:
            raise RendezvousError("watch() needs a completed round: call next_rendezvous()")
        while True:
            current = self._view(round_)
            if current.changed and current != since:
                return current
            woke_at = self._clock.monotonic()
            self._news.clear()
            status = self._status
            token = "" if status is None else status.token
            news: asyncio.Future[Any] = asyncio.ensure_future(self._news.wait())
            beating = self._heartbeat_task is not None and not self._heartbeat_task.done()
            if self._holds and beating:  # the held heartbeats bring the news
                change: asyncio.Future[Status | None] = asyncio.ensure_future(
                    self._quiet(_MAX_WAIT)
                )
            else:
                change = asyncio.ensure_future(self._backend.wait_for_change(token, _MAX_WAIT))
            try:
                await asyncio.wait([news, change], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (news, change):
                    task.cancel()
                await asyncio.gather(news, change, return_exceptions=True)
            if change.done() and not change.cancelled():
                error = change.exception()
                if error is not None:
                    raise error
                status = change.result()
                if status is not None:
                    self._note(status)
            self.stats.wakeups += 1
            delay = woke_at + min_interval - self._clock.monotonic()
            if delay > 0:
                await self._clock.sleep(delay)

    async def _quiet(self, seconds: float) -> Status | None:
        await self._clock.sleep(seconds)
        return None

    def _view(self, round_: _Round) -> MembershipView:
        assert self._status is not None
        return view_of(self._status, self._node, round_.number, self._removed)

    @contextlib.asynccontextmanager
    async def events(self) -> AsyncIterator[asyncio.Queue[RendezvousEvent]]:
        """Subscribe to this handler's state transitions for the duration of the block."""
        queue: asyncio.Queue[RendezvousEvent] = asyncio.Queue()
        self._listeners.append(queue)
        try:
            yield queue
        finally:
            self._listeners.remove(queue)

    # -- requests -------------------------------------------------------------------------

    async def _request(
        self,
        op: Op,
        *,
        expired: bool = False,
        finished: bool = False,
        port: int = 0,
        hold: float = 0.0,
    ) -> Reply:
        request = Request(
            op,
            self._node,
            self._rules,
            expired=expired,
            finished=finished,
            port=port,
            now_ms=round(self._clock.time() * 1000),
        )
        reply = await self._backend.apply(request, hold)
        self.stats.requests += 1
        self._note(reply.status)
        if reply.transition not in (Transition.NONE, Transition.KEEP_ALIVE):
            self._emit(op, reply)
        return reply

    def _note(self, status: Status) -> None:
        old = self._status
        self._status = status
        if old is None or old.signature() != status.signature():
            self._news.set()

    async def _join(self, deadline: float) -> Reply:
        """Ask to join until the round completes; ``deadline`` is on the monotonic clock."""
        port = _free_port()
        expired = False
        interval = self._settings.keep_alive_interval
        clock = self._clock
        while True:
            sent = clock.monotonic()
            hold = max(min(interval, deadline - sent), 0.0)
            reply = await self._request(Op.JOIN, expired=expired, port=port, hold=hold)
            if reply.restart_deadline:
                deadline = clock.monotonic() + self._settings.join_timeout
            outcome = reply.outcome
            if outcome is Outcome.FINISH:
                return reply
            if outcome is not Outcome.WAIT:
                raise self._error(outcome)
            # Ask again when the status changes, the last call ends, the join times out,
            # or a heartbeat is due (asking is this node's keep-alive): whichever is first.
            due = min(sent + interval, deadline)
            if reply.wake_at_ms is not None:
                until = (reply.wake_at_ms - reply.status.now_ms) / 1000 + _LATE
                due = min(due, clock.monotonic() + until)
            wake = due - clock.monotonic()
            if wake > 0:
                await self._wait_change(reply.status.token, wake)
            expired = clock.monotonic() > deadline

    async def _wait_change(self, token: str, within: float) -> None:
        if isinstance(self._clock, SystemClock):
            status = await self._backend.wait_for_change(token, within)
        else:  # a test's clock: the timeout runs on it, the change on the backend
            change = asyncio.ensure_future(self._backend.wait_for_change(token, None))
            sleep = asyncio.ensure_future(self._clock.sleep(within))
            try:
                await asyncio.wait({change, sleep}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (change, sleep):
                    task.cancel()
                await asyncio.gather(change, sleep, return_exceptions=True)
            status = None
            if change.done() and not change.cancelled():
                error = change.exception()
                if error is not None:
                    raise error
                status = change.result()
        if status is not None:
            self.stats.wakeups += 1
            self._note(status)

    def _error(self, outcome: Outcome) -> RendezvousError:
        run_id = self._settings.run_id
        if outcome is Outcome.ERROR_CLOSED:
            return RendezvousClosedError(f"The rendezvous '{run_id}' is closed.")
        if outcome is Outcome.GRACEFUL_EXIT:
            return RendezvousGracefulExitError(
                f"The rendezvous '{run_id}' is closed, terminating pending rendezvous."
            )
        return RendezvousTimeoutError(
            f"The rendezvous '{run_id}' did not complete on time for node {self._node}."
        )

    def _emit(self, op: Op, reply: Reply) -> None:
        if not self._listeners:
            return
        event = RendezvousEvent(
            self._settings.run_id,
            self._node,
            op.value,
            reply.transition.value,
            reply.status.round,
            self._clock.time(),
        )
        for queue in self._listeners:
            queue.put_nowait(event)

    async def _leave_quietly(self) -> None:
        """Leave what a cancelled or failed join joined; never raises, never hangs."""
        timeout = self._settings.close_timeout
        with contextlib.suppress(Exception), anyio.move_on_after(timeout, shield=True):
            await self._request(Op.LEAVE)

    # -- heartbeats -----------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        self._heartbeat_task = asyncio.get_running_loop().create_task(
            self._heartbeats(), name=f"aelastic-heartbeat-{self._node}"
        )

    async def _stop_heartbeats(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is None or task.done():
            return
        task.cancel()
        if task.get_loop() is asyncio.get_running_loop():
            # Not `await task` under suppress(CancelledError): that would also swallow a
            # cancellation of the caller arriving meanwhile (a stopping agent would go on).
            await asyncio.wait({task})
            if not task.cancelled():
                task.result()

    async def _heartbeats(self) -> None:
        """Beat once an interval; prune a silent node the moment its window ends.

        The first beat comes at a random point of the first interval: the members of a
        round all completed at the same moment, and beating in step would send the backend
        every heartbeat of the job at once, every interval.
        """
        interval = self._settings.keep_alive_interval
        window = self._settings.heartbeat_window
        clock = self._clock
        next_beat = clock.monotonic() + interval * random.uniform(0.05, 1.0)
        check_at: float | None = None
        seen = ""  # the status token when the check was planned
        while True:
            checking = check_at is not None and check_at < next_beat
            wake = check_at if checking and check_at is not None else next_beat
            await clock.sleep(wake - clock.monotonic())
            status = self._status
            if checking and status is not None and status.token != seen:
                check_at = None  # news came first (another survivor pruned): no need
                continue
            asked = clock.monotonic()
            # Held (HTTP): the answer comes when the status moves or the next beat is due.
            hold = 0.0
            if self._holds:
                hold = interval if check_at is None else max(check_at - asked, 0.0)
            try:
                # anyio's deadline, not asyncio.wait_for: on Python 3.11 that can swallow
                # a cancellation arriving as the beat completes, and the loop never ends.
                with anyio.fail_after(self._settings.heartbeat_timeout + hold):
                    reply = await self._request(Op.KEEP_ALIVE, hold=hold)
            except (RendezvousError, TimeoutError) as exc:
                log.warning("node %s failed to send a heartbeat: %s", self._node, exc)
                next_beat, check_at = asked + min(interval, 1.0), None
                continue
            if not reply.known:  # pruned (silent too long) or removed: the round is lost
                self._removed = True
                self._news.set()
                return
            next_beat, check_at = asked + interval, None
            if hold:
                # Held as long as it could be: the next beat goes at once and carries on
                # watching. Brought early by news, every member of the job is answered at
                # once: the next beats spread over a little while (this one is fresh), or
                # they would all come back while the server still sends the news.
                now = clock.monotonic()
                early = now < asked + hold - 0.05
                next_beat = now + (random.uniform(0.0, min(0.5, interval / 2)) if early else 0.0)
            oldest = reply.oldest_beat_ms
            if oldest is not None:
                # The oldest heartbeat's expiry, by the backend's clock, then a little
                # spread so that many survivors do not all ask at once.
                expires = asked + (oldest - reply.status.now_ms) / 1000 + window
                expires += random.uniform(0.0, min(0.25, interval / 4))
                if expires < next_beat:
                    check_at, seen = max(expires, asked), reply.status.token
