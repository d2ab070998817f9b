"""The typed event model: the hub, reporting from below, the race helper, the handler's events."""

from __future__ import annotations

import asyncio
import logging
import uuid

import anyio
import pytest

from aelastic.core.errors import RendezvousConnectionError
from aelastic.core.events import (
    BackendError,
    BackendRetry,
    Event,
    EventHub,
    EventKind,
    EventStream,
    RendezvousEvent,
    RendezvousWaiting,
    report,
    reporting,
)
from aelastic.core.race import first_of
from tests._http_server import free_port
from tests._rendezvous_helpers import PROMPT, handler_group, join_all

pytestmark = pytest.mark.anyio


def _run_id() -> str:
    return f"events-{uuid.uuid4().hex[:8]}"


async def test_hub_delivers_to_listeners_and_streams_until_the_last_kind() -> None:
    hub = EventHub()
    heard: list[Event] = []
    remove = hub.add_listener(heard.append)
    stream = hub.stream(until=EventKind.BACKEND_ERROR)
    events = [RendezvousEvent(op="join"), BackendError(error="gone"), RendezvousEvent(op="x")]
    for event in events:
        hub.emit(event)
    assert heard == events
    assert [e async for e in stream] == events[:2]  # ends after the kind it waits for
    remove()
    hub.emit(RendezvousEvent(op="late"))
    assert len(heard) == 3
    assert not hub.listened


async def test_a_failing_listener_is_logged_and_the_others_still_hear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = EventHub()
    heard: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("listener bug")

    hub.add_listener(broken)
    hub.add_listener(heard.append)
    async with hub.stream() as stream:
        with caplog.at_level(logging.ERROR, "aelastic.events"):
            hub.emit(RendezvousEvent(op="join"))
        assert (await stream.get()).kind is EventKind.TRANSITION
    assert len(heard) == 1 and "listener failed on transition" in caplog.text


async def test_report_reaches_the_reporter_of_the_context_and_its_tasks() -> None:
    report(BackendRetry(error="nobody listens"))  # outside any reporter: dropped
    got: list[Event] = []
    with reporting(got.append):
        report(BackendRetry(error="here"))
        await asyncio.get_running_loop().create_task(_report_later())
    report(BackendRetry(error="after"))
    assert [e.error for e in got if isinstance(e, BackendRetry)] == ["here", "in a task"]


async def _report_later() -> None:
    await asyncio.sleep(0)
    report(BackendRetry(error="in a task"))


async def test_first_of_keeps_the_first_and_cancels_the_others() -> None:
    cancelled = asyncio.Event()

    async def slow() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "slow"

    async def quick() -> str:
        await asyncio.sleep(0)
        return "quick"

    with anyio.fail_after(PROMPT):
        assert await first_of(slow, quick) == (1, "quick")
    assert cancelled.is_set()  # nothing is left running when it returns


async def test_first_of_prefers_the_earlier_call_when_both_end_together() -> None:
    async def ready(value: int) -> int:
        return value

    assert await first_of(lambda: ready(0), lambda: ready(1)) == (0, 0)


async def test_first_of_raises_the_error_itself() -> None:
    async def fails() -> None:
        raise KeyError("boom")

    async def waits() -> None:
        await asyncio.sleep(60)

    with anyio.fail_after(PROMPT), pytest.raises(KeyError, match="boom"):
        await first_of(waits, fails)


async def test_cancelling_the_caller_cancels_every_call() -> None:
    started, cancelled = asyncio.Event(), []

    async def waits(name: str) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    task = asyncio.ensure_future(first_of(lambda: waits("a"), lambda: waits("b")))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == ["a", "b"]


async def test_handler_events_carry_run_node_and_round() -> None:
    run_id = _run_id()
    async with handler_group("memory", "", run_id, 2, 2, 2) as (first, second):
        heard: list[Event] = []
        first.add_listener(heard.append)
        await join_all([first, second])
        await first.leave()
        await join_all([first, second])
    transitions = [e for e in heard if isinstance(e, RendezvousEvent)]
    assert transitions and all(e.run_id == run_id for e in heard)
    assert all(e.node == str(first.node) and e.at > 0 for e in heard)
    joins = [(e.transition, e.round) for e in transitions if e.op == "join"]
    assert joins[0] == ("add_to_participants", 0)  # the round is a field of each event
    assert joins[-1] == ("mark_complete", 1) and first.round == 1


async def test_handler_publishes_each_wait_with_counts_and_deadlines() -> None:
    conf = {"last_call_timeout": 0.5, "join_timeout": 30}
    group = handler_group("memory", "", _run_id(), 2, 2, 3, **conf)
    async with group as (first, second), first.events() as events:
        join = asyncio.ensure_future(first.next_rendezvous())
        with anyio.fail_after(PROMPT):
            waiting = await _next_wait(events)
        assert waiting.participants == 1 and waiting.last_call_in is None
        assert (waiting.min_nodes, waiting.max_nodes) == (2, 3) and not waiting.waiting
        assert 0 < waiting.join_timeout_in <= 30
        other = asyncio.ensure_future(second.next_rendezvous())
        with anyio.fail_after(PROMPT):
            last_call = await _next_wait(events)
            while last_call.last_call_in is None:
                last_call = await _next_wait(events)
        assert last_call.participants == 2 and 0 <= last_call.last_call_in <= 0.5
        with anyio.fail_after(PROMPT):
            await asyncio.gather(join, other)


async def _next_wait(events: EventStream) -> RendezvousWaiting:
    while True:
        event = await events.get()
        if isinstance(event, RendezvousWaiting):
            return event


async def test_backend_retries_and_errors_reach_the_handler_listeners() -> None:
    pytest.importorskip("redis")
    endpoint = f"redis://:hidden@127.0.0.1:{free_port()}/0"  # nothing listens there
    async with handler_group("redis", endpoint, _run_id(), 1, 1, 1, read_timeout=1) as (node,):
        heard: list[Event] = []
        node.add_listener(heard.append)
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError):
            await node.next_rendezvous()
    retries = [e for e in heard if isinstance(e, BackendRetry)]
    assert retries and all(e.backend == "redis" and e.run_id == node.get_run_id() for e in retries)
    assert all("hidden" not in repr(e) and e.node == str(node.node) for e in heard)
    assert retries[0].retry_for >= retries[-1].retry_for >= 0
    errors = [e for e in heard if isinstance(e, BackendError)]
    assert len(errors) == 1 and "RendezvousConnectionError" in errors[0].error
