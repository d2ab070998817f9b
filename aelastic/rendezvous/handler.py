"""The async rendezvous handler: drives the pure core over a backend.

How it works: every operation is the same loop. Read the state, ask ``core.step`` what to
do, and either compare-and-set the state it returns (a lost race just means deciding again
on what the backend answered), wait for the state to change (or for the core's own wake-up
time), or finish. After a round completes, a heartbeat task keeps this node alive in the
state, and :meth:`watch` lets the agent learn, without polling, that the group changed
(a node waiting, a peer gone or dead, the run closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..backends.base import NO_STATE, RendezvousBackend, Token
from ..store import Store
from . import core
from .api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from .clock import SYSTEM_CLOCK, Clock
from .core import MembershipView, Op, Outcome
from .state import NodeDesc, RendezvousState, decode_state, encode_state

__all__ = ["DynamicRendezvousHandler", "RendezvousEvent"]

log = logging.getLogger("aelastic.rendezvous")

_local_ids = itertools.count()

#: Longest single wait for a change; a safety net, not a poll period.
_MAX_WAIT = 30.0

#: Writes one operation may make without waiting; more means the core does not settle.
_MAX_WRITES = 16


@dataclass(frozen=True)
class RendezvousEvent:
    """A state transition this handler made (for logs and metrics hooks)."""

    run_id: str
    node: NodeDesc
    op: str
    transition: str
    round: int
    at: float


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


class DynamicRendezvousHandler:
    """Async rendezvous with torch's ``DynamicRendezvousHandler`` semantics.

    Args:
        backend: Where the shared state lives.
        settings: Node bounds and timeouts.
        local_addr: This node's address (default: the FQDN).
        clock: Source of time (tests inject a :class:`~aelastic.rendezvous.clock.ManualClock`).
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
        self._clock = clock
        self._backend_name = backend_name or backend.name
        self._node = NodeDesc(local_addr or socket.getfqdn(), os.getpid(), next(_local_ids))
        self._state: RendezvousState | None = None
        self._token: Token = NO_STATE
        self._round: int | None = None
        self._members: frozenset[NodeDesc] = frozenset()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._listeners: list[asyncio.Queue[RendezvousEvent]] = []
        self._closed = False

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
        """This node's identity in the shared state."""
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
            workers bootstrap (rank 0's address and a free port).

        Raises:
            RendezvousClosedError: The rendezvous is closed.
            RendezvousTimeoutError: The round did not complete within ``join_timeout``.
            RendezvousGracefulExitError: The node was redundant when the run closed.
            RendezvousConnectionError: The backend could not be reached.
            RendezvousStateError: The stored state is corrupt or foreign.
        """
        await self._stop_heartbeats()
        self._round = None
        self._members = frozenset()
        deadline = self._clock.monotonic() + self._settings.join_timeout
        started = self._clock.monotonic()
        try:
            await self._run(Op.LEAVE, deadline)
            state = await self._run(Op.JOIN, deadline)
            rank = state.participants[self._node]
            world_size = len(state.participants)
            store = Store(self._backend, prefix=f"r{state.round}/")
            bootstrap = await self._bootstrap(rank, store)
        except BaseException as exc:
            # Cancelled (or broken) half-way: leave what was joined. A rendezvous error
            # already left the state as it should be (the core removed this node).
            if not isinstance(exc, RendezvousError | ValueError):
                await self._leave_quietly()
            raise
        self._round = state.round
        self._members = frozenset(state.participants)
        self._start_heartbeats()
        log.info(
            "node %s joined round %d of '%s' as rank %d of %d in %.3f s",
            self._node,
            state.round,
            self._settings.run_id,
            rank,
            world_size,
            self._clock.monotonic() - started,
        )
        return RendezvousInfo(store, rank, world_size, bootstrap)

    async def is_closed(self) -> bool:
        """Whether the rendezvous has been closed."""
        state, _ = await self._read()
        return state is not None and state.closed

    async def set_closed(self) -> None:
        """Mark the rendezvous as closed: later joins fail with ``RendezvousClosedError``."""
        await self._run(Op.CLOSE, self._clock.monotonic() + self._settings.close_timeout)

    async def num_nodes_waiting(self) -> int:
        """Number of nodes waiting to join the next round (late arrivals)."""
        state, _ = await self._read()
        if state is None:
            return 0
        return len(core.prune(state, self._settings, self._clock.time()).wait_list)

    async def shutdown(self) -> bool:
        """Stop heartbeats, close the rendezvous for every node, release the backend.

        Returns:
            ``True`` if the rendezvous was closed, ``False`` if closing failed.
        """
        await self._stop_heartbeats()
        try:
            await self.set_closed()
            return True
        except RendezvousError as exc:
            log.warning("node %s could not close '%s': %s", self._node, self.get_run_id(), exc)
            return False
        finally:
            await self.aclose()

    # -- aelastic extensions --------------------------------------------------------------

    async def leave(self) -> None:
        """Stop heartbeats and leave the rendezvous without closing it for the others."""
        await self._stop_heartbeats()
        self._round = None
        await self._run(Op.LEAVE, self._clock.monotonic() + self._settings.close_timeout)

    async def aclose(self) -> None:
        """Stop heartbeats and release the backend (the shared state is left as it is)."""
        await self._stop_heartbeats()
        if not self._closed:
            self._closed = True
            await self._backend.aclose()

    async def __aenter__(self) -> DynamicRendezvousHandler:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def watch(
        self, min_interval: float = 0.05, since: MembershipView | None = None
    ) -> MembershipView:
        """Wait until the group of the last completed round changes.

        Returns when a node waits to join (``num_nodes_waiting() > 0``), a member of the
        round left or went silent for the heartbeat window, this node was removed, or the
        run closed. Woken by the backend on every change; a change after a quiet spell is
        read at once, and reads are at least ``min_interval`` seconds apart. Wakes by itself
        when a member's heartbeat would expire.

        Args:
            min_interval: Least time between two reads of the state.
            since: A view returned before: return only when the group looks different
                (lets a caller that chose to ignore a change wait for the next one).

        Raises:
            RendezvousError: No round has completed (call ``next_rendezvous`` first).
        """
        if self._round is None:
            raise RendezvousError("watch() needs a completed round: call next_rendezvous()")
        while True:
            read_at = self._clock.monotonic()
            state, token = await self._read()
            now = self._clock.time()
            current = core.view(state, self._node, self._members, self._round, self._settings, now)
            if current.changed and current != since:
                return current
            expiry = core.member_expiry(state, self._members - current.lost, self._settings)
            timeout = _MAX_WAIT if expiry is None else max(expiry - now, 0.0) + 0.01
            await self._backend.wait_for_change(token, min(timeout, _MAX_WAIT))
            delay = read_at + min_interval - self._clock.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    @contextlib.asynccontextmanager
    async def events(self) -> AsyncIterator[asyncio.Queue[RendezvousEvent]]:
        """Subscribe to this handler's state transitions for the duration of the block."""
        queue: asyncio.Queue[RendezvousEvent] = asyncio.Queue()
        self._listeners.append(queue)
        try:
            yield queue
        finally:
            self._listeners.remove(queue)

    # -- the loop -------------------------------------------------------------------------

    async def _read(self) -> tuple[RendezvousState | None, Token]:
        data, token = await self._backend.read()
        self._remember(data, token)
        return self._state, self._token

    def _remember(self, data: bytes | None, token: Token) -> None:
        if token != self._token or (data is None) != (self._state is None):
            self._state = None if data is None else decode_state(data)
            self._token = token

    async def _run(self, op: Op, deadline: float) -> RendezvousState:
        """Carry out ``op`` until it finishes; ``deadline`` is on the monotonic clock."""
        state, token = await self._read()
        writes = 0
        while True:
            now = self._clock.time()
            wall_deadline = now + (deadline - self._clock.monotonic())
            result = core.step(op, state, self._node, self._settings, now, wall_deadline)
            outcome = result.outcome
            if outcome is Outcome.WRITE:
                assert result.state is not None
                written, data, token = await self._backend.compare_and_set(
                    encode_state(result.state), token
                )
                if written:
                    writes += 1
                    if writes > _MAX_WRITES:
                        raise RendezvousError(
                            f"{op.value} did not settle after {_MAX_WRITES} writes "
                            "(a bug in aelastic's core)"
                        )
                    self._state, self._token = result.state, token
                    self._emit(op, result)
                    if result.restart_deadline:
                        deadline = self._clock.monotonic() + self._settings.join_timeout
                else:
                    self._remember(data, token)
                state, token = self._state, self._token
            elif outcome is Outcome.WAIT:
                writes = 0
                wake = _MAX_WAIT if result.wake_at is None else result.wake_at - now
                await self._backend.wait_for_change(token, min(max(wake, 0.0), _MAX_WAIT))
                state, token = await self._read()
            elif outcome is Outcome.FINISH:
                assert state is not None or op is not Op.JOIN
                return state if state is not None else RendezvousState()
            else:
                raise self._error(outcome)

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

    def _emit(self, op: Op, result: core.Step) -> None:
        if not self._listeners or result.transition is None or result.state is None:
            return
        event = RendezvousEvent(
            self._settings.run_id,
            self._node,
            op.value,
            result.transition.value,
            result.state.round,
            time.time(),
        )
        for queue in self._listeners:
            queue.put_nowait(event)

    async def _leave_quietly(self) -> None:
        """Leave what a cancelled or failed join joined; never raises, never hangs."""
        deadline = self._clock.monotonic() + self._settings.close_timeout
        with contextlib.suppress(Exception):
            await asyncio.shield(
                asyncio.wait_for(self._run(Op.LEAVE, deadline), self._settings.close_timeout)
            )

    async def _bootstrap(self, rank: int, store: Store) -> RendezvousStoreInfo:
        key_addr = RendezvousStoreInfo.MASTER_ADDR_KEY
        key_port = RendezvousStoreInfo.MASTER_PORT_KEY
        if rank == 0:
            info = RendezvousStoreInfo(self._node.addr, _free_port())
            await asyncio.gather(
                store.set(key_addr, info.master_addr), store.set(key_port, str(info.master_port))
            )
            return info
        addr, port = await store.multi_get([key_addr, key_port], self._settings.join_timeout)
        return RendezvousStoreInfo(addr.decode(), int(port))

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
        interval = self._settings.keep_alive_interval
        while True:
            # Due one interval after this node's last recorded heartbeat (which may be
            # older than the round: the round can complete just before a beat was due).
            state = self._state
            beat = None if state is None else state.last_heartbeats.get(self._node)
            due = interval if beat is None else beat + interval - self._clock.time()
            await asyncio.sleep(max(due, 0.0))
            try:
                deadline = self._clock.monotonic() + self._settings.heartbeat_timeout
                await self._run(Op.KEEP_ALIVE, deadline)
            except RendezvousError as exc:
                log.warning("node %s failed to send a heartbeat: %s", self._node, exc)
                await asyncio.sleep(interval)  # the state did not move: do not spin
