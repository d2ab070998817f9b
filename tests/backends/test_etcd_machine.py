"""The etcd port of the state machine answers exactly as the Python machine does.

The same random interleavings of requests (with the clock passed in) run through the etcd
port on a real ``etcd`` and through :func:`aelastic.core.machine.step`; every reply and the
whole state after every request must be equal: the membership, and the job's control state
(each member's placement, the members done and failed, the job's health). Silence is etcd's
to judge (a node's lease expires): before each request, the nodes the machine prunes at that
moment have their leases revoked, in the machine's order, and the port must then do what the
machine's pruning does.

Left out of the comparison, by design: heartbeat times (etcd keeps leases, not beat times:
``oldest_beat_ms`` and a snapshot's ``beat_ms``), and how many nodes a request pruned (etcd
removed them before the request; ``pruned``, and ``PRUNE`` for a request that did nothing
else). For the same reason, when etcd drops the last nodes of a run, the port dates the
run's vacancy by the request that finds it empty (the machine: by the last node's expiry,
earlier): the machine is given that date here (:func:`_step`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from aelastic.backends.etcd._apply import RunPort
from aelastic.backends.etcd._client import EtcdClient, b64, unb64
from aelastic.backends.etcd._control import placement_of
from aelastic.backends.etcd._endpoint import parse_endpoint
from aelastic.backends.etcd._layout import RunKeys, decode_header, node_of, prefix_end, sort_key
from aelastic.backends.etcd._leases import Deadlines, Leases
from aelastic.core import machine
from aelastic.core.machine import health_of, snapshot_of, step
from aelastic.core.params import Rules
from aelastic.core.state import Op, Reply, Request, RunState, Snapshot, Transition
from aelastic.core.token import make
from aelastic.core.wire import reply_to_json, snapshot_to_json
from tests._etcd_server import EtcdServer
from tests._machine_steps import Step, scenarios

T0 = 1_000_000
_runs = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[EtcdServer]:
    with EtcdServer() as etcd:
        yield etcd


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(server: EtcdServer, loop: asyncio.AbstractEventLoop) -> Iterator[EtcdClient]:
    c = EtcdClient(parse_endpoint(server.endpoint, {}), read_timeout=10)
    yield c
    loop.run_until_complete(c.aclose())


def _reply(reply: Reply) -> dict[str, Any]:
    transition = Transition.NONE if reply.transition is Transition.PRUNE else reply.transition
    doc = reply_to_json(replace(reply, oldest_beat_ms=None, pruned=0, transition=transition))
    return json.loads(json.dumps(doc))


def _snapshot(snap: Snapshot | None) -> Any:
    if snap is None:
        return None
    doc = snapshot_to_json(snap)
    for where in ("participants", "wait_list", "redundancy_list"):
        rows = [[row[0], 0, *row[2:]] for row in doc[where]]
        doc[where] = rows if where == "participants" else sorted(rows)
    return json.loads(json.dumps(doc))


def _step(state: RunState, request: Request, now: int, empties: bool) -> Reply:
    """The machine's step; when its pruning ``empties`` the run, with the run's vacancy
    dated ``now`` (as the port, which cannot know when etcd dropped the nodes, dates it):
    pruned first, and the generation moved once for both, as in one request."""
    if not empties:
        return step(state, request, now)
    before, generation = machine._signature(state), state.generation
    machine.prune(state, now)
    state.vacated_ms = now
    reply = step(state, request, now)
    state.generation = generation + (machine._signature(state) != before)
    if not state.made:
        return reply
    return replace(reply, status=replace(reply.status, token=make(state.epoch, state.generation)))


async def _keys_under(client: EtcdClient, prefix: str, revision: int = 0) -> list[str]:
    body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)),
                            "keys_only": True}  # fmt: skip
    if revision:
        body["revision"] = revision
    answer = await client.call("/v3/kv/range", body, "test")
    return [unb64(kv["key"]).decode()[len(prefix) :] for kv in answer.get("kvs", [])]


async def _control(client: EtcdClient, port: RunPort, keys: RunKeys) -> dict[str, Any]:
    """The port's control state: placements (each member's, worked out as it does at the
    cut), the members done and failed in the round, the job's health."""
    answer = await client.call("/v3/kv/range", {"key": b64(keys.header)}, "test")
    if not answer.get("kvs"):
        return {"health": None}
    header = decode_header(unb64(answer["kvs"][0]["value"]), "test")
    cut = await client.call("/v3/kv/range", {"key": b64(keys.cut)}, "test")
    placements = {}
    if header.complete and cut.get("kvs"):
        at = int(cut["kvs"][0]["mod_revision"])
        for suffix in await _keys_under(client, keys.participants, at):
            node = node_of(suffix)
            seat = await port.seat(node, at)
            placed = placement_of(seat, sort_key(node), header.world, header.profile)
            placements[node.key] = [placed.base, placed.world, placed.role_base,
                                    placed.role_world]  # fmt: skip
    done = sorted(node_of(n).key for n in await _keys_under(client, keys.done))
    marks = await _keys_under(client, keys.failed(header.round)) if header.complete else []
    health = await port.health()
    return {
        "placements": placements,
        "done": done,
        "failed": sorted(node_of(n).key for n in marks),
        "health": None if health is None else health.to_json(),
    }


