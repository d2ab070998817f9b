"""Injected time: the handler reads the clock and sleeps only through a :class:`Clock`.

``time()`` is wall-clock seconds (for display; the shared state keeps the backend's own
time, so clocks of different machines are never compared); ``monotonic()`` measures local
durations (operation deadlines); ``sleep()`` waits on that clock. :class:`ManualClock` moves
only when told to, so tests drive heartbeats and timeouts without real waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """A source of time."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the monotonic clock."""


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))


class ManualClock:
    """A clock that moves only when told to (tests of timeouts and heartbeats).

    Sleepers wake when :meth:`advance` moves the clock past their end.

    Args:
        start: The initial reading of both clocks.
    """

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds`` and wake the sleepers whose time came."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)


SYSTEM_CLOCK: Clock = SystemClock()
