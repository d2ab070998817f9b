"""Every backend inside a uvloop event loop, as in a service that runs on uvloop (uvicorn's
default when it is installed): a round forms, a silent member is pruned, the survivor forms
again, the members' store works, and the run closes. uvloop's transports are not registered
as ``asyncio.Transport``, which the Redis and etcd clients once asserted (every request of
theirs then failed as "could not be reached")."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from aelastic.backends import create_backend
from aelastic.store import Store
from tests._rendezvous_helpers import PROMPT, assert_one_group, handler_group, join_all

from .conftest import MakeParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    uvloop = pytest.importorskip("uvloop")
    return "asyncio", {"loop_factory": uvloop.new_event_loop}


def assert_on_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")


async def test_a_round_forms_loses_a_silent_member_and_forms_again_on_uvloop(
    make_params: MakeParams,
) -> None:
    assert_on_uvloop()
    conf = {"keep_alive_interval": 0.2, "keep_alive_max_attempt": 2, "last_call_timeout": 0.1}
    params = make_params(1, 2, **conf)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 2, 1, 2, **params.config
    ) as (survivor, victim):
        assert_one_group(await join_all([survivor, victim]), 2)
        await victim._heartbeats.stop()  # silent from now on, never leaves
        with anyio.fail_after(PROMPT):
            seen = await survivor.watch()
        assert seen.lost == {victim.node}
        (info,) = await join_all([survivor])
        assert info.world_size == 1 and info.rank == 0
        await survivor.shutdown()
        assert await survivor.is_closed()


async def test_the_members_store_works_on_uvloop(make_params: MakeParams) -> None:
    assert_on_uvloop()
    backend = create_backend(make_params(1, 1))
    try:
        store = Store(backend, prefix="r0/", timeout=5.0)
        waiting = asyncio.ensure_future(store.get("late"))
        await store.set("key", b"value")
        assert await store.get("key") == b"value"
        assert await store.add("count", 2) == 2 and await store.add("count", 3) == 5
        assert await store.compare_set("key", b"value", b"other") == b"other"
        await store.set("late", "here")
        with anyio.fail_after(PROMPT):
            assert await waiting == b"here"
    finally:
        await backend.aclose()
