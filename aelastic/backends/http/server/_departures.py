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
one is lost at once rather than after the heartbeat window.

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

from ....core.state import NodeDesc, Outcome, Request, Transition
from ..._engine import now_ms
from ._runs import RunStore

__all__ = ["Departures"]

log = logging.getLogger("aelastic.backends.http.server")

#: The nodes of one channel: (run id, node) -> the secret its requests carried.
Nodes = dict[tuple[str, NodeDesc], str]


class Departures:
    """The departures reported by the server's channels, until the machine decides them."""

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._timers: dict[tuple[str, NodeDesc], asyncio.TimerHandle] = {}

    def report(self, nodes: Nodes) -> None:
        """The channel that carried ``nodes`` ended now without a goodbye."""
        since = now_ms()
        for (run_id, node), secret in nodes.items():
            self._apply(run_id, Request.departure(node, since, secret=secret))

    def _apply(self, run_id: str, request: Request) -> None:
        store, node = self._store, request.node
        self._timers.pop((run_id, node), None)
        if store.closing or not store.engine.knows(run_id, node):
            return
        reply = store.engine.apply(run_id, request, now_ms())
        if reply.transition is Transition.REMOVE:
            log.info("node %s of run %r: its channel ended and it was not heard from", node, run_id)
        elif reply.outcome is Outcome.WAIT and reply.wake_at_ms is not None:
            delay = max(reply.wake_at_ms - reply.status.now_ms, 0) / 1000 + 0.002
            loop = asyncio.get_running_loop()
            self._timers[(run_id, node)] = loop.call_later(delay, self._due, run_id, request)

    def _due(self, run_id: str, request: Request) -> None:
        try:
            self._apply(run_id, request)
        except Exception:  # a timer has nobody to tell: a bug, logged
            log.exception("applying a departure failed")

    def close(self) -> None:
        """Forget the departures not yet decided (the server stops)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
