"""Injected time: the handler reads the clock only through a :class:`Clock`.

``time()`` is wall-clock seconds (written into the shared state, comparable between
machines); ``monotonic()`` measures local durations (operation deadlines).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """A source of time."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (tests of timeouts and heartbeats).

    Args:
        start: The initial wall-clock reading.
    """

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds``."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds


SYSTEM_CLOCK: Clock = SystemClock()
