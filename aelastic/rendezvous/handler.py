"""The async rendezvous handler: sends this node's requests and waits for round transitions.

How it works: the backend applies the state machine (``core.machine.step``) to the run's
state atomically and answers each request with a constant-size reply. Joining is a loop
(:mod:`._node`): ask to join; the answer is *finished* (with this node's rank, the world
size and where rank 0's workers bootstrap), an error, or *wait*: then wait until the run's
status changes (the backend wakes the waiter), the last call ends, or a heartbeat is due,
and ask again. After a round completes, a heartbeat task (:mod:`._heartbeat`) keeps this
node alive and prunes silent members. :meth:`watch` returns when the round's group changed
(a node waiting, a member lost or finished, this node removed, the run closed), woken by
the backend's notification, which only round transitions send.

The handler publishes typed events (:mod:`aelastic.core.events`) into its :attr:`hub`: the
transitions its requests made, each wait for a round (with the counts and deadlines), and
what its backend reports while it calls it (retries, errors). It reads time and sleeps only
through its :class:`~aelastic.core.clock.Clock`.
"""

from __future__ import annotations

import logging

import anyio

from ..core.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
    reason,
)
from ..core.events import RendezvousEvent
from ..core.health import JobHealth, NodeReport
from ..core.params import RendezvousInfo, RendezvousSettings, RendezvousStoreInfo
from ..core.protocol import DepartureReporter, RendezvousBackend
from ..core.race import first_of
from ..core.state import NodeDesc, Op, Transition
from ..core.store import Store
from ..core.view import MembershipView, view_of
from ._node import HandlerStats, NodeRequests, _Round

__all__ = ["DynamicRendezvousHandler", "HandlerStats", "RendezvousEvent"]


log = logging.getLogger("aelastic.rendezvous")

#: Longest single wait for a change; a safety net, not a poll period.
_MAX_WAIT = 300.0


