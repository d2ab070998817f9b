"""The Lua port of the state machine answers exactly as the Python machine does.

The same random interleavings of requests (with the clock passed in) run through the Redis
script on a real ``redis-server`` and through :func:`aelastic.core.machine.step`; every reply
and the whole state after every request must be equal: membership, secrets, the vacancy, the
participants' profiles, the members' placements, who is done and who failed, and the job's
health (read back as the backend reads it).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings

from aelastic.backends.redis import _lua, _scripts
from aelastic.backends.redis._argv import op_args
from aelastic.backends.redis._health import health_from_fields
from aelastic.core.brief import beat_key, brief_reply
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.machine import snapshot_of, status_of, step
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Placement, Reply, Request, RunState, Status
from aelastic.core.wire import (
    reply_from_json,
    reply_to_json,
    snapshot_from_json,
    snapshot_to_json,
)
from tests._machine_steps import Step, departure_scenarios, job_scenarios, scenarios
from tests._redis_server import RedisServer

T0 = 1_000_000
_runs = itertools.count()


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        c = server.client()
        try:
            yield c
        finally:
            c.close()


def _lua_step(
    c: redis.Redis, keys: _scripts.RunKeys, req: Request, now: int, base: Status | None = None
) -> Any:
    args = op_args(
        req,
        now_ms=now,
        epoch="feed",
        ttl_ms="60000",
        channel=keys.channel,
        follow_primary=False,
        beat_key=beat_key(base),
    )
    return json.loads(c.eval(_lua.OP, len(keys.rendezvous), *keys.rendezvous, *args))


def _lua_reply(doc: Any, base: Status | None) -> Reply:
    """The whole reply of a Lua answer (a brief one made whole from ``base``)."""
    if isinstance(doc, list):
        assert base is not None
        return brief_reply(doc, base)
    return reply_from_json(doc)


def _snapshot(c: redis.Redis, keys: _scripts.RunKeys, now: int) -> Any:
    return json.loads(c.eval(_lua.SNAPSHOT, len(keys.rendezvous), *keys.rendezvous, now))


def _comparable(doc: dict[str, Any]) -> dict[str, Any]:
    snap = snapshot_from_json(doc)
    return {
        "status": snap.status,
        "participants": snap.participants,
        "wait_list": sorted(snap.wait_list, key=lambda e: e.node),
        "redundancy_list": sorted(snap.redundancy_list, key=lambda e: e.node),
        "master": (snap.master_addr, snap.master_port),
        "rules": snap.rules,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_lua_and_python_agree_on_every_reply_and_state(
    client: redis.Redis, scenario: tuple[Rules, list[Step]]
) -> None:
    run_both(client, *scenario)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(departure_scenarios)
def test_lua_and_python_agree_on_departures(
    client: redis.Redis, scenario: tuple[Rules, list[Step]]
) -> None:
    run_both(client, *scenario)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job_scenarios())
def test_lua_and_python_agree_on_the_job_s_control_state(
    client: redis.Redis, scenario: tuple[Rules, list[Step]]
) -> None:
    """Complete rounds first, then reports, done, losses and the next rounds: placements,
    the exit barrier and the job's health agree."""
    run_both(client, *scenario)


def run_both(client: redis.Redis, rules: Rules, steps: list[Step]) -> None:
    keys = _scripts.RunKeys("parity", f"run-{next(_runs)}")
    state = RunState("feed")
    now = T0
    previous: Status | None = None
    for number, item in enumerate(steps):
        now += item.advance_ms
        request = item.request(rules, now)
        # A keep-alive sends the beat key of a status: the current one (the short path
        # answers when it can) or, every other time, the last reply's (maybe stale).
        base = status_of(state, now) if state.made and number % 2 else previous
        previous = step_both(client, keys, state, request, now, base, item).status


