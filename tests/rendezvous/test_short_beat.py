"""The short path of a heartbeat (``core.brief.short_beat``, the HTTP server's plain beat)
answers exactly as the whole machine (``step``) would, or declines and changes nothing.

Random interleavings of joins, leaves, closes, reports, done, beats and silences
(hypothesis); before each step, keep-alives of every node (its own secret or a forged one, the
beat key of the status now or of an older one, or none) go both ways on copies of the state,
and a brief answer made whole from the status its key was taken from is the machine's reply.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings

from aelastic.core.brief import beat_key, brief_reply, brief_to_json, is_brief, short_beat
from aelastic.core.machine import snapshot_of, status_of, step
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request, RunState, Status
from aelastic.core.wire import reply_to_json, snapshot_to_json
from tests._machine_steps import FORGED, NODES, SECRETS, Step, scenarios

T0 = 1_000_000


def _whole(state: RunState, now: int) -> Any:
    """Everything of ``state``: membership, secrets, the beats in their order, counters."""
    return (
        json.loads(json.dumps(snapshot_to_json(snapshot_of(state, now)))),
        dict(state.secrets),
        list(state.beats.items()),
        state.generation,
        state.seq,
        state.vacated_ms,
    )


def _both(
    state: RunState, rules: Rules, node: int, secret: str, base: Status | None, now: int
) -> None:
    key = beat_key(base)
    short, whole = copy.deepcopy(state), copy.deepcopy(state)
    request = Request(Op.KEEP_ALIVE, NODES[node], rules, port=1000 + node, secret=secret)
    got = short_beat(short, NODES[node], secret, key, now)
    reply = step(whole, request, now)
    if is_brief(reply, key):
        assert got is not None, "the short path declined a plain beat"
        assert list(got) == brief_to_json(reply)
        assert _whole(short, now) == _whole(whole, now)
        assert base is not None
        made = brief_reply(list(got), base)
        assert reply_to_json(made) == reply_to_json(reply), "the brief answer stands for another"
    else:
        assert got is None, "the short path answered what the machine answers in full"
        assert _whole(short, now) == _whole(state, now), "a declined beat changed the state"


def _check_beats(state: RunState, rules: Rules, now: int, older: Status | None) -> None:
    bases: list[Status | None] = [None]
    if state.made:
        bases.append(status_of(state, now))
    if older is not None:
        bases.append(older)
    for node in range(len(NODES)):
        for secret in (SECRETS[node], FORGED):
            for base in bases:
                _both(state, rules, node, secret, base, now)


# Each example checks every node's beat, with its secret and a forged one, at every step:
# 60 examples are about 8 s of a core.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_the_short_beat_is_the_machine_s_brief_answer(scenario: tuple[Rules, list[Step]]) -> None:
    rules, steps = scenario
    # Most often a complete round first (the short path's case), then anything.
    steps = [Step(i, Op.JOIN, 1) for i in range(rules.max_nodes) if len(steps) % 4] + steps
    state = RunState("feed")
    now = T0
    older: Status | None = None
    for item in steps:
        now += item.advance_ms
        _check_beats(state, rules, now, older)
        reply = step(state, item.request(rules), now)
        older = reply.status
    _check_beats(state, rules, now + rules.window_ms + 1, older)  # everyone silent


def test_a_plain_beat_moves_the_node_last_and_answers_the_oldest() -> None:
    rules = Rules(3, 3, last_call_ms=1_000, window_ms=5_000)
    state = RunState("feed")
    for i in range(3):
        step(state, Request(Op.JOIN, NODES[i], rules, secret=SECRETS[i]), T0 + i)
    key = beat_key(status_of(state, T0 + 10))
    assert short_beat(state, NODES[0], SECRETS[0], key, T0 + 10) == (T0 + 10, T0 + 1)
    assert list(state.beats) == [NODES[1], NODES[2], NODES[0]]
    assert short_beat(state, NODES[0], FORGED, key, T0 + 11) is None
    assert short_beat(state, NodeDesc("10.9.9.9", 1, 0), SECRETS[0], key, T0 + 11) is None
    assert short_beat(state, NODES[1], SECRETS[1], key + "x", T0 + 11) is None
    # Node 1 silent past the window: the machine prunes it, not the short path.
    assert short_beat(state, NODES[0], SECRETS[0], key, T0 + 5_002) is None
    assert list(state.beats.values()) == [T0 + 1, T0 + 2, T0 + 10]


def test_a_beat_after_a_member_said_done_is_answered_in_full() -> None:
    """A member's DONE moves the status's ``done`` without its token (the barrier is not
    passed yet): a beat keyed on the status before it is not answered briefly."""
    rules = Rules(3, 3, last_call_ms=1_000, window_ms=5_000)
    state = RunState("feed")
    for i in range(3):
        step(state, Request(Op.JOIN, NODES[i], rules, secret=SECRETS[i]), T0)
    before = status_of(state, T0 + 1)
    step(state, Request(Op.DONE, NODES[1], rules, secret=SECRETS[1]), T0 + 1)
    assert status_of(state, T0 + 2).token == before.token
    _both(state, rules, 0, SECRETS[0], before, T0 + 2)
    assert short_beat(state, NODES[0], SECRETS[0], beat_key(before), T0 + 2) is None