class DynamicRendezvousHandler(NodeRequests):
    """Async rendezvous with torch's ``DynamicRendezvousHandler`` semantics.

    Args:
        backend: Where the run's state lives.
        settings: Node bounds and timeouts.
        local_addr: This node's address (default: the FQDN).
        clock: Source of time (tests inject a :class:`~aelastic.core.clock.ManualClock`).
        backend_name: Name reported by :meth:`get_backend` (default: the backend's).
    """

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

    @property
    def keep_alive_age(self) -> float | None:
        """Seconds since this node's last keep-alive went out (since its round completed,
        before the first), or ``None`` while it beats for no round."""
        sent = self._heartbeats.sent_at
        return None if sent is None else max(self._clock.monotonic() - sent, 0.0)

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
            workers bootstrap (rank 0's address and a port free on its host; rank 0 also
            publishes them as ``MASTER_ADDR`` and ``MASTER_PORT`` in the round's store,
            as torch's ``RendezvousStoreInfo.build`` does). Ranks are in torch's order:
            the sorted node descriptors (address, then pid, then local id).

        Raises:
            RendezvousClosedError: The rendezvous is closed.
            RendezvousTimeoutError: The round did not complete within ``join_timeout``.
            RendezvousGracefulExitError: The node was redundant when the run closed.
            RendezvousConnectionError: The backend could not be reached.
            RendezvousStateError: The stored state is foreign, corrupt or of another version.
        """
        if self._shut_down or self._closed_it:
            raise RendezvousClosedError(f"The rendezvous '{self.get_run_id()}' is closed.")
        await self._heartbeats.stop()
        self._round, self._removed, self.placement = None, False, None
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
        self.placement = reply.placement
        self._heartbeats.start()
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
        if reply.rank == 0:
            # torch's RendezvousStoreInfo.build: rank 0 publishes where the workers bootstrap
            # (every member also has it from its own join's answer, so nobody waits for it).
            keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
            await store.multi_set(keys, [bootstrap.master_addr, str(bootstrap.master_port)])
        return RendezvousInfo(store, reply.rank, status.world, bootstrap)

    async def is_closed(self) -> bool:
        """Whether the rendezvous has been closed."""
        if self._shut_down:
            return True
        return (await self._request(Op.STATUS)).status.closed

    async def set_closed(self) -> None:
        """Mark the rendezvous as closed, for every node: later joins fail with
        ``RendezvousClosedError`` and nodes waiting for a round are released with it. Any
        handler of the run may close it (a member, one still waiting, or one that never
        joined), as in torch; closing a closed run changes nothing."""
        if not self._shut_down:
            await self._close()

    async def _close(self) -> None:
        """Close the run, within ``close_timeout`` and one read of the store (torch's bound).

        Raises:
            RendezvousTimeoutError: The store took longer (the run may be closed or not).
            RendezvousConnectionError: The store could not be reached.
        """
        settings = self._settings
        limit = settings.close_timeout + settings.read_timeout
        with anyio.move_on_after(limit):
            await self._request(Op.CLOSE)
            self._closed_it = self._took_part = True
            return
        raise RendezvousTimeoutError(
            f"closing the rendezvous '{self.get_run_id()}' did not complete within "
            f"{limit:g} s (close_timeout {settings.close_timeout:g} s + read_timeout "
            f"{settings.read_timeout:g} s)"
        )

    async def num_nodes_waiting(self) -> int:
        """Number of nodes waiting to join the next round (late arrivals)."""
        if self._shut_down:
            return 0
        return (await self._request(Op.STATUS)).status.waiting

    async def shutdown(self) -> bool:
        """Stop heartbeats, close the rendezvous for every node, leave it, release the
        backend (once the last node has left, the closed run's id can be used again by a
        new job two heartbeat windows later).

        Calling it again is harmless (``True``); afterwards the handler still answers:
        closed, nobody waiting, and ``next_rendezvous`` raises ``RendezvousClosedError``.

        Returns:
            ``True`` if the rendezvous is closed, ``False`` if closing failed.
        """
        if self._shut_down:
            return True
        await self._heartbeats.stop()
        try:
            await self._close()
            if self._joined:  # this node is done too: its run empties as its nodes stop
                self._joined = False
                await self._leave_quietly()
        except RendezvousError as exc:
            log.warning(
                "node %s could not close '%s': %s", self._node, self.get_run_id(), reason(exc)
            )
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
        await self._heartbeats.stop()
        self._round, self._joined = None, False
        if not self._released:
            await self._request(Op.LEAVE, finished=finished)

    async def report(self, report: NodeReport) -> bool:
        """Report this node's own workers' failure in its current round, or set its own
        host aside (the job's health, :mod:`aelastic.core.health`): the rendezvous fills in
        who, where and the round. Whether the run took it (``False``: this node is in no
        complete round any more, or its host was set aside already).

        Raises:
            RendezvousConnectionError: The backend could not be reached.
        """
        reply = await self._request(Op.REPORT, report=report)
        return reply.transition is Transition.REPORT

    async def mark_done(self) -> bool:
        """Say that this node's workers succeeded in its current round (the exit barrier
        passes once every member did); whether the run took it.

        Raises:
            RendezvousConnectionError: The backend could not be reached.
        """
        reply = await self._request(Op.DONE)
        return reply.transition is Transition.MARK_DONE

    async def health(self) -> JobHealth | None:
        """The job's health as the rendezvous keeps it (``None``: the run has no state).

        Raises:
            RendezvousConnectionError: The backend could not be reached.
        """
        return await self._backend.health()

    async def report_departures(self) -> int:
        """Ask the backend which members' connections ended and report them (a worker's
        collective broke: a peer may be gone). Backends that cannot tell (etcd, memory) do
        nothing: the heartbeat window decides.

        Returns:
            How many members these reports made lost (``0`` on a backend failure, logged).
        """
        backend = self._backend
        if self._released or not isinstance(backend, DepartureReporter):
            return 0
        try:
            return await backend.report_departures(self._node)
        except RendezvousError as exc:
            log.warning("checking which members' connections ended failed: %s", reason(exc))
            return 0

    async def aclose(self) -> None:
        """Stop heartbeats and release the backend (the shared state is left as it is)."""
        await self._heartbeats.stop()
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
            beats = self._heartbeats
            beats.holding_changed.clear()
            if self._holds and beats.holding:  # the held heartbeats bring the news
                await first_of(
                    self._news.wait,
                    beats.holding_changed.wait,
                    lambda: self._clock.sleep(_MAX_WAIT),
                )
            else:  # ask the backend, until a held beat is out (if the backend holds them)
                until = beats.holding_changed if self._holds else None
                await self._wait_change(token, _MAX_WAIT, news=True, until=until)
            self.stats.wakeups += 1
            delay = woke_at + min_interval - self._clock.monotonic()
            if delay > 0:
                await self._clock.sleep(delay)

    def _view(self, round_: _Round) -> MembershipView:
        assert self._status is not None
        return view_of(self._status, self._node, round_.number, self._removed)