def _control_of(state: RunState) -> dict[str, Any]:
    """The machine's control state (see :func:`_control`)."""
    if not state.made:
        return {"health": None}
    placements = {}
    if state.complete:
        placements = {n.key: [p.base, p.world, p.role_base, p.role_world]
                      for n, p in state.placements.items()}  # fmt: skip
    return {
        "placements": placements,
        "done": sorted(n.key for n in state.done),
        "failed": sorted(n.key for n in state.failed),
        "health": health_of(state).to_json(),
    }


async def run_both(client: EtcdClient, rules: Rules, steps: list[Step]) -> None:
    keys = RunKeys("/parity", f"run-{next(_runs)}")
    leases = Leases(client, ttl=3600)
    port = RunPort(client, keys, leases, Deadlines())
    state = RunState("feed")
    now = T0
    try:
        for item in steps:
            now += item.advance_ms
            expired = now - (state.rules or rules).window_ms  # the run's own window
            dead = sorted((b, n.key, n) for n, b in state.beats.items() if b < expired)
            for _, _, node in dead:
                lease = leases.of(node)
                assert lease is not None, node
                await client.call("/v3/lease/revoke", {"ID": lease}, "revoke")
                leases.forget(node)
            empties = bool(dead) and len(dead) == len(state.beats)
            request = item.request(rules)
            first = request.op is Op.JOIN and leases.of(request.node) is None
            expected = _reply(_step(state, request, now, empties))
            got = _reply(await port.apply(request, now, epoch="feed"))
            counted = (got["status"]["participants"], expected["status"]["participants"])
            if first and got["outcome"] == "wait" and counted[0] != counted[1]:
                # A node's first join that cannot have made min_nodes reports the count
                # the revisions since the run began bound (RunPort.first_join): more than
                # the machine's only when keys were deleted meanwhile.
                assert counted[1] < counted[0] < rules.min_nodes, item
                got["status"]["participants"] = counted[1]
            assert got == expected, item
            mine = _snapshot(await port.snapshot(now))
            theirs = _snapshot(snapshot_of(state, now) if state.made else None)
            assert mine == theirs, item
            assert await _control(client, port, keys) == _control_of(state), item
    finally:
        await leases.revoke_all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(scenarios)
def test_port_and_python_agree_on_every_reply_and_state(
    client: EtcdClient, loop: asyncio.AbstractEventLoop, scenario: tuple[Rules, list[Step]]
) -> None:
    loop.run_until_complete(run_both(client, *scenario))


def test_many_losses_of_a_complete_round_agree(
    client: EtcdClient, loop: asyncio.AbstractEventLoop
) -> None:
    """Several members lost, left, finished and pruned after completion (rare at random)."""
    join = [Step(i, Op.JOIN, 1) for i in range(6)]
    losses = [
        Step(1, Op.LEAVE, 10),
        Step(2, Op.LEAVE, 10, finished=True),
        Step(3, Op.LEAVE, 10),
        Step(0, Op.KEEP_ALIVE, 100),
        Step(5, Op.KEEP_ALIVE, 100),
        Step(0, Op.KEEP_ALIVE, 2_500),  # 4 went silent: pruned
        Step(5, Op.JOIN, 10),
        Step(0, Op.LEAVE, 10),
        Step(5, Op.LEAVE, 10),  # the last one: the next round opens
        Step(1, Op.JOIN, 10),
    ]
    loop.run_until_complete(run_both(client, Rules(2, 6, last_call_ms=5, window_ms=2_000),
                                     join + losses))  # fmt: skip


def test_a_closed_run_used_again_agrees(
    client: EtcdClient, loop: asyncio.AbstractEventLoop
) -> None:
    """Closed, left by its nodes, refused to a late node for two windows, then made again by
    a join with other rules (rare at random)."""
    steps = [Step(i, Op.JOIN, 1) for i in range(3)] + [
        Step(0, Op.CLOSE, 5),
        Step(1, Op.JOIN, 5),  # a member asks again: closed, and out
        Step(0, Op.LEAVE, 5),
        Step(5, Op.JOIN, 5),  # a late node: closed, nodes still in it
        Step(2, Op.KEEP_ALIVE, 100),
        Step(3, Op.STATUS, 2_500),  # the last one dropped by etcd: empty from now
        Step(6, Op.JOIN, 1_000),  # a late node: closed, free again later
        Step(7, Op.JOIN, 3_000, variant=1),  # two windows later: a new run, its rules
        Step(4, Op.JOIN, 10),  # the old rules: refused
        Step(0, Op.LEAVE, 10, forged=True),  # another client's: nothing
        Step(7, Op.CLOSE, 10),  # the new run's member closes it
        Step(7, Op.LEAVE, 10),  # and leaves: empty at once
        Step(2, Op.JOIN, 2),  # the new run's window (1 ms) twice later: made again
    ]
    loop.run_until_complete(run_both(client, Rules(2, 5, last_call_ms=5, window_ms=2_000),
                                     steps))  # fmt: skip


