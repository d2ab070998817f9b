"""The fixture every ported torch scenario runs through: nodes of one run on one backend,
driven by aelastic's async handler or by torch's blocking names (:mod:`aelastic.sync`).

How it works: ``deployment`` is narrowed to the plain deployment of each backend (memory, a
real redis-server, a real HTTP server, a real etcd, and ``c10d`` hosted by an agent of the
session; the Sentinel, Cluster and etcd-cluster deployments have their own conformance
suite). ``facade`` is ``async`` or ``sync`` (a scenario marked ``ASYNC_ONLY`` runs through the
async handler only). A :class:`Node` has torch's handler methods as
coroutines whichever facade drives it: through the sync facade each call blocks a worker
thread, as a torch program's call blocks its thread, so a node waiting for its round in one
thread is released by another node's call in another. ``nodes(count, min, max, **conf)``
makes ``count`` such nodes of this test's run; every one is released at the end.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import pytest

from aelastic import RendezvousInfo, RendezvousParameters
from aelastic.core.state import Snapshot, Status
from aelastic.rendezvous import DynamicRendezvousHandler, NodeDesc, create_handler
from aelastic.store import Store
from aelastic.sync import SyncRendezvousHandler, SyncStore
from aelastic.sync import create_handler as create_sync_handler
from tests._rendezvous_helpers import PROMPT

from ..conftest import BACKENDS, MakeParams

T = TypeVar("T")

#: Short heartbeats for scenarios about liveness: a 0.4 s window (two beats of 0.2 s).
SHORT_BEATS: dict[str, Any] = {"keep_alive_interval": 0.2, "keep_alive_max_attempt": 2}


#: The facades a scenario runs through, unless it says otherwise (``@ASYNC_ONLY``).
FACADES = ("async", "sync")

#: For scenarios whose course is set by time and the backend, not by how a program calls
#: the handler (the last call, heartbeats, pruning): the sync facade runs the same
#: coroutines on its own loop, so running them through it too would add time, not coverage.
ASYNC_ONLY = pytest.mark.facades("async")

#: The backends whose store is a server of its own, which can hang, die or be cut off.
SERVED = [name for name in BACKENDS if name != "memory"]


@pytest.hookimpl(tryfirst=True)  # before the fixtures' own parameters (deployment's)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``deployment``: the plain deployment of each backend (this suite narrows the
    conformance suite's list), or of those named by ``backends(...)``; ``facade``: ``async``
    (:class:`DynamicRendezvousHandler`) or ``sync`` (torch's blocking names), both unless
    ``facades(...)`` names one."""
    for name, marker_name, default in (
        ("deployment", "backends", BACKENDS),
        ("facade", "facades", list(FACADES)),
    ):
        if name in metafunc.fixturenames:
            marker = metafunc.definition.get_closest_marker(marker_name)
            metafunc.parametrize(name, list(marker.args) if marker else default)


class RoundStore:
    """The round's store, awaited whichever facade gave it."""

    def __init__(self, store: Store | SyncStore) -> None:
        self._store = store

    async def set(self, key: str, value: bytes | str) -> None:
        if isinstance(self._store, SyncStore):
            await _in_thread(self._store.set, key, value)
        else:
            await self._store.set(key, value)

    async def get(self, key: str) -> bytes:
        if isinstance(self._store, SyncStore):
            return await _in_thread(self._store.get, key)
        return await self._store.get(key)


async def _in_thread(call: Callable[..., T], *args: Any) -> T:
    """A blocking call in a worker thread (the test's loop goes on meanwhile), abandoned if
    the test is cancelled: ``abandon_on_cancel`` from anyio 4.1, ``cancellable`` on 4.0 (the
    oldest release pyproject.toml admits)."""
    run = functools.partial(call, *args)
    abandon = {_ABANDON: True}
    result: T = await anyio.to_thread.run_sync(run, limiter=_threads(), **abandon)
    return result


_ABANDON = (
    "abandon_on_cancel"
    if "abandon_on_cancel" in inspect.signature(anyio.to_thread.run_sync).parameters
    else "cancellable"
)
#: Per event loop: enough threads for every node of a scenario to block at once (made in
#: the loop: anyio 4.0 makes no limiter outside one).
_LIMITERS: dict[object, anyio.CapacityLimiter] = {}


def _threads() -> anyio.CapacityLimiter:
    loop = asyncio.get_running_loop()
    if loop not in _LIMITERS:
        _LIMITERS.clear()  # the loops of earlier tests are over
        _LIMITERS[loop] = anyio.CapacityLimiter(64)
    return _LIMITERS[loop]


