"""Structured races: run a few awaitables, keep the first result, cancel the rest.

How it works: :func:`first_of` starts each call in one anyio task group; the first to end
(with a value or an error) cancels the group's scope, so the others are cancelled and
awaited before it returns: nothing is left running, and cancelling the caller cancels them
all. When several end in the same turn of the loop, the earliest in the argument list wins
(callers list the work before the watcher, so finished work is never thrown away). An error
is re-raised as it is, not wrapped in an exception group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["first_of"]


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