def step_both(
    client: redis.Redis,
    keys: _scripts.RunKeys,
    state: RunState,
    request: Request,
    now: int,
    base: Status | None = None,
    what: object = None,
) -> Reply:
    """``request`` through the script and the Python machine: the same reply, then the same
    state (membership, secrets, the vacancy, the job's control state)."""
    what = what or request
    got_doc = _lua_step(client, keys, request, now, base)
    reply = step(state, request, now)
    assert reply_to_json(_lua_reply(got_doc, base)) == reply_to_json(reply), what
    lua_snapshot = _snapshot(client, keys, now)
    if not state.made:  # nothing stored on either side
        assert lua_snapshot == {"absent": True}, what
        return reply
    py_snapshot = _comparable(json.loads(json.dumps(snapshot_to_json(snapshot_of(state, now)))))
    assert _comparable(lua_snapshot) == py_snapshot, what
    lua_secrets = client.hgetall(keys.rendezvous[6])
    assert {k.decode(): v.decode() for k, v in lua_secrets.items()} == {
        n.key: s for n, s in state.secrets.items()
    }, what
    assert _control_state(client, keys) == _python_control_state(state), what
    return reply


def _control_state(c: redis.Redis, keys: _scripts.RunKeys) -> dict[str, Any]:
    """The vacancy and the job's control state the script keeps, in comparable form."""
    _, _, _, _, _, _, _, _, prof, place, done, failed, _ = keys.rendezvous
    vacated = c.hget(keys.state, "vacated")
    raw_health = c.eval(_lua.HEALTH, len(keys.rendezvous), *keys.rendezvous)
    assert isinstance(raw_health, list), raw_health
    profiles = {}
    for node, value in c.hgetall(prof).items():
        size, role = value.decode("utf-8", "surrogatepass").split(" ", 1)
        profiles[node.decode()] = (role, int(size))
    return {
        "vacated": int(vacated) if vacated else None,
        "profiles": profiles,
        "placements": {
            n.decode(): tuple(int(x) for x in v.split()) for n, v in c.hgetall(place).items()
        },
        "done": {n.decode() for n in c.smembers(done)},
        "failed": {n.decode() for n in c.smembers(failed)},
        "health": health_from_fields(raw_health).to_json(),
    }


def _python_control_state(state: RunState) -> dict[str, Any]:
    return {
        "vacated": state.vacated_ms,
        "profiles": {n.key: p for n, p in state.profiles.items()},
        "placements": {
            n.key: (p.base, p.world, p.role_base, p.role_world) for n, p in state.placements.items()
        },
        "done": {n.key for n in state.done},
        "failed": {n.key for n in state.failed},
        "health": state.health.to_json(),
    }


def test_many_losses_of_a_complete_round_agree(client: redis.Redis) -> None:
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
    run_both(client, Rules(2, 6, last_call_ms=5, window_ms=2_000), join + losses)


def test_a_closed_run_used_again_agrees(client: redis.Redis) -> None:
    """Closed, left by its nodes, refused to a late node for two windows, then made again by
    a join with other rules (rare at random)."""
    steps = [Step(i, Op.JOIN, 1) for i in range(3)] + [
        Step(0, Op.CLOSE, 5),
        Step(1, Op.JOIN, 5),  # a member asks again: closed, and out
        Step(0, Op.LEAVE, 5),
        Step(5, Op.JOIN, 5),  # a late node: closed, nodes still in it
        Step(2, Op.KEEP_ALIVE, 100),
        Step(3, Op.STATUS, 2_500),  # the last one pruned: empty since its expiry
        Step(6, Op.JOIN, 1_000),  # a late node: closed, free again later
        Step(7, Op.JOIN, 3_000, variant=1),  # two windows later: a new run, its rules
        Step(4, Op.JOIN, 10),  # the old rules: refused
    ]
    run_both(client, Rules(2, 5, last_call_ms=5, window_ms=2_000), steps)


