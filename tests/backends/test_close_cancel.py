"""Closing a backend does not swallow a cancellation of the closer.

A backend's ``aclose()`` stops its background tasks (the HTTP long-poll, the Redis
subscription) and waits for them. Cancelling the task that closes it meanwhile (SIGINT
cancels ``asyncio.run``'s main task) must cancel it: ``await task`` under
``suppress(BaseException)`` once swallowed that, and the closer went on as if never told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aelastic.backends.registry import create_backend
from aelastic.core.params import RendezvousParameters

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["http", "redis"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if request.param == "http":
        from tests._http_server import HttpServer

        with HttpServer() as http:
            yield "http", http.endpoint
    else:
        from tests._redis_server import RedisServer

        with RedisServer() as redis:
            yield "redis", redis.url


async def test_cancelling_aclose_while_it_stops_its_tasks_cancels_it(
    endpoint: tuple[str, str], run_id: str
) -> None:
    backend = create_backend(RendezvousParameters(*endpoint, run_id, 1, 1))
    # A waiter starts the backend's notification task (long-poll or subscription).
    waiter = asyncio.ensure_future(backend.wait_for_change("", 30))
    await asyncio.sleep(0.5)
    waiter.cancel()
    await asyncio.wait({waiter})
    closing = asyncio.ensure_future(backend.aclose())
    await asyncio.sleep(0)  # it cancelled its background task and waits for it to end
    assert not closing.done()
    closing.cancel()
    await asyncio.wait({closing}, timeout=30)
    assert closing.cancelled()  # and it finished closing first (no unclosed session)
