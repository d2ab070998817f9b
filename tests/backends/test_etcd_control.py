"""The job's control state on a real etcd: placements, the exit barrier, the job's health.

The etcd port answers as the Python machine on serial interleavings
(``test_etcd_machine.py``); these tests run what a serial test cannot: members woken by
the completion placing their workers from the cut, every member done or reporting at
once, members etcd drops for their silence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aelastic.backends.etcd import EtcdBackend
from aelastic.backends.etcd._control import Seat, placement_of
from aelastic.backends.etcd._layout import sort_key
from aelastic.core import machine
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.state import NodeDesc, Placement
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._etcd_server import EtcdServer, b64
from tests._rendezvous_helpers import (
    PROMPT,
    assert_one_group,
    eventually,
    handler_group,
    join_all,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server() -> Iterator[EtcdServer]:
    with EtcdServer() as etcd:
        yield etcd


def _keys(server: EtcdServer, handler: DynamicRendezvousHandler, prefix: str) -> int:
    backend = handler.backend
    assert isinstance(backend, EtcdBackend)
    start = backend.keys.base + prefix
    end = start[:-1] + chr(ord(start[-1]) + 1)
    found = server.call("/v3/kv/range", {"key": b64(start), "range_end": b64(end),
                                         "count_only": True})  # fmt: skip
    return int(found.get("count", 0))


def _torch_placements(profiles: list[tuple[str, int]]) -> list[Placement]:
    """torch's rank assignment of members of these profiles, in rank order."""
    world = sum(size for _, size in profiles)
    placed, base, seen = [], 0, {}
    for role, size in profiles:
        role_world = sum(s for r, s in profiles if r == role)
        placed.append(Placement(base, world, seen.get(role, 0), role_world))
        base += size
        seen[role] = seen.get(role, 0) + size
    return placed


@pytest.mark.parametrize(
    "profiles",
    [
        [("default", 2)] * 5,
        [("trainer", 4), ("default", 1), ("trainer", 2), ("eval", 3), ("default", 2)],
    ],
    ids=["uniform", "mixed"],
)
async def test_members_place_their_workers_as_torch_does(
    server: EtcdServer, profiles: list[tuple[str, int]]
) -> None:
    """Every member (the one that completes the round, and those its completion wakes)
    works out its workers' ranks from what it reads at the cut: a uniform job writes no
    profile mark at all."""
    run = f"placed-{len(set(profiles))}"
    async with handler_group("etcd", server.endpoint, run, 5, 5, 5) as handlers:
        for handler, (role, size) in zip(handlers, profiles, strict=True):
            handler.set_profile(role, size)
        infos = await join_all(handlers)
        assert_one_group(infos, 5)
        by_rank = sorted(zip(infos, handlers, profiles, strict=True), key=lambda x: x[0].rank)
        expected = _torch_placements([p for _, _, p in by_rank])
        assert [h.placement for _, h, _ in by_rank] == expected
        marks = _keys(server, handlers[0], "pm/")
        assert marks == (0 if len(set(profiles)) == 1 else 4)  # but the run's creator's


async def test_the_exit_barrier_passes_when_every_member_is_done_at_once(
    server: EtcdServer,
) -> None:
    """Every member says it is done at the same moment (no write of them sees all the
    others'): the last one still makes the header say so, and every watcher wakes."""
    async with handler_group("etcd", server.endpoint, "barrier", 6, 6, 6) as handlers:
        await join_all(handlers)
        watchers = [asyncio.ensure_future(h.watch()) for h in handlers]
        taken = await asyncio.gather(*(h.mark_done() for h in handlers))
        assert all(taken)
        with anyio.fail_after(PROMPT):
            views = await asyncio.gather(*watchers)
        assert all(v.all_done and not v.lost_count for v in views), views
        assert not any(await asyncio.gather(*(h.mark_done() for h in handlers)))  # once
        await handlers[0].is_closed()  # a status request
        status = handlers[0].status
        assert status is not None and status.done == 6 and status.all_done


