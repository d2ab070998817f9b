"""What one process knows about one run: the latest status, and the local waiters.

How it works: a :class:`RunWatch` exists per run and shared client; every backend of the run
on that client shares it. Whatever brings news feeds it: the notifications of a server
(Redis pub/sub messages, HTTP long-poll answers) and the status every reply carries. It
keeps the newest status seen (tokens of one epoch are ordered, so an older token is known
to be stale without asking) and wakes the waiters a change concerns: status waiters when
the token moved past theirs, key waiters when one of their keys was written. When the
notification channel was lost (a message may have been missed) every waiter is woken and
re-checks with the server; while it is down, waiters check with the server themselves.

Nothing here polls: a waiter asks the server only when it cannot tell (no news yet, another
epoch, the channel down) and otherwise sleeps until woken or its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from ..core.state import Status
from ..core.token import NO_STATE, Order, Token, compare

__all__ = ["RunWatch"]


class _Waiter:
    __slots__ = ("future", "keys", "token")

    def __init__(self, future: asyncio.Future[bool], token: Token, keys: frozenset[bytes]):
        self.future = future
        self.token = token
        self.keys = keys

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(True)

    def time_out(self) -> None:
        if not self.future.done():
            self.future.set_result(False)


class RunWatch:
    """The news of one run in this process (see the module docstring).

    Args:
        on_first_waiter: Called when a status waiter arrives and none was waiting (an HTTP
            client starts its long-poll then).
    """

    def __init__(self, on_first_waiter: Callable[[], None] | None = None) -> None:
        self.latest: Status | None = None
        #: Notifications arrive (subscribed / long-polling); otherwise waiters ask.
        self.live = False
        #: Set while notifications flow (tests and status tools wait on it).
        self.ready = asyncio.Event()
        self._status_waiters: set[_Waiter] = set()
        self._key_waiters: set[_Waiter] = set()
        self._on_first_waiter = on_first_waiter
        self._mark = 0  # moves each time notifications start (again)

    @property
    def mark(self) -> int:
        """Moves each time notifications start (again): take it before sending a request,
        and hand the reply's status to :meth:`on_reply` with it."""
        return self._mark

    @property
    def waiting(self) -> bool:
        """Whether anybody waits for a status change."""
        return bool(self._status_waiters)

    @property
    def token(self) -> Token | None:
        """The token of the newest status seen."""
        return None if self.latest is None else self.latest.token

    # -- news -----------------------------------------------------------------------------

    def on_status(self, status: Status) -> None:
        """``status`` was read or notified: keep it if newer, wake who it concerns."""
        latest = self.latest
        older = latest is not None and compare(status.token, latest.token) is Order.CHANGED
        if older and status.token != NO_STATE:
            return  # older than what is known (an empty status: the run was deleted)
        self.latest = status
        for waiter in list(self._status_waiters):
            if compare(waiter.token, status.token) is not Order.SAME:
                waiter.wake()

    def on_reply(self, status: Status, mark: int) -> None:
        """``status`` came in the reply to a request sent at ``mark``: it is news only if
        notifications did not start meanwhile. Otherwise the server may have made it before
        the subscription took effect, and a later change may have gone unnotified: it is not
        kept, so waiters ask the server instead of trusting it."""
        if mark == self._mark:
            self.on_status(status)

    def on_key(self, key: bytes) -> None:
        """Store key ``key`` was written: wake its waiters."""
        for waiter in list(self._key_waiters):
            if key in waiter.keys:
                waiter.wake()

    def on_live(self) -> None:
        """Notifications flow (again): waiters re-check once, then sleep."""
        self._mark += 1
        self.live = True
        self.latest = None
        self.ready.set()
        self._wake_all()

    def on_lost(self) -> None:
        """Notifications stopped: some may have been missed, every waiter re-checks."""
        self.live = False
        self.latest = None
        self.ready.clear()
        self._wake_all()

    def _wake_all(self) -> None:
        for waiter in (*self._status_waiters, *self._key_waiters):
            waiter.wake()

    # -- waiting --------------------------------------------------------------------------

    async def wait_status(
        self,
        token: Token,
        timeout: float | None,
        fetch: Callable[[], Awaitable[Status]],
        recheck: float,
    ) -> Status | None:
        """The run's status once its token differs from ``token``; ``None`` after ``timeout``.

        ``fetch`` reads the status from the server; it is called when this process cannot
        tell (no news, another epoch) and every ``recheck`` seconds while notifications
        are down.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(timeout, 0.0)
        while True:
            latest = self.latest
            order = Order.UNKNOWN if latest is None else compare(token, latest.token)
            if order is Order.CHANGED:
                return latest
            if order is Order.UNKNOWN or not self.live:
                mark = self._mark
                status = await fetch()
                self.on_reply(status, mark)
                if status.token != token:
                    return status
                if mark != self._mark:
                    continue  # notifications started meanwhile: that read may predate them
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            if self.live:
                period = remaining
            else:
                period = recheck if remaining is None else min(recheck, remaining)
            await self._sleep(token, frozenset(), period)

    async def wait_keys(
        self,
        keys: Iterable[bytes],
        timeout: float,
        check: Callable[[], Awaitable[bool]],
        recheck: float,
    ) -> bool:
        """Wait until ``check()`` holds, re-checking when one of ``keys`` is written (and
        every ``recheck`` seconds); ``False`` if ``timeout`` passed first."""
        names = frozenset(keys)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while True:
            waiter = self._register("", names)
            try:
                if await check():
                    return True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                await self._wait(waiter, min(recheck, remaining))
            finally:
                self._forget(waiter)

    async def _sleep(self, token: Token, keys: frozenset[bytes], period: float | None) -> bool:
        waiter = self._register(token, keys)
        try:
            latest = self.latest
            if latest is not None and compare(token, latest.token) is Order.CHANGED:
                return True
            return await self._wait(waiter, period)
        finally:
            self._forget(waiter)

    def _register(self, token: Token, keys: frozenset[bytes]) -> _Waiter:
        waiter = _Waiter(asyncio.get_running_loop().create_future(), token, keys)
        if keys:
            self._key_waiters.add(waiter)
        else:
            first = not self._status_waiters
            self._status_waiters.add(waiter)
            if first and self._on_first_waiter is not None:
                self._on_first_waiter()
        return waiter

    def _forget(self, waiter: _Waiter) -> None:
        self._status_waiters.discard(waiter)
        self._key_waiters.discard(waiter)
        waiter.future.cancel()

    @staticmethod
    async def _wait(waiter: _Waiter, period: float | None) -> bool:
        """Whether ``waiter`` was woken (``False``: ``period`` passed first). One timer, no
        task: every waiting node of a process sleeps here."""
        if waiter.future.done():
            return True
        if period is None:
            return await waiter.future
        timer = asyncio.get_running_loop().call_later(period, waiter.time_out)
        try:
            return await waiter.future
        finally:
            timer.cancel()