def test_the_control_state_agrees_through_reports_done_and_losses(
    client: EtcdClient, loop: asyncio.AbstractEventLoop
) -> None:
    """Members of other profiles, failures reported (a better root cause, then a worse
    one), a host set aside, members done (one then dropped by etcd: finished), a member
    lost to its silence (its host counted), the next round's incident keeping the first's
    count (rare at random in this order)."""
    steps = [Step(i, Op.JOIN, 1) for i in range(4)] + [
        Step(2, Op.REPORT, 5, variant=1),  # secondary: a new incident
        Step(1, Op.REPORT, 5, variant=0),  # the worker's own failure: the root now
        Step(3, Op.REPORT, 5, variant=1),  # worse: its mark only
        Step(1, Op.REPORT, 5, variant=3),  # its host set aside
        Step(5, Op.REPORT, 5, variant=0),  # no member: nothing
        Step(0, Op.DONE, 5),
        Step(0, Op.DONE, 5),  # once
        Step(1, Op.KEEP_ALIVE, 1_000),
        Step(2, Op.KEEP_ALIVE, 0),
        Step(3, Op.KEEP_ALIVE, 0),
        Step(1, Op.STATUS, 1_500),  # 0 (done) dropped: finished
        Step(3, Op.KEEP_ALIVE, 600),
        Step(1, Op.KEEP_ALIVE, 0),
        Step(1, Op.STATUS, 1_500),  # 2 dropped: lost, its host counted
        Step(1, Op.LEAVE, 5),
        Step(3, Op.LEAVE, 5),  # the last: the next round opens
        Step(4, Op.JOIN, 5),
        Step(6, Op.JOIN, 5),
        Step(6, Op.REPORT, 5, variant=2),  # a new incident: the first keeps its count
        Step(4, Op.DONE, 5),
        Step(6, Op.DONE, 5),  # all done
    ]
    loop.run_until_complete(run_both(client, Rules(2, 4, last_call_ms=5, window_ms=2_000),
                                     steps))  # fmt: skip


def test_a_member_that_left_finished_is_never_named_among_the_lost(
    client: EtcdClient, loop: asyncio.AbstractEventLoop
) -> None:
    """A second finished leave writes no header (the flag is set already); a member etcd
    drops afterwards is named lost, the finished one is not (its deletion is in the same
    history the names are read from)."""
    steps = [Step(i, Op.JOIN, 1) for i in range(5)] + [
        Step(1, Op.LEAVE, 5, finished=True),  # the finished flag: a header write
        Step(2, Op.LEAVE, 5, finished=True),  # no header write
        Step(0, Op.KEEP_ALIVE, 1_000),
        Step(3, Op.KEEP_ALIVE, 0),
        Step(0, Op.STATUS, 1_500),  # 4 dropped: lost, named, its host counted
    ]
    loop.run_until_complete(run_both(client, Rules(2, 5, last_call_ms=5, window_ms=2_000),
                                     steps))  # fmt: skip


def test_leaves_past_a_full_lost_sample_and_a_drop_among_them_agree(
    client: EtcdClient, loop: asyncio.AbstractEventLoop
) -> None:
    """Members leaving once the lost sample is full write their own marks, not the header;
    a member etcd drops afterwards (its deletion in the same history as theirs) is counted
    lost in the job's health, none of those that left is (rare at random: five members lost
    in one round)."""
    steps = [Step(i, Op.JOIN, 1) for i in range(8)] + [
        Step(1, Op.LEAVE, 5),  # the lost flag and the sample: header writes
        Step(2, Op.LEAVE, 5),
        Step(3, Op.LEAVE, 5),
        Step(4, Op.LEAVE, 5),  # the sample is full
        Step(5, Op.LEAVE, 5),  # its mark only
        Step(0, Op.KEEP_ALIVE, 1_000),
        Step(6, Op.KEEP_ALIVE, 0),
        Step(0, Op.STATUS, 1_500),  # 7 dropped: counted, its host lost; not in the sample
        Step(6, Op.LEAVE, 5),
        Step(0, Op.KEEP_ALIVE, 5),
        Step(5, Op.JOIN, 5),  # waits for the next round
        Step(0, Op.LEAVE, 5),  # the last: the next round opens, the marks cleared
        Step(5, Op.JOIN, 5),
        Step(1, Op.JOIN, 5),
        Step(5, Op.KEEP_ALIVE, 1_000),
        Step(5, Op.STATUS, 1_500),  # 1 dropped from the new round: named, counted
    ]
    loop.run_until_complete(run_both(client, Rules(2, 8, last_call_ms=5, window_ms=2_000),
                                     steps))  # fmt: skip
