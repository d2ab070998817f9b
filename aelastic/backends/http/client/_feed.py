"""The news of one run from the HTTP server: one long-poll while somebody waits.

How it works: a :class:`RunFeed` owns the run's :class:`~aelastic.backends._watch.RunWatch`
for its connection. When the first waiter arrives it starts one long-poll loop: ``GET
status?token=<newest known>&wait=<hold>``, which the server answers as soon as the status's
token moves (round transitions only) or when the hold ends; each answer is news for the
watch, which wakes the waiters it concerns. The loop stops once nobody waits. If the server
cannot be reached the watch is told (its waiters then ask by themselves, and fail after
``read_timeout``) and the loop retries with backoff while waiters remain. A run whose state
is gone (deleted, or a server restarted without its journal) answers "no state", which no
token order can call newer: the watch then starts over as after a lost channel (its waiters
re-check and learn it) and the next long-poll waits for a state to appear.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from ....core.errors import RendezvousError
from ....core.race import cancel_and_wait
from ....core.state import Status
from ....core.token import NO_STATE
from ..._watch import RunWatch

__all__ = ["LONG_POLL", "RunFeed"]

log = logging.getLogger("aelastic.backends.http")

#: Longest a long-poll asks the server to hold it (seconds).
LONG_POLL = 60.0


class RunFeed:
    """One run's notifications on one connection (see the module docstring).

    Args:
        poll: ``poll(token, hold)`` asks the server for the status once it differs from
            ``token`` (or after ``hold`` seconds).
    """

    def __init__(self, poll: Callable[[str, float], Awaitable[Status]]) -> None:
        self.watch = RunWatch(on_first_waiter=self._start)
        self._poll = poll
        self._task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        watch = self.watch
        delay = 0.05
        while watch.waiting:
            watch.live = watch.latest is not None
            token = watch.token or ""
            try:
                status = await self._poll(token, LONG_POLL)
            except RendezvousError as exc:
                log.debug("long-poll failed: %s", exc)
                watch.on_lost()
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.05
            watch.on_status(status)
            if status.token == NO_STATE and watch.token not in (None, NO_STATE):
                watch.on_lost()  # the state is gone: forget what was known, never spin
        watch.live = False

    async def aclose(self) -> None:
        """Stop the long-poll."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
