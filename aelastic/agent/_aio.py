"""Small asyncio helpers the agent needs: cancel-and-wait, cleanup that cannot be cut short."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "quietly", "uncancellable"]

log = logging.getLogger("aelastic.agent")

_T = TypeVar("_T")


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it is over (its outcome is dropped).

    Cancelling the caller meanwhile is not swallowed: it propagates as usual.
    """
    if not task.done():
        task.cancel()
    task.add_done_callback(_retrieve)
    await asyncio.wait({task})


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # mark it retrieved: the outcome is not wanted


async def quietly(awaitable: Awaitable[Any], what: str) -> None:
    """Await ``awaitable``; an error is logged as a warning (``could not <what>``)."""
    try:
        await awaitable
    except Exception as exc:
        log.warning("could not %s: %s", what, exc)


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
