"""A node whose channel ended without a goodbye: told to the machine as a departure.

How it works: a rendezvous channel (:mod:`._channel`) notes the nodes whose requests it
carried (their run and secret). When the channel ends without a close frame (the peer's
socket closed: its process exited, or the connection was cut on the way) and the server did
not close it itself, :meth:`Departures.report` applies :meth:`Request.departure
<aelastic.core.state.Request.departure>` for each of them, with the secret their own
requests carried (so a client can report only nodes it proved to hold) and the moment the
channel ended. The machine (``core.machine``) answers *wait* until its grace has passed,
and the report is applied again then (one loop timer per report): a node heard from since
(a live node's client reconnects and sends its held beat again at once) stays, a silent
one is lost at once rather than after the heartbeat window. A node whose keep-alive is held
on the server meanwhile (through another connection: its client sent it again before the
server read the old channel's end) is alive too, whenever its beat came. A member whose workers'
collective broke says so on its own channel (:meth:`Departures.confirm`, its own
keep-alive: its secret proves it a member): the departures of its run still waiting are
then applied *confirmed*, without the rest of the grace, unless they are more than half of
the run's nodes (a cut of many channels at once is the network, not deaths; they keep
their grace).

Why this fact: when a process dies the kernel closes its sockets, so the server reads the
end of the channel within a round trip of the death. A network fault that cuts the
connection looks the same, which is why it only shortens the node's window to the grace
and never removes a node that speaks again within it; a fault that cuts nothing (a pause,
a stopped process, packets lost for a while) ends no channel and is left to the heartbeat
window. Requests sent over plain HTTP (no channel) are not tied to a connection and are
left to the heartbeat window too.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from ....core.machine import confirmable
from ....core.state import NodeDesc, Outcome, Request, Transition
from ..._engine import now_ms
from ._runs import RunStore

__all__ = ["Departures"]

log = logging.getLogger("aelastic.backends.http.server")

#: The nodes of one channel: (run id, node) -> the secret its requests carried.
Nodes = dict[tuple[str, NodeDesc], str]
#: A channel that ends this long (ms) after a member of its run said its collective broke
#: is confirmed at once too (the member's workers saw the peer's go first).
RECENT_MS = 1000


class Departures:
    """The departures reported by the server's channels, until the machine decides them."""

    def __init__(self, store: RunStore) -> None:
        self._store = store
        # The departures waiting for their grace: the timer, and the request it applies.
        self._timers: dict[tuple[str, NodeDesc], tuple[asyncio.TimerHandle, Request]] = {}
        # The last report of a broken collective in each run: (its time, ms; the reporter).
        self._broken: dict[str, tuple[int, NodeDesc]] = {}

    def report(self, nodes: Nodes) -> None:
        """The channel that carried ``nodes`` ended now without a goodbye (confirmed at once
        when a member of the run said its collective broke less than :data:`RECENT_MS`
        ago: the two facts came in the other order)."""
        since = now_ms()
        for (run_id, node), secret in nodes.items():
            self._apply(run_id, Request.departure(node, since, secret=secret))
        for run_id in {run_id for run_id, _ in nodes}:
            at, reporter = self._broken.get(run_id, (-RECENT_MS, None))
            if reporter is not None and since - at <= RECENT_MS:
                self._confirm(run_id, reporter)

    def confirm(self, run_id: str, reporter: NodeDesc) -> int:
        """Member ``reporter`` of ``run_id`` (its own request proved it) says its workers'
        collective broke: apply the run's waiting departures confirmed. Returns how many
        nodes that made lost."""
        now = now_ms()
        self._broken = {r: b for r, b in self._broken.items() if now - b[0] <= RECENT_MS}
        self._broken[run_id] = now, reporter
        return self._confirm(run_id, reporter)

    def _confirm(self, run_id: str, reporter: NodeDesc) -> int:
        waiting = [(key, req) for key, (_, req) in self._timers.items() if key[0] == run_id]
        waiting = [(key, req) for key, req in waiting if key[1] != reporter]
        if not waiting:
            return 0
        status = self._store.engine.status(run_id, now_ms())
        nodes = status.participants + status.waiting + status.redundant
        if not confirmable(len(waiting), nodes):
            log.info(
                "run %r: %d of its %d nodes' channels ended at once: left to their grace",
                run_id,
                len(waiting),
                nodes,
            )
            return 0
        lost = 0
        for key, request in waiting:
            timer, _ = self._timers.pop(key)
            timer.cancel()
            lost += self._apply(run_id, replace(request, confirmed=True))
        return lost

    def _apply(self, run_id: str, request: Request) -> int:
        store, node = self._store, request.node
        self._timers.pop((run_id, node), None)
        if store.closing or not store.engine.knows(run_id, node):
            return 0
        if (run_id, node) in store.holding:
            # Its keep-alive is held on another connection: it is alive. (Its client may
            # have sent it again before this server read the old channel's end: then no
            # beat comes during the grace, the one sent is held.)
            return 0
        reply = store.engine.apply(run_id, request, now_ms())
        if reply.transition is Transition.REMOVE:
            how = "a member's collective broke since" if request.confirmed else "not heard from"
            log.info("node %s of run %r: its channel ended, %s", node, run_id, how)
            return 1
        if reply.outcome is Outcome.WAIT and reply.wake_at_ms is not None:
            delay = max(reply.wake_at_ms - reply.status.now_ms, 0) / 1000 + 0.002
            loop = asyncio.get_running_loop()
            timer = loop.call_later(delay, self._due, run_id, request)
            self._timers[(run_id, node)] = timer, request
        return 0

    def _due(self, run_id: str, request: Request) -> None:
        try:
            self._apply(run_id, request)
        except Exception:  # a timer has nobody to tell: a bug, logged
            log.exception("applying a departure failed")

    def close(self) -> None:
        """Forget the departures not yet decided (the server stops)."""
        for timer, _ in self._timers.values():
            timer.cancel()
        self._timers.clear()
