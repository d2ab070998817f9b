"""Structured races: run a few awaitables, keep the first result, cancel the rest.

How it works: :func:`first_of` starts each call in one anyio task group; the first to end
(with a value or an error) cancels the group's scope, so the others are cancelled and
awaited before it returns: nothing is left running, and cancelling the caller cancels them
all. When several end in the same turn of the loop, the earliest in the argument list wins
(callers list the work before the watcher, so finished work is never thrown away). An error
is re-raised as it is, not wrapped in an exception group.

:func:`cancel_and_wait` ends a background task: it cancels the task and waits until it is
over, without swallowing a cancellation of the caller arriving meanwhile (``await task``
under ``suppress(CancelledError)`` would: a process told to stop by SIGINT would go on).
:func:`uncancellable` runs cleanup to its end when the caller is cancelled meanwhile, then
passes the cancellation on.

Two cheaper pieces for the paths every rendezvous node takes at each heartbeat and each
wait (a task group cost ~250 µs of CPU per race, anyio's deadline ~20 µs per beat, measured
with 1,000 nodes in one process): :class:`Signal`, an event that can also resolve a future
(a wait can then race it without a task of its own), and :func:`fail_after`, asyncio's own
deadline where Python has it (3.11+; anyio's before).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import anyio

__all__ = ["Signal", "cancel_and_wait", "fail_after", "first_of", "retrieve", "uncancellable"]

_T = TypeVar("_T")


def fail_after(seconds: float) -> AbstractAsyncContextManager[Any]:
    """A deadline: the block is cancelled after ``seconds`` and ``TimeoutError`` raised (a
    cancellation from outside is never swallowed). Use with ``async with``."""
    if sys.version_info >= (3, 11):
        return asyncio.timeout(seconds)
    return _AnyioDeadline(seconds)  # pragma: no cover (Python 3.10)


async def wait_within(awaitable: Awaitable[_T], seconds: float) -> _T:
    """``await awaitable``, for ``seconds`` at most (then ``TimeoutError``). Use it, not
    ``asyncio.wait_for``: on Python 3.11 that returns the awaitable's outcome when a
    cancellation from outside comes as it finishes, and the cancellation is lost (a task
    that retries on errors then never stops)."""
    async with fail_after(seconds):
        return await awaitable


def cancelling() -> bool:
    """Whether the current task was asked to stop (Python 3.11+; ``False`` before): a
    retry loop that caught an error checks it, in case a library lost the cancellation."""
    if sys.version_info < (3, 11):  # pragma: no cover (Python 3.10)
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _AnyioDeadline:  # pragma: no cover (Python 3.10)
    def __init__(self, seconds: float) -> None:
        self._scope = anyio.fail_after(seconds)

    async def __aenter__(self) -> None:
        self._scope.__enter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return self._scope.__exit__(*exc_info)


class Signal:
    """An ``asyncio.Event`` (``set``, ``clear``, ``is_set``, ``wait``) that can also resolve
    a future of the caller's when it is set (:meth:`add`), to race it without a task."""

    def __init__(self) -> None:
        self._set = False
        self._futures: set[asyncio.Future[None]] = set()

    def is_set(self) -> bool:
        """Whether it is set."""
        return self._set

    def set(self) -> None:
        """Set it: every waiter wakes."""
        self._set = True
        futures, self._futures = self._futures, set()
        for future in futures:
            if not future.done():
                future.set_result(None)

    def clear(self) -> None:
        """Unset it."""
        self._set = False

    def add(self, future: asyncio.Future[None]) -> None:
        """Resolve ``future`` when it is set (at once if it is); :meth:`discard` it after."""
        if self._set:
            if not future.done():
                future.set_result(None)
        else:
            self._futures.add(future)

    def discard(self, future: asyncio.Future[None]) -> None:
        """Forget ``future``."""
        self._futures.discard(future)

    async def wait(self) -> None:
        """Until it is set."""
        if self._set:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.add(future)
        try:
            await future
        finally:
            self._futures.discard(future)


async def first_of(*calls: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    """Run ``calls`` concurrently until the first ends; the others are cancelled.

    Args:
        calls: Functions returning the awaitables to race (started in one task group).

    Returns:
        The index of the call that ended first, and its value.

    Raises:
        Exception: What the first call to end raised.
    """
    ended: list[tuple[int, Any, Exception | None]] = []

    async with anyio.create_task_group() as group:

        async def run(index: int, call: Callable[[], Awaitable[Any]]) -> None:
            try:
                value = await call()
            except Exception as exc:
                ended.append((index, None, exc))
            else:
                ended.append((index, value, None))
            group.cancel_scope.cancel()

        for index, call in enumerate(calls):
            group.start_soon(run, index, call)
    index, value, error = min(ended, key=lambda item: item[0])
    if error is not None:
        raise error
    return index, value


async def cancel_and_wait(tasks: asyncio.Future[Any] | Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` (one or several) and wait until they are over; their outcomes are
    dropped. Cancelling the caller meanwhile is not swallowed: it propagates as usual (the
    tasks may then still be finishing)."""
    pending = {tasks} if isinstance(tasks, asyncio.Future) else set(tasks)
    for task in pending:
        if not task.done():
            task.cancel()
        task.add_done_callback(retrieve)
    if pending:
        await asyncio.wait(pending)


def retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a finished task's outcome as seen (a done callback for a task whose outcome
    nobody may wait for: its error is then not logged as never retrieved)."""
    if not task.cancelled():
        task.exception()


async def uncancellable(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to its end even if the caller is cancelled meanwhile (then re-cancel)."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()
