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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import anyio

__all__ = ["cancel_and_wait", "first_of", "uncancellable"]

_T = TypeVar("_T")


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
        task.add_done_callback(_retrieve)
    if pending:
        await asyncio.wait(pending)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # mark it retrieved: the outcome is not wanted


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
