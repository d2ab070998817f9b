"""Helpers shared by rendezvous tests: a group of handlers, joining them, checking the result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from aelastic import RendezvousParameters
from aelastic.rendezvous import DynamicRendezvousHandler, RendezvousInfo, create_handler
from aelastic.store import Store

#: Generous bound for anything that should happen "promptly" on a shared 2-core machine.
PROMPT = 10.0

#: A node's secret for requests a test makes itself (each test node under its own name).
SECRET = "7e57" * 8

#: Small timeouts for tests (seconds).
TEST_CONF: dict[str, Any] = {"join_timeout": 30, "last_call_timeout": 0.2, "read_timeout": 10}


@asynccontextmanager
async def handler_group(
    backend: str,
    endpoint: str,
    run_id: str,
    count: int,
    min_nodes: int,
    max_nodes: int,
    **conf: Any,
) -> AsyncIterator[list[DynamicRendezvousHandler]]:
    """``count`` handlers of one run (``TEST_CONF`` unless overridden); closed afterwards."""
    params = RendezvousParameters(
        backend,
        endpoint,
        run_id,
        min_nodes,
        max_nodes,
        local_addr="127.0.0.1",
        **{**TEST_CONF, **conf},
    )
    made = [create_handler(params) for _ in range(count)]
    try:
        yield made
    finally:
        for handler in made:
            await handler.aclose()


async def join_all(
    handlers: list[DynamicRendezvousHandler], within: float = PROMPT
) -> list[RendezvousInfo[Store]]:
    """Every handler's ``next_rendezvous()``, concurrently, in at most ``within`` seconds."""
    with anyio.fail_after(within):
        return list(await asyncio.gather(*(h.next_rendezvous() for h in handlers)))


async def eventually(check: Callable[[], Awaitable[bool]], within: float = PROMPT) -> None:
    """Wait until ``check()`` holds (asked every 20 ms), at most ``within`` seconds.

    For conditions nothing notifies (a node gone from a snapshot); prefer events elsewhere.
    """
    with anyio.fail_after(within):
        for _ in range(int(within / 0.02) + 2):
            if await check():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the condition never held")


def assert_one_group(infos: list[RendezvousInfo[Store]], size: int) -> None:
    """One group of ``size``: ranks 0..size-1, one world size, one bootstrap address."""
    assert sorted(i.rank for i in infos) == list(range(size))
    assert {i.world_size for i in infos} == {size}
    boot = {
        (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
        for i in infos
        if i.bootstrap_store_info
    }
    assert len(boot) == 1