async def test_a_done_member_dropped_by_etcd_counts_as_finished(server: EtcdServer) -> None:
    """A member that said it was done and then went silent (its lease expired) is
    finished, not lost: its done mark has no lease; its host is not counted lost."""
    conf = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 2}
    async with handler_group("etcd", server.endpoint, "done-dropped", 3, 3, 3, **conf) as group:
        infos = await join_all(group)
        by_rank = sorted(zip(infos, group, strict=True), key=lambda x: x[0].rank)
        survivors = [h for _, h in by_rank[:2]]  # ranks 0, 1: sentinels
        victim = by_rank[2][1]
        assert await victim.mark_done()
        await victim._heartbeats.stop()  # silent from now on, as if killed
        with anyio.fail_after(PROMPT):
            views = await asyncio.gather(*(h.watch() for h in survivors))
        assert all(v.finished == 1 and v.lost_count == 0 and not v.all_done for v in views)
        health = await survivors[0].health()
        assert health is not None and not health.lost


async def test_hosts_of_members_dropped_by_etcd_are_counted_lost_not_those_that_left(
    server: EtcdServer,
) -> None:
    conf = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 2}
    async with handler_group("etcd", server.endpoint, "lost-hosts", 4, 2, 4, **conf) as group:
        infos = await join_all(group)
        by_rank = [h for _, h in sorted(zip(infos, group, strict=True), key=lambda x: x[0].rank)]
        await by_rank[3].shutdown()  # a leave: lost to the round, its host not counted
        with anyio.fail_after(PROMPT):
            await asyncio.gather(*(h.watch() for h in by_rank[:3]))
        health = await by_rank[0].health()
        assert health is not None and not health.lost
        await by_rank[2]._heartbeats.stop()  # silent: etcd drops it

        async def counted() -> bool:
            health = await by_rank[0].health()
            return health is not None and bool(health.lost)

        await eventually(counted)
        health = await by_rank[0].health()
        status = by_rank[0].status
        assert health is not None and status is not None
        assert dict(health.lost)["127.0.0.1"].count == 1
        assert dict(health.lost)["127.0.0.1"].round == status.round


async def test_a_drop_after_many_leaves_is_named_without_reading_each_leave(
    server: EtcdServer,
) -> None:
    """36 of 40 members leave (their collectives broke), then one goes silent and etcd drops
    it: the survivors' requests name it from the history after the newest leave's mark, not
    by reading and checking each leave's deletion (every deletion since the header's last
    write, before: O(N) per request, O(N²) for the round at 1,024 nodes)."""
    conf = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 2}
    run = "drop-after-leaves"
    async with handler_group("etcd", server.endpoint, run, 40, 2, 40, **conf) as group:
        infos = await join_all(group, within=60.0)
        by_rank = [h for _, h in sorted(zip(infos, group, strict=True), key=lambda x: x[0].rank)]
        await asyncio.gather(*(h.shutdown() for h in by_rank[4:]))
        survivors, silent = by_rank[:3], by_rank[3]
        deletions: list[int] = []  # deletion events read by each lookup of names
        ports = [h.backend._port for h in survivors]  # type: ignore[attr-defined]
        for client in {id(p._client): p._client for p in ports}.values():
            _count_lookup_events(client, deletions)
        await silent._heartbeats.stop()  # silent: etcd drops it

        async def counted() -> bool:
            health = await survivors[0].health()
            return health is not None and bool(health.lost)

        await eventually(counted)
        health = await survivors[0].health()
        assert health is not None and dict(health.lost)["127.0.0.1"].count == 1
        assert deletions and max(deletions) <= 4, deletions