class Node:
    """One node of the run: torch's handler methods, awaited, through either facade."""

    def __init__(self, params: RendezvousParameters, facade: str) -> None:
        self.params = params
        self.facade = facade
        self._sync: SyncRendezvousHandler | None = None
        self._async: DynamicRendezvousHandler | None = None
        if facade == "sync":
            self._sync = create_sync_handler(params)
            self.handler = self._sync.async_handler
        else:
            self._async = create_handler(params)
            self.handler = self._async

    def __repr__(self) -> str:
        return f"Node({self.facade}, {self.node})"

    @property
    def node(self) -> NodeDesc:
        return self.handler.node

    async def _call(self, name: str, *args: Any) -> Any:
        if self._sync is not None:
            return await _in_thread(getattr(self._sync, name), *args)
        assert self._async is not None
        return await getattr(self._async, name)(*args)

    async def next_rendezvous(self) -> RendezvousInfo[RoundStore]:
        info = await self._call("next_rendezvous")
        return RendezvousInfo(
            RoundStore(info.store), info.rank, info.world_size, info.bootstrap_store_info
        )

    async def is_closed(self) -> bool:
        closed: bool = await self._call("is_closed")
        return closed

    async def set_closed(self) -> None:
        await self._call("set_closed")

    async def num_nodes_waiting(self) -> int:
        waiting: int = await self._call("num_nodes_waiting")
        return waiting

    async def shutdown(self) -> bool:
        done: bool = await self._call("shutdown")
        return done

    def get_run_id(self) -> str:
        return self._sync.get_run_id() if self._sync is not None else self.handler.get_run_id()

    def get_backend(self) -> str:
        return self._sync.get_backend() if self._sync is not None else self.handler.get_backend()

    @property
    def use_agent_store(self) -> bool:
        if self._sync is not None:
            return self._sync.use_agent_store
        return self.handler.use_agent_store

    async def die(self) -> None:
        """Go silent as a node whose process died: no more heartbeats, no goodbye (the
        backend is released, the shared state is left as it is)."""
        await self._call("close" if self._sync is not None else "aclose")

    async def release(self) -> None:
        await self.die()


NodeFactory = Callable[..., Awaitable[list[Node]]]
Observer = Callable[[], Awaitable[Snapshot]]


@pytest.fixture
async def nodes(make_params: MakeParams, facade: str) -> AsyncIterator[NodeFactory]:
    """``await nodes(count, min_nodes, max_nodes, **conf)``: nodes of this test's run."""
    made: list[Node] = []

    async def make(count: int, min_nodes: int, max_nodes: int, **conf: Any) -> list[Node]:
        params = make_params(min_nodes, max_nodes, **conf)
        new = [Node(params, facade) for _ in range(count)]
        made.extend(new)
        return new

    yield make
    with anyio.CancelScope(shield=True), anyio.move_on_after(PROMPT):
        for node in made:
            await node.release()


@pytest.fixture
async def observer(make_params: MakeParams) -> AsyncIterator[Observer]:
    """``await observer()``: the run's stored state, read by a handler that never joins
    (what torch's tests read from the backend's state); an empty state before any join."""
    params = make_params(1, 1)
    handler = create_handler(params)

    async def snapshot() -> Snapshot:
        taken = await handler.backend.snapshot()
        return Snapshot(status=Status()) if taken is None else taken  # no run yet: empty

    yield snapshot
    with anyio.CancelScope(shield=True):
        await handler.aclose()


async def join_all(group: list[Node], within: float = PROMPT) -> list[RendezvousInfo[RoundStore]]:
    """Every node's ``next_rendezvous()`` at once; the answers in the group's order."""
    answers: list[RendezvousInfo[RoundStore] | None] = [None] * len(group)

    async def join(index: int) -> None:
        answers[index] = await group[index].next_rendezvous()

    with anyio.fail_after(within):
        async with anyio.create_task_group() as tasks:
            for index in range(len(group)):
                tasks.start_soon(join, index)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


async def until(check: Callable[[], Awaitable[bool]], within: float = PROMPT) -> None:
    """Wait until ``check()`` holds (asked every 20 ms), at most ``within`` seconds (for
    conditions nothing notifies: a node listed in the stored state)."""
    with anyio.fail_after(within):
        for _ in range(int(within / 0.02) + 2):
            if await check():
                return
            await anyio.sleep(0.02)
        raise AssertionError("the condition never held")


HandlerFactory = Callable[..., list[DynamicRendezvousHandler]]


@pytest.fixture
async def agent_handlers(make_params: MakeParams) -> AsyncIterator[HandlerFactory]:
    """``agent_handlers(count, min_nodes, max_nodes, **conf)``: async handlers of this
    test's run on the backend under test, one per agent (released at the end)."""
    made: list[DynamicRendezvousHandler] = []

    def make(
        count: int, min_nodes: int, max_nodes: int, **conf: Any
    ) -> list[DynamicRendezvousHandler]:
        params = make_params(min_nodes, max_nodes, **conf)
        new = [create_handler(params) for _ in range(count)]
        made.extend(new)
        return new

    yield make
    with anyio.CancelScope(shield=True), anyio.move_on_after(PROMPT):
        for handler in made:
            await handler.aclose()


@pytest.fixture
async def solo_handlers(run_id: str) -> AsyncIterator[HandlerFactory]:
    """:func:`agent_handlers` on the memory backend only: for one-node scenarios, whose
    course does not depend on the backend (the rendezvous of one node)."""
    made: list[DynamicRendezvousHandler] = []

    def make(
        count: int, min_nodes: int, max_nodes: int, **conf: Any
    ) -> list[DynamicRendezvousHandler]:
        conf = {"join_timeout": 20, "last_call_timeout": 0.1, **conf}
        params = RendezvousParameters(
            "memory", "torch-agents", run_id, min_nodes, max_nodes, **conf
        )
        new = [create_handler(params) for _ in range(count)]
        made.extend(new)
        return new

    yield make
    with anyio.CancelScope(shield=True), anyio.move_on_after(PROMPT):
        for handler in made:
            await handler.aclose()
