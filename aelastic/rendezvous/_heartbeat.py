"""Heartbeats of a member: one keep-alive an interval, and a prune when a window ends.

How it works: after its round completes, the handler starts one :class:`Heartbeats` task.
It sends this node's keep-alive once an interval (the first at a random point of the first
interval, so members that completed together do not beat in step; held beats: the first at
once, held until that point). The answer says when the
oldest heartbeat of the run expires, by the backend's clock; the task asks the backend to
prune at that moment (plus a little spread), so a dead member is seen within the heartbeat
window, and skips the check when news came first (another survivor pruned). A backend that
holds keep-alives (HTTP) answers when the status moves or the next beat is due, so the
beats also bring the news: :attr:`Heartbeats.holding` tells a watcher whether a held beat
is out (then it need not ask the backend itself), and ``holding_changed`` when that
changes (before the first beat, after a failed one). An answer that no longer knows this
node (pruned, removed) ends the task and tells the handler; so does a rendezvous gone for
good (:class:`~aelastic.core.errors.RendezvousLostError`: the watcher then hears it from the
backend). :attr:`Heartbeats.sent_at` says when the last keep-alive went out (the agent's
workers stop by themselves one heartbeat window after it, should the agent freeze). Time
and sleeps come only from the handler's clock.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Protocol

from ..core.clock import Clock
from ..core.errors import RendezvousError, RendezvousLostError, reason
from ..core.machine import expiry_ms
from ..core.params import RendezvousSettings
from ..core.race import fail_after
from ..core.state import Reply, Status

__all__ = ["Heartbeats"]

log = logging.getLogger("aelastic.rendezvous")


class _Member(Protocol):
    """What the heartbeat task needs of its handler."""

    @property
    def status(self) -> Status | None: ...

    async def keep_alive(self, hold: float) -> Reply: ...

    def lost_membership(self) -> None: ...


class Heartbeats:
    """The heartbeat task of one member (start after a round, stop before leaving).

    Args:
        member: The handler whose node beats.
        settings: Interval, window and request timeout.
        clock: The handler's clock.
        holds: The backend holds keep-alives until news or the next beat.
        name: The task's name.
    """

    def __init__(
        self, member: _Member, settings: RendezvousSettings, clock: Clock, holds: bool, name: str
    ) -> None:
        self._member = member
        self._settings = settings
        self._clock = clock
        self._holds = holds
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._holding = False
        #: Set whenever :attr:`holding` changes (a watcher clears it before it looks).
        self.holding_changed = asyncio.Event()
        #: When the last keep-alive went out, on the clock (the task's start before the
        #: first: the round's completion was heard); ``None`` while the task does not run.
        self.sent_at: float | None = None

    @property
    def running(self) -> bool:
        """Whether the task runs."""
        return self._task is not None and not self._task.done()

    @property
    def holding(self) -> bool:
        """Whether a held keep-alive is out (or the next one goes at once): its answer will
        bring news of the run, so a watcher need not ask for it."""
        return self._holding and self.running

    def _hold(self, holding: bool) -> None:
        if holding is not self._holding:
            self._holding = holding
            self.holding_changed.set()

    def start(self) -> None:
        """Start beating (on the running loop)."""
        self.sent_at = self._clock.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._beat(), name=self._name)
        # Held beats: the first goes at once, so a watcher relies on them from the start
        # (it never asks the backend for news meanwhile).
        self._hold(self._holds)

    async def stop(self) -> None:
        """Stop beating and wait until the task is over (an error of the task is raised)."""
        task, self._task = self._task, None
        self.sent_at = None
        if task is None or task.done():
            return
        task.cancel()
        if task.get_loop() is asyncio.get_running_loop():
            # Not `await task` under suppress(CancelledError): that would also swallow a
            # cancellation of the caller arriving meanwhile (a stopping agent would go on).
            await asyncio.wait({task})
            if not task.cancelled():
                task.result()

    async def _beat(self) -> None:
        try:
            await self._beats()
        finally:
            self._hold(False)
            self.sent_at = None

    async def _beats(self) -> None:
        interval = self._settings.keep_alive_interval
        window = self._settings.heartbeat_window
        clock = self._clock
        # This node's beats fall at a random point of the interval, so that members that
        # completed together do not beat in step. Held beats: the first goes at once and
        # is held until that point (the node hears of changes from the start).
        phase = interval * random.uniform(0.05, 1.0)
        next_beat = clock.monotonic() + (0.0 if self._holds else phase)
        check_at: float | None = None
        seen = ""  # the status token when the check was planned
        while True:
            checking = check_at is not None and check_at < next_beat
            wake = check_at if checking and check_at is not None else next_beat
            await clock.sleep(wake - clock.monotonic())
            status = self._member.status
            if checking and status is not None and status.token != seen:
                check_at = None  # news came first (another survivor pruned): no need
                continue
            asked = self.sent_at = clock.monotonic()
            # Held (HTTP): the answer comes when the status moves or the next beat is due
            # (or the planned check, which the next beat makes). The check's own beat is
            # held too: if its prune moved the status, the node has not seen that status
            # and the server answers at once; so the beat stays this node's news channel.
            hold = 0.0
            if self._holds:
                until_check = (phase or interval) if check_at is None else check_at - asked
                hold = until_check if until_check > 0.001 else interval
                phase = 0.0
            self._hold(hold > 0)
            limit = self._settings.heartbeat_timeout + hold
            try:
                # A structured deadline, not asyncio.wait_for: on Python 3.11 that can
                # swallow a cancellation arriving as the beat completes (the loop never ends).
                async with fail_after(limit):
                    reply = await self._member.keep_alive(hold)
            except RendezvousLostError:
                return  # nothing will answer again: the watcher hears it from the backend
            except (RendezvousError, TimeoutError) as exc:
                timed_out = isinstance(exc, TimeoutError) and not str(exc)
                why = f"no answer within {limit:g} s" if timed_out else reason(exc)
                log.warning("%s failed to send a heartbeat: %s", self._name, why)
                next_beat, check_at = asked + min(interval, 1.0), None
                self._hold(False)
                continue
            if not reply.known:  # pruned (silent too long) or removed: the round is lost
                self._member.lost_membership()
                return
            next_beat, check_at = asked + interval, None
            if hold:
                # Held as long as it could be: the next beat goes at once and carries on
                # watching. Brought early by news, every member of the job is answered at
                # once: the next beats spread over a little while (this one is fresh), or
                # they would all come back while the server still sends the news; news in
                # that gap comes with the next beat's answer (still "holding").
                now = clock.monotonic()
                early = now < asked + hold - 0.05
                next_beat = now + (random.uniform(0.0, min(0.5, interval / 2)) if early else 0.0)
            else:
                self._hold(False)
            oldest = reply.oldest_beat_ms
            if oldest is not None:
                # The oldest heartbeat's expiry, by the backend's clock, then a little
                # spread so that many survivors do not all ask at once.
                window_ms = round(window * 1000)
                expires = asked + (expiry_ms(oldest, window_ms) - reply.status.now_ms) / 1000
                expires += random.uniform(0.0, min(0.25, interval / 4))
                if expires < next_beat:
                    check_at, seen = max(expires, asked), reply.status.token
