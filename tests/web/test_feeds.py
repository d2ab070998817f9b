"""A watched run's feed wakes on the run's status token, never on heartbeats."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aelastic.backends._engine import Engine, now_ms
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.web.feeds import FeedHub
from aelastic.web.sources import EngineSource
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio

RULES = Rules(min_nodes=1, max_nodes=2, last_call_ms=60_000, window_ms=30_000)
A, B = NodeDesc("127.0.0.1", 1, 0), NodeDesc("127.0.0.1", 2, 0)


async def test_a_run_feed_wakes_on_a_round_transition_not_on_a_heartbeat() -> None:
    engine = Engine()
    engine.apply("job", Request(Op.JOIN, A, RULES, secret=SECRET), now_ms())
    hub = FeedHub(EngineSource(engine), run_tick=60.0)  # the tick never fires here
    feed = hub.run("job")
    try:
        async with hub.watching(feed):
            with anyio.fail_after(PROMPT):
                first = await feed.next(0, PROMPT)
            assert first is not None
            version, view = first
            assert [m["node"] for m in view["participant_list"]] == [A.key]
            assert view["state"] == "forming" and view["deadline_ms"] is not None
            # Heartbeats move nothing a watcher acts on: the feed sleeps on.
            engine.apply("job", Request(Op.KEEP_ALIVE, A, RULES, secret=SECRET), now_ms())
            assert await feed.next(version, 0.5) is None
            # The second join completes the round (max nodes): the token moves, it wakes.
            engine.apply("job", Request(Op.JOIN, B, RULES, secret=SECRET), now_ms())
            with anyio.fail_after(PROMPT):
                woken = await feed.next(version, PROMPT)
            assert woken is not None
            _, view = woken
            assert view["state"] == "complete"
            assert [(m["node"], m["rank"]) for m in view["participant_list"]] == [
                (A.key, 0),
                (B.key, 1),
            ]
            assert [e["kind"] for e in view["events"]][-2:] == ["complete", "joined"]
    finally:
        await hub.aclose()


async def test_the_hub_bounds_the_runs_watched_at_once() -> None:
    from aelastic.web.feeds import FeedLimitError

    engine = Engine()
    hub = FeedHub(EngineSource(engine), max_feeds=1)
    try:
        first = hub.run("a")
        async with hub.watching(first):
            with pytest.raises(FeedLimitError):
                hub.run("b")
        await asyncio.sleep(0)
        assert hub.run("b") is not first  # an unwatched feed makes room
    finally:
        await hub.aclose()


async def test_a_run_feed_carries_the_jobs_health_as_the_rendezvous_keeps_it() -> None:
    from aelastic.core.health import FailureReport, NodeReport

    engine = Engine()
    one = Rules(1, 1, RULES.last_call_ms, RULES.window_ms)
    engine.apply("job", Request(Op.JOIN, A, one, secret=SECRET), now_ms())
    failure = FailureReport(
        time=1.0, rank=0, local_rank=0, exitcode=-9, message="Signal 9 (SIGKILL) received by PID 7"
    )
    report = Request(Op.REPORT, A, one, secret=SECRET, report=NodeReport(failure=failure))
    engine.apply("job", report, now_ms())
    hub = FeedHub(EngineSource(engine), run_tick=60.0)
    feed = hub.run("job")
    try:
        async with hub.watching(feed):
            with anyio.fail_after(PROMPT):
                first = await feed.next(0, PROMPT)
            assert first is not None
            view = first[1]["health"]
            assert view["failures"] == 1 and view["failed_nodes"] == 1
            assert view["root"]["summary"].endswith(
                "failed with signal SIGKILL: Signal 9 (SIGKILL) received by PID 7"
            )
    finally:
        await hub.aclose()