def _count_lookup_events(client: Any, counts: list[int]) -> None:
    """Spy on ``client``'s watches of deletions (the lookups of lost names): each one's
    deletion events go into ``counts`` (the calls themselves go to etcd as they were)."""
    real = client.stream

    @asynccontextmanager
    async def stream(path: str, body: Any, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        create = body.get("create_request", {}) if isinstance(body, dict) else {}
        async with real(path, body, timeout) as messages:
            if create.get("filters") != ["NOPUT"]:
                yield messages
                return
            counts.append(0)

            async def counting() -> Any:
                async for message in messages:
                    counts[-1] += len(message.get("events", []))
                    yield message

            yield counting()

    client.stream = stream


def _failure(time: float, secondary: bool) -> NodeReport:
    return NodeReport(
        failure=FailureReport(
            time=time, rank=0, local_rank=0, exitcode=1 if not secondary else -6,
            message="boom" if not secondary else "peer gone", secondary=secondary,
        )
    )  # fmt: skip


async def test_every_member_reporting_at_once_makes_one_incident_counting_all(
    server: EtcdServer,
) -> None:
    """Six members report their failures at the same moment: one incident, its root cause
    the worker's own failure (the others broke in a collective), six failed; the next
    round's incident keeps that count and counts its own."""
    async with handler_group("etcd", server.endpoint, "reports", 6, 2, 6) as group:
        infos = await join_all(group)
        primary = group[3]
        reports = [_failure(10.0 + i, secondary=h is not primary) for i, h in enumerate(group)]
        taken = await asyncio.gather(*(h.report(r) for h, r in zip(group, reports, strict=True)))
        assert all(taken)
        health = await group[0].health()
        assert health is not None and health.incidents_total == 1
        latest = health.latest
        assert latest is not None and latest.failed == 6
        assert group[0].status is not None and latest.round == group[0].status.round
        assert latest.root.node == primary.node.key
        assert latest.root.node_rank == infos[3].rank
        assert _keys(server, group[0], "x/") == 6
        # The next round: four leave, two join again and report.
        for handler in group[2:]:
            await handler.leave()
        again = group[:2]
        await join_all(again)
        assert all(await asyncio.gather(*(h.report(_failure(1.0, False)) for h in again)))
        health = await again[0].health()
        assert health is not None and health.incidents_total == 2
        assert [i.failed for i in health.incidents] == [6, 2]
        assert _keys(server, again[0], "x/") == 2  # the older incident's marks are gone


async def test_a_waiting_node_sets_its_own_host_aside(server: EtcdServer) -> None:
    """A quarantine is a report of the node's own host, from any list of the run; the
    health of a run with no state is ``None``."""
    async with handler_group("etcd", server.endpoint, "aside", 3, 2, 2) as group:
        await join_all(group[:2])
        assert await group[0].health() is not None
        late = asyncio.ensure_future(group[2].next_rendezvous())  # waits for the next round

        async def waiting() -> bool:
            snapshot = await group[0].backend.snapshot()
            return snapshot is not None and bool(snapshot.redundancy_list)

        await eventually(waiting)
        assert await group[2].report(NodeReport(quarantine="flaky GPU"))
        assert not await group[2].report(NodeReport(quarantine="again"))  # set aside already
        health = await group[0].health()
        assert health is not None and dict(health.quarantined) == {"127.0.0.1": "flaky GPU"}
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
    async with handler_group("etcd", server.endpoint, "no-such-run", 1, 1, 1) as (nobody,):
        assert await nobody.health() is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["default", "trainer", "eval"]), st.integers(1, 8)),
             min_size=1, max_size=12),
    st.tuples(st.sampled_from(["default", "trainer", "eval"]), st.integers(1, 8)),
)  # fmt: skip
def test_a_placement_from_the_marks_is_the_machines(
    profiles: list[tuple[str, int]], run_profile: tuple[str, int]
) -> None:
    """Whatever the run's profile and the members', a member's placement worked out from
    its rank and the marks of the members of another profile is the machine's."""
    order = [NodeDesc("10.0.0.1", pid, 0) for pid in range(len(profiles))]  # rank order
    expected = machine._placements(order, dict(zip(order, profiles, strict=True)))
    marks = tuple(
        (sort_key(node), profile)
        for node, profile in zip(order, profiles, strict=True)
        if profile != run_profile
    )
    for rank, node in enumerate(order):
        seat = Seat(rank, marks)
        assert placement_of(seat, sort_key(node), len(order), run_profile) == expected[node]