def test_ranks_of_a_large_round_agree_and_sorting_them_is_quick(client: redis.Redis) -> None:
    """4,096 nodes whose names sort differently by bytes, by a locale and by join order:
    Lua and Python give the same ranks, and the script that completes the round (and sorts
    them) keeps Redis busy for a moment only."""
    import random
    import time

    rng = random.Random(7)
    nodes = [
        NodeDesc(rng.choice(["10.0.", "10.0-", "node.", "node-", "Node_"]) + str(i % 97),
            rng.randrange(1, 10 ** rng.randrange(1, 7)), i % 3)
        for i in range(4096)
    ]  # fmt: skip
    nodes = list(dict.fromkeys(nodes))
    rules = Rules(len(nodes), len(nodes), last_call_ms=1, window_ms=600_000)
    keys = _scripts.RunKeys("parity", f"run-{next(_runs)}")
    state = RunState("feed")
    for number, node in enumerate(nodes[:-1]):
        request = Request(Op.JOIN, node, rules, port=number, secret="s" * 16)
        step(state, request, T0)
        _lua_step(client, keys, request, T0)
    last = Request(Op.JOIN, nodes[-1], rules, port=1, secret="s" * 16)
    expected = step(state, last, T0)
    started = time.perf_counter()
    got = reply_from_json(_lua_step(client, keys, last, T0))
    took = time.perf_counter() - started
    assert got.rank == expected.rank and got.master_addr == expected.master_addr
    lua_ranks = {
        e.node: e.rank for e in snapshot_from_json(_snapshot(client, keys, T0)).participants
    }
    assert lua_ranks == dict(state.participants)
    assert took < 2.0, f"completing a round of {len(nodes)} took {took:.3f} s"
    print(f"completion of {len(nodes)} nodes (sort included): {took * 1000:.1f} ms")


def test_a_plain_heartbeat_is_answered_briefly_and_news_in_full(client: redis.Redis) -> None:
    """A keep-alive with the current beat key gets ``[now, oldest]`` (the Python machine's
    reply once made whole); with a stale key, or when a beat expired, the whole reply."""
    rules = Rules(2, 3, last_call_ms=5, window_ms=2_000)
    keys = _scripts.RunKeys("parity", f"run-{next(_runs)}")
    state = RunState("feed")
    nodes = [NodeDesc("host", 1, i) for i in range(3)]
    for node in nodes:
        request = Request(Op.JOIN, node, rules, secret="s" * 16)
        step(state, request, T0)
        _lua_step(client, keys, request, T0)
    beat = Request(Op.KEEP_ALIVE, nodes[0], rules, secret="s" * 16)
    base = status_of(state, T0 + 100)
    doc = _lua_step(client, keys, beat, T0 + 100, base)
    assert isinstance(doc, list) and len(json.dumps(doc)) < 40
    assert reply_to_json(_lua_reply(doc, base)) == reply_to_json(step(state, beat, T0 + 100))
    stale = Status(token=base.token + "0", complete=True)
    assert isinstance(_lua_step(client, keys, beat, T0 + 200, stale), dict)
    step(state, beat, T0 + 200)
    other = Request(Op.KEEP_ALIVE, nodes[0], rules, secret="t" * 16)  # not its secret
    assert isinstance(_lua_step(client, keys, other, T0 + 300, status_of(state, T0 + 300)), dict)
    step(state, other, T0 + 300)
    base = status_of(state, T0 + 2_150)  # nodes 1 and 2 beat last at T0: silent too long
    doc = _lua_step(client, keys, beat, T0 + 2_150, base)
    assert isinstance(doc, dict) and doc["pruned"] == 2
    assert reply_to_json(_lua_reply(doc, base)) == reply_to_json(step(state, beat, T0 + 2_150))


