"""The wire format: versioned JSON, validated, never pickle."""

from __future__ import annotations

import contextlib
import json
import pickle
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aelastic.rendezvous import state as codec
from aelastic.rendezvous.api import RendezvousStateError
from aelastic.rendezvous.state import NodeDesc, RendezvousState, decode_state, encode_state

nodes = st.builds(
    NodeDesc,
    st.text(min_size=1, max_size=20),
    st.integers(0, 2**31),
    st.integers(0, 1000),
)
times = st.integers(0, 2 * 10**12).map(lambda ms: ms / 1000)


@st.composite
def states(draw: st.DrawFn) -> RendezvousState:
    members = draw(st.lists(nodes, unique=True, max_size=8))
    waiting = draw(st.lists(nodes.filter(lambda n: n not in members), unique=True, max_size=4))
    redundant = draw(
        st.lists(
            nodes.filter(lambda n: n not in members and n not in waiting), unique=True, max_size=3
        )
    )
    complete = draw(st.booleans())
    ranks = {n: i if complete else 0 for i, n in enumerate(members)}
    beats = {n: draw(times) for n in [*members, *waiting, *redundant]}
    return RendezvousState(
        round=draw(st.integers(0, 10**6)),
        complete=complete,
        deadline=draw(st.none() | times),
        closed=draw(st.booleans()),
        participants=MappingProxyType(ranks),
        wait_list=frozenset(waiting),
        redundancy_list=frozenset(redundant),
        last_heartbeats=MappingProxyType(beats),
    )


@given(states())
def test_round_trip(state: RendezvousState) -> None:
    data = encode_state(state)
    json.loads(data)  # plain JSON, readable by any tool
    codec._CACHE.clear()
    assert decode_state(data) == state


def test_is_json_with_a_format_tag_and_version() -> None:
    doc = json.loads(encode_state(RendezvousState()))
    assert doc["format"] == "aelastic.rendezvous.state"
    assert doc["version"] == 1


def valid_doc() -> dict[str, object]:
    return {
        "format": "aelastic.rendezvous.state",
        "version": 1,
        "round": 2,
        "complete": True,
        "closed": False,
        "deadline_ms": None,
        "participants": [["h", 1, 0, 0, 10500]],
        "wait_list": [["w", 2, 0, 10600]],
        "redundancy_list": [],
    }


def test_valid_document_decodes() -> None:
    state = decode_state(json.dumps(valid_doc()).encode())
    assert state.round == 2 and dict(state.participants) == {NodeDesc("h", 1, 0): 0}
    assert state.wait_list == {NodeDesc("w", 2, 0)}
    assert dict(state.last_heartbeats) == {NodeDesc("h", 1, 0): 10.5, NodeDesc("w", 2, 0): 10.6}


FOREIGN = [
    b"",
    b"\x80\x04\x95",  # a pickle header
    pickle.dumps({"round": 1}),
    b"not json",
    b"[]",
    b'{"round": 1}',
    b"\xff\xfe garbage",
    b"[" * 100_000,
]


@pytest.mark.parametrize("payload", FOREIGN, ids=range(len(FOREIGN)))
def test_foreign_payloads_raise_state_error(payload: bytes) -> None:
    with pytest.raises(RendezvousStateError, match="corrupt or foreign"):
        decode_state(payload)


MUTATIONS = [
    ("format", "torch.rendezvous"),
    ("version", 2),
    ("version", "1"),
    ("round", -1),
    ("round", 1.5),
    ("round", True),
    ("complete", "yes"),
    ("closed", 0),
    ("deadline_ms", "soon"),
    ("deadline_ms", 1.5),
    ("participants", {"h": 0}),
    ("participants", [["h", 1, 0, 0]]),
    ("participants", [["", 1, 0, 0, 1]]),
    ("participants", [["h", -1, 0, 0, 1]]),
    ("participants", [["h", 1, 0, 0, "now"]]),
    ("participants", [["h", 1, 0, 0, 1], ["h", 1, 0, 1, 1]]),
    ("participants", [["h", 1, 0, 0, 1], ["g", 1, 0, 0, 1]]),
    ("wait_list", [["h", 1, 0, 5]]),  # also a participant
    ("wait_list", "h"),
    ("redundancy_list", [["r", 1, 0, 1], ["r", 1, 0, 1]]),
]


@pytest.mark.parametrize(("field", "value"), MUTATIONS)
def test_invalid_fields_raise_state_error(field: str, value: object) -> None:
    doc = valid_doc()
    doc[field] = value
    with pytest.raises(RendezvousStateError):
        decode_state(json.dumps(doc).encode())


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(payload: bytes) -> None:
    with contextlib.suppress(RendezvousStateError):
        decode_state(payload)


def test_encoding_refuses_a_state_that_breaks_the_heartbeat_invariant() -> None:
    node = NodeDesc("h", 1, 0)
    no_beat = RendezvousState(participants=MappingProxyType({node: 0}))
    with pytest.raises(ValueError, match="heartbeat"):
        encode_state(no_beat)
    stray_beat = RendezvousState(last_heartbeats=MappingProxyType({node: 1.0}))
    with pytest.raises(ValueError, match="heartbeat"):
        encode_state(stray_beat)
