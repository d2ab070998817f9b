"""How a node waits: for its run's status to move, and for the id of a job that ended.

How it works: :class:`StatusWaits` waits until the run's status token moves (the backend
wakes the waiter), a time passes, or, when asked, this node's own requests bring news (its
:attr:`StatusWaits.news` signal, set by :class:`~._node.NodeRequests`) or an event is set.
On the system clock the backend's own timeout bounds the wait (one task and one future when
news may cut it short); on a test's clock the timeout races the backend's wait on that clock
(:func:`~aelastic.core.race.first_of`). What the backend reports meanwhile (its retries) is
published by the node while anyone listens.

:class:`IdWait` decides whether a join the run refused for having ended (closed, or empty
with other rules) is a new job's, which waits for the id to be free, or the ended job's own,
which is told the run is over (as torch's is). It compares durations only: since the run's
last node left (the backend's clock) and since this handler was made (this node's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..core.clock import Clock, SystemClock
from ..core.events import Event, EventHub, reporting
from ..core.machine import reuse_grace_ms
from ..core.protocol import RendezvousBackend
from ..core.race import Signal, first_of
from ..core.state import NodeDesc, Outcome, Reply, Status

__all__ = ["IdWait", "StatusWaits"]

log = logging.getLogger("aelastic.rendezvous")


class StatusWaits:
    """A node's waits for its run's status to move (see the module docstring).

    Args:
        backend: Where the run's state lives.
        clock: Source of time (a test's clock bounds the waits on it).
        hub: The node's event hub: the backend's reports are published while it listens.
        publish: The node's :meth:`~._node.NodeRequests.publish`.
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        clock: Clock,
        hub: EventHub,
        publish: Callable[[Event], None],
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._hub = hub
        self._publish = publish
        #: Set when this node's own requests bring news (a wait with ``news`` ends then).
        self.news = Signal()

    async def wait(
        self, token: str, within: float, news: bool = False, until: asyncio.Event | None = None
    ) -> Status | None:
        """The new status once the status's token moves, or ``None`` when ``within``
        seconds passed first (or, with ``news``, this node's own requests brought news; or
        ``until`` was set)."""
        if isinstance(self._clock, SystemClock) and until is None:
            return await self._wait_or_news(token, within, news)
        return await self._wait_on_clock(token, within, news, until)

    async def _wait_on_clock(
        self, token: str, within: float, news: bool, until: asyncio.Event | None
    ) -> Status | None:
        """The timeout runs on the clock (a test's), the change on the backend."""
        backend = self._backend

        async def change() -> Status | None:
            with reporting(self._publish if self._hub.listened else None):
                return await backend.wait_for_change(token, None)

        calls: list[Callable[[], Awaitable[Any]]] = [change, lambda: self._clock.sleep(within)]
        if news:
            calls.append(self.news.wait)
        if until is not None:
            calls.append(until.wait)
        index, status = await first_of(*calls)
        return status if index == 0 else None

    async def _backend_wait(self, token: str, within: float) -> Status | None:
        if self._hub.listened:
            with reporting(self._publish):
                return await self._backend.wait_for_change(token, within)
        return await self._backend.wait_for_change(token, within)

    async def _wait_or_news(self, token: str, within: float, news: bool) -> Status | None:
        """The backend's wait (its own timeout), cut short by this node's news (``news``):
        one task and one future, where :func:`~aelastic.core.race.first_of` would take a
        task group (this runs at every ``watch()`` of every node)."""
        if not news:
            return await self._backend_wait(token, within)
        loop = asyncio.get_running_loop()
        change = loop.create_task(self._backend_wait(token, within))
        woken: asyncio.Future[None] = loop.create_future()  # by the change or the news

        def wake(_: object) -> None:
            if not woken.done():
                woken.set_result(None)

        change.add_done_callback(wake)
        self.news.add(woken)
        try:
            await woken
        except BaseException:
            await _settle(change)
            raise
        finally:
            self.news.discard(woken)
        if not change.done():  # news came first
            await _settle(change)
            return None
        return change.result()


async def _settle(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it is over, even if the caller is cancelled meanwhile
    (its cancellation is raised then); what ``task`` raised is dropped."""
    cancelled = False
    task.cancel()
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
            task.cancel()
    if not task.cancelled():
        task.exception()  # retrieved: not logged as never retrieved
    if cancelled:
        raise asyncio.CancelledError


class IdWait:
    """Whether a node waits for the id of a job that ended (see the module docstring).

    Args:
        made_at: When the node's handler was made (monotonic clock).
    """

    def __init__(self, made_at: float) -> None:
        self._made_at = made_at
        #: Why the node waits for the id, once it does ("closed", "made with other rules").
        self.what: str | None = None

    def free_in(self, reply: Reply, sent: float, took_part: bool) -> float | None:
        """Seconds until the run's id is free for this node's job, when the run refused its
        join (sent at ``sent``, monotonic) for having ended (closed, or empty with other
        rules) before this node's handler was made: a node of a new job waits for the id.
        ``None``: refuse (a node of the ended job, which was in the run (``took_part``) or
        was made while it went on, is told it ended; so is any node while nodes are still in
        the run, as torch's is)."""
        ended = reply.outcome in (Outcome.ERROR_CLOSED, Outcome.ERROR_RULES)
        free_at, rules = reply.reopen_at_ms, reply.run_rules
        if took_part or not ended or free_at is None or rules is None:
            return None
        if self.what is not None:  # decided at its first refusal: a new job's
            return max(free_at - reply.status.now_ms, 0) / 1000
        # Durations only (the backend's clock against this node's): since the run's last
        # node left, by the backend when it answered, and since this handler was made, when
        # the join was sent (before the backend answered). Were this node's age taken once
        # the answer is in, a slow answer (a loaded machine) would make a handler made just
        # after the run emptied (a job run again at once: in a notebook, milliseconds
        # later) look older than the emptiness, and refuse it.
        since_vacated = (reply.status.now_ms - (free_at - reuse_grace_ms(rules))) / 1000
        if sent - self._made_at >= since_vacated:
            return None
        return max(free_at - reply.status.now_ms, 0) / 1000

    def waits(self, reply: Reply, free_in: float, run_id: str, node: NodeDesc) -> str:
        """The node waits ``free_in`` seconds for the id (said in the log the first time);
        why, as :attr:`what` says."""
        what = "closed" if reply.outcome is Outcome.ERROR_CLOSED else "made with other rules"
        if self.what is None:
            log.info(
                "run '%s' was used by a job that has ended (%s): node %s waits %.0f s for its "
                "id to be free",
                run_id,
                what,
                node,
                free_in,
            )
        self.what = what
        return what