def test_reports_keep_exact_times_texts_and_bounds_as_python_does(client: redis.Redis) -> None:
    """Times of 17 digits, messages with terminal escapes, non-ASCII text and a lone
    surrogate (a worker's stderr), a host and a node name longer than the health keeps,
    non-ASCII roles, a reason longer than kept: the same health and placements."""
    rules = Rules(3, 3, last_call_ms=1, window_ms=5_000)
    keys = _scripts.RunKeys("parity", f"run-{next(_runs)}")
    state = RunState("feed")
    far = NodeDesc("h" * 290 + "é" * 20, 7, 0)  # an address of 310 characters
    nodes = [far, NodeDesc("10.0.0.1", 1, 0), NodeDesc("10.0.0.2", 1, 0)]
    roles = [("trainer", 3), ("évaluateur", 2), ("trainer", 4)]
    for node, (role, size) in zip(nodes, roles, strict=True):
        join = Request(Op.JOIN, node, rules, secret="s" * 16, role=role, local_world_size=size)
        step_both(client, keys, state, join, T0)
    assert state.placements[nodes[1]] == Placement(0, 9, 0, 2)
    message = "Traceback:\n  \x1b[31mboom\x1b[0m \udcff\u2028" + "ü" * 3_000 + "\n🙂 done/"
    failures = [
        (nodes[0], FailureReport(1733475000.1234567, 2, 0, -9, message, stalled=True)),
        (nodes[1], FailureReport(1733475000.1234566, 0, 0, 1, "x\n" * 40)),
        (nodes[2], FailureReport(1733475000.1234566, 5, 1, 1, "same time, later rank")),
        (nodes[0], FailureReport(-0.0, 1, 1, 2, "")),
    ]
    for number, (node, failure) in enumerate(failures):
        report = NodeReport(failure=failure)
        request = Request(Op.REPORT, node, rules, secret="s" * 16, report=report)
        step_both(client, keys, state, request, T0 + 1 + number)
    quarantine = NodeReport(quarantine="a reason " * 50)
    request = Request(Op.REPORT, far, rules, secret="s" * 16, report=quarantine)
    step_both(client, keys, state, request, T0 + 10)
    step_both(client, keys, state, Request(Op.STATUS, far, rules), T0 + 20_000)  # all lost
    health = state.health
    assert health.latest is not None and health.latest.failed == 3
    root = health.latest.root
    assert (root.time, root.node_rank, len(root.host), len(root.node)) == (-0.0, 2, 300, 300)
    assert len(health.lost) == 3 and root.host in health.lost and root.host in health.quarantined


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({20: "", 21: "1"}, "'role'"),
        ({20: "a" * 257}, "'role'"),
        ({20: "x\x1b[31m"}, "'role'"),
        ({20: b"\xff\xfe"}, "'role'"),
        ({21: "0"}, "'local_world_size'"),
        ({21: "65537"}, "'local_world_size'"),
        ({21: "1.5"}, "'local_world_size'"),
    ],
)
def test_the_script_refuses_a_join_saying_what_python_never_sends(
    client: redis.Redis, args: dict[int, str | bytes], why: str
) -> None:
    _refused(client, Op.JOIN, args, why)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({20: "rumour"}, "a report is"),
        ({21: "inf"}, "'time'"),
        ({21: "nan"}, "'time'"),
        ({21: "0x10"}, "'time'"),
        ({21: "1e400"}, "'time'"),
        ({22: "2147483648"}, "'rank'"),
        ({23: "-1"}, "'rank'"),
        ({24: "1.0"}, "'rank'"),
        ({25: "x" * 2_001}, "'message'"),
        ({25: "ü" * 2_001}, "'message'"),
        ({25: "line\n" * 20 + "last"}, "'message'"),
        ({25: "a\rb"}, "'message'"),
        ({25: "a\u2029b".encode()}, "'message'"),
        ({25: b"\xc0\xaf"}, "'message'"),  # an overlong '/'
        ({26: "yes"}, "'stalled'"),
    ],
)
def test_the_script_refuses_a_report_saying_what_python_never_sends(
    client: redis.Redis, args: dict[int, str | bytes], why: str
) -> None:
    _refused(client, Op.REPORT, args, why)


def test_the_script_refuses_a_reason_longer_than_kept(client: redis.Redis) -> None:
    _refused(client, Op.REPORT, {20: "quarantine", 21: "r" * 301}, "'quarantine'")


def _refused(client: redis.Redis, op: Op, changes: dict[int, str | bytes], why: str) -> None:
    """A request of ``op`` with ``changes`` to its ``ARGV`` (1-based) is refused naming
    ``why``, and the run's keys are as they were."""
    rules = Rules(1, 2, last_call_ms=1, window_ms=5_000)
    keys = _scripts.RunKeys("parity", f"run-{next(_runs)}")
    node = NodeDesc("10.0.0.1", 1, 0)
    join = Request(Op.JOIN, node, rules, secret="s" * 16)
    _lua_step(client, keys, join, T0)
    report = NodeReport(failure=FailureReport(5.0, 0, 0, 1, "boom"))
    request = Request(op, node, rules, secret="s" * 16, report=report)
    argv: list[Any] = op_args(
        request, now_ms=T0 + 1, epoch="feed", ttl_ms="60000", channel=keys.channel,
        follow_primary=False, beat_key="",
    )  # fmt: skip
    for index, value in changes.items():
        argv[index - 1] = value
    before = [client.dump(k) for k in keys.rendezvous]
    doc = json.loads(client.eval(_lua.OP, len(keys.rendezvous), *keys.rendezvous, *argv))
    assert doc["error"] == "request" and why in doc["why"], doc
    assert [client.dump(k) for k in keys.rendezvous] == before
