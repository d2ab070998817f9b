"""The JSON forms of requests, replies, statuses and snapshots: round trips and bad input."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aelastic.core.machine import snapshot_of, step
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request, RunState
from aelastic.core.wire import (
    WireError,
    reply_from_json,
    reply_to_json,
    request_from_json,
    request_to_json,
    snapshot_from_json,
    snapshot_to_json,
    status_from_json,
    status_to_json,
)

RULES = Rules(1, 3, last_call_ms=100, window_ms=1_000)
NODES = [NodeDesc("host_with_underscores.example", 4242, i) for i in range(3)]
SECRET = "5ec2e7" * 6


def _join() -> dict[str, Any]:
    return request_to_json(Request(Op.JOIN, NODES[0], RULES, secret=SECRET))


def _formed() -> RunState:
    s = RunState("abc123")
    for node in NODES:
        step(s, Request(Op.JOIN, node, RULES, port=7), 1_000)
    return s


def test_round_trips() -> None:
    s = _formed()
    reply = step(s, Request(Op.JOIN, NODES[0], RULES), 1_001)
    assert reply_from_json(json.loads(json.dumps(reply_to_json(reply)))) == reply
    status = reply.status
    assert status_from_json(status_to_json(status)) == status
    snap = snapshot_of(s, 1_002)
    assert snapshot_from_json(json.loads(json.dumps(snapshot_to_json(snap)))) == snap
    req = Request(Op.LEAVE, NODES[1], RULES, finished=True, port=9, secret=SECRET)
    assert request_from_json(request_to_json(req)) == req
    other = NodeDesc("other", 1, 0)
    refused = step(s, Request(Op.JOIN, other, Rules(2, 3, 100, 1_000), secret=SECRET), 1_003)
    assert refused.run_rules == RULES
    assert reply_from_json(json.loads(json.dumps(reply_to_json(refused)))) == refused


def test_a_secret_is_never_shown() -> None:
    """Not in a request's repr, nor in the message refusing a bad one."""
    req = Request(Op.JOIN, NODES[0], RULES, secret=SECRET)
    assert SECRET not in repr(req) and SECRET not in str(req)
    bad = "!" + SECRET
    with pytest.raises(WireError) as refused:
        request_from_json({**_join(), "secret": bad})
    assert bad not in str(refused.value) and "'secret'" in str(refused.value)
    s = RunState("e", secrets={NODES[0]: SECRET})
    assert SECRET not in repr(s)


def test_node_names_keep_underscores_in_the_address() -> None:
    assert NodeDesc.from_key(NODES[2].key) == NODES[2]
    for bad in ("", "a_1", "_1_2", "a_x_2", "a_1_-2", "a\n_1_2"):
        with pytest.raises(ValueError):
            NodeDesc.from_key(bad)


def test_lua_shapes_are_accepted() -> None:
    """Redis' Lua JSON drops nil fields, writes {} for an empty list and 3.0 for 3."""
    doc = status_to_json(step(RunState("e"), Request(Op.JOIN, NODES[0], RULES), 5).status)
    doc["lost_sample"] = {}
    doc.pop("deadline")
    doc["round"] = 0.0
    assert status_from_json(doc).deadline_ms is None


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"op": "join"}, "must be"),
        ({**_join(), "op": "dance"}, "'op'"),
        ({**_join(), "min": 5, "max": 2}, "min"),
        ({**_join(), "port": 70000}, "port"),
        ({**_join(), "node": "x"}, "node name"),
        ({**_join(), "extra": 1}, "unknown"),
        ({**_join(), "window": 0}, "'window'"),
        ({**_join(), "secret": ""}, "'secret'"),
        ({**_join(), "secret": "x" * 15}, "'secret'"),
        ({**_join(), "operator": True}, "unknown"),
        ({**_join(), "op": "depart"}, "'op' must be one of join, leave"),  # a backend's
        ({**_join(), "since_ms": 1}, "unknown"),
        ({k: v for k, v in _join().items() if k != "secret"}, "'secret'"),
    ],
)
def test_bad_requests_are_wire_errors(doc: dict[str, Any], why: str) -> None:
    with pytest.raises(WireError, match=why):
        request_from_json(doc)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)


@given(json_values)
def test_arbitrary_documents_never_crash_the_decoders(doc: Any) -> None:
    for decode in (status_from_json, reply_from_json, request_from_json, snapshot_from_json):
        with contextlib.suppress(WireError):
            decode(doc)
