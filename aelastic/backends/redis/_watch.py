"""What one process knows about one run: change notifications, local waiters, write order.

How it works: a :class:`RunWatch` exists per run and shared client (so per event loop and
endpoint); every backend of the run in this process shares it. The pub/sub listener feeds
it messages: ``s<token>`` after a state write, ``k<key>`` after a store write. It wakes the
waiters a message concerns, keeps the token of the last change notified (``latest``:
messages arrive in write order, so a token older than ``latest`` is known to be stale
without asking the server), counts what made local knowledge newer (``seq``, which keeps
a shared in-flight read from answering a later caller), remembers the last
compare-and-set answer (``cached``), and orders this process's compare-and-set calls
(:class:`Turn`). While such writes are queued, wake-ups of state waiters are held (at
most :data:`MAX_HOLD`): the next notification follows at once, and waking hundreds of
local waiters for each one would only burn CPU.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["MAX_HOLD", "Order", "RunWatch", "Turn", "compare_tokens"]

#: Longest delay of a wake-up while writes of this process to the same run are queued
#: (their notifications follow at once: waking the waiters for each would waste CPU).
MAX_HOLD = 0.05


class Order(enum.Enum):
    """How a token relates to a newer piece of knowledge about the run."""

    SAME = "same"  # equal, or known to be newer: nothing to report yet
    CHANGED = "changed"  # known to be older: the stored token differs
    UNKNOWN = "unknown"  # cannot tell without asking the server


def _parse(token: str) -> tuple[str, int] | None:
    epoch, dot, version = token.partition(".")
    if not dot or not version.isdigit():
        return None
    return epoch, int(version)


def compare_tokens(token: str, known: str | None) -> Order:
    """Relate ``token`` (what a caller holds) to ``known`` (a token the server had later).

    Tokens of one epoch are ordered by version; anything else is :attr:`Order.UNKNOWN`.
    """
    if known is None:
        return Order.UNKNOWN
    if token == known:
        return Order.SAME
    mine, theirs = _parse(token), _parse(known)
    if mine is None or theirs is None or mine[0] != theirs[0]:
        return Order.UNKNOWN
    return Order.CHANGED if mine[1] < theirs[1] else Order.SAME


class Turn:
    """The in-process order of compare-and-set calls on one run.

    One call at a time goes to the server. A caller that lost keeps the turn for its
    immediate retry (made in the same loop iteration, since deciding again is pure
    computation) and loses it at the next iteration otherwise. So N nodes of one process
    joining at once cost about N writes, not N² lost races.

    Args:
        on_idle: Called when the turn becomes free with nobody queued for it.
    """

    def __init__(self, on_idle: Callable[[], None]) -> None:
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None
        self._lease = 0
        self._queued = 0
        self._on_idle = on_idle

    @property
    def busy(self) -> bool:
        """Whether a write of this process is under way or queued."""
        return self._lock.locked() or self._queued > 0

    async def acquire(self) -> None:
        """Take the turn (at once if this task kept it)."""
        task = asyncio.current_task()
        if task is not None and self._owner is task:
            self._lease += 1
            return
        self._queued += 1
        try:
            await self._lock.acquire()
        finally:
            self._queued -= 1
        self._owner = task
        self._lease += 1

    def release(self) -> None:
        """Give the turn to the next caller."""
        self._owner = None
        self._lease += 1
        self._lock.release()
        if not self._queued:
            self._on_idle()

    def keep(self) -> None:
        """Keep the turn for the owner's retry; release it at the next loop iteration."""
        lease = self._lease
        asyncio.get_running_loop().call_soon(self._expire, lease)

    def _expire(self, lease: int) -> None:
        if self._lease == lease and self._lock.locked():
            self.release()


class _Waiter:
    __slots__ = ("future", "keys", "token")

    def __init__(self, future: asyncio.Future[bool], token: str, keys: frozenset[bytes]) -> None:
        self.future = future
        self.token = token
        self.keys = keys

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(True)

    def expire(self) -> None:
        if not self.future.done():
            self.future.set_result(False)


class RunWatch:
    """What this process knows about one run's changes; shared by the run's backends."""

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.refs = 0
        self.subscribed = False
        self.ready = asyncio.Event()
        self.latest: str | None = None
        self.seq = 0
        self.cached: tuple[bytes | None, str] | None = None
        self.turn = Turn(self._turn_idle)
        self._held: asyncio.TimerHandle | None = None
        self.inflight_read: tuple[int, asyncio.Task[tuple[bytes | None, str]]] | None = None
        self._state_waiters: set[_Waiter] = set()
        self._key_waiters: set[_Waiter] = set()

    def waiter(self, token: str = "", keys: Iterable[bytes] = ()) -> _Waiter:
        """Register a waiter for a state change from ``token`` or for ``keys`` to change."""
        key_set = frozenset(keys)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), token, key_set)
        (self._key_waiters if key_set else self._state_waiters).add(waiter)
        return waiter

    @property
    def holding(self) -> bool:
        """Whether wake-ups wait for this process's queued writes to the run."""
        return self._held is not None

    async def sleep(self, waiter: _Waiter, timeout: float) -> bool:
        """Wait until ``waiter`` is woken (``True``) or ``timeout`` passes (``False``)."""
        if waiter.future.done():
            return True
        timer = asyncio.get_running_loop().call_later(timeout, waiter.expire)
        try:
            return await waiter.future
        finally:
            timer.cancel()

    def discard(self, waiter: _Waiter) -> None:
        """Forget ``waiter`` (it was woken or gave up)."""
        self._state_waiters.discard(waiter)
        self._key_waiters.discard(waiter)
        waiter.future.cancel()

    def wake_all(self) -> None:
        """Wake every waiter (it may have missed a change: it re-reads)."""
        if self._held is not None:
            self._held.cancel()
            self._held = None
        for waiter in (*self._state_waiters, *self._key_waiters):
            waiter.wake()

    def on_message(self, payload: bytes) -> None:
        """A write of the run was published: wake who it concerns."""
        kind, body = payload[:1], payload[1:]
        if kind == b"s":
            self.latest = body.decode("ascii", "replace")
            self.seq += 1
            if not self.turn.busy:
                self._wake_state_waiters()
            elif self._held is None:  # more writes of this process are coming: wake after
                loop = asyncio.get_running_loop()
                self._held = loop.call_later(MAX_HOLD, self._wake_state_waiters)
        elif kind == b"k":
            for waiter in self._key_waiters:
                if body in waiter.keys:
                    waiter.wake()

    def _wake_state_waiters(self) -> None:
        if self._held is not None:
            self._held.cancel()
            self._held = None
        latest = self.latest
        for waiter in self._state_waiters:
            if compare_tokens(waiter.token, latest) is not Order.SAME:
                waiter.wake()

    def _turn_idle(self) -> None:
        if self._held is not None:
            self._wake_state_waiters()

    def on_subscribed(self) -> None:
        """The channel is (again) subscribed: messages from now on arrive."""
        self.subscribed = True
        self.latest = None
        self.seq += 1
        self.ready.set()
        self.wake_all()

    def on_lost(self) -> None:
        """The pub/sub connection is gone: messages may be lost until resubscribed."""
        if self.subscribed:
            self.subscribed = False
            self.latest = None
            self.seq += 1
            self.ready.clear()
        self.wake_all()
