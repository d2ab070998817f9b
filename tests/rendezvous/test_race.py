"""Deadlines that never lose a cancellation: ``wait_within`` (``asyncio.wait_for`` on Python
3.11 returns the awaitable's outcome when the cancellation comes as it finishes; a retry
loop around it then never stops: an agent hung on exit, its etcd watch retrying a TLS
failure)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from aelastic.core.race import cancelling, wait_within


async def _swallowing(fut: asyncio.Future[None]) -> str:
    """A retry loop's body: an error of the awaited call is taken as a failure to retry."""
    try:
        await wait_within(fut, 10.0)
    except ValueError:
        return "retried"
    return "done"


def test_a_cancellation_that_comes_as_the_awaitable_fails_is_not_lost() -> None:
    async def main() -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(_swallowing(fut))
        await asyncio.sleep(0)  # it waits on fut
        fut.set_exception(ValueError("TLS handshake failed"))
        task.cancel()  # in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_wait_within_times_out_and_returns_values() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await wait_within(fut, 0.01)
        assert await wait_within(asyncio.sleep(0, result=7), 1.0) == 7

    asyncio.run(main())


def test_cancelling_tells_a_task_asked_to_stop() -> None:
    seen: list[bool] = []

    async def body() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append(cancelling())  # as if a library had swallowed it
        seen.append(cancelling())

    async def main() -> None:
        task = asyncio.ensure_future(body())
        await asyncio.sleep(0)
        assert not cancelling()
        task.cancel()
        await task

    asyncio.run(main())
    # Python 3.10 cannot tell (``Task.cancelling`` came in 3.11): ``cancelling()`` says no.
    asked = sys.version_info >= (3, 11)
    assert seen == [asked, asked]
