"""Random interleavings of rendezvous requests, for property tests of the state machine.

A scenario is a list of steps: a node (of a few), a request (join, leave, close, keep-alive,
status, with its flags) and how far the clock moves first. The same scenario runs through the
pure Python machine and through the Redis script, which must answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request

NODES = [NodeDesc("10.0.0.1", 100 + i, i % 2) for i in range(6)]


@dataclass(frozen=True)
class Step:
    node: int
    op: Op
    advance_ms: int
    expired: bool = False
    finished: bool = False

    def request(self, rules: Rules) -> Request:
        return Request(
            self.op,
            NODES[self.node],
            rules,
            expired=self.expired,
            finished=self.finished,
            port=1000 + self.node,
        )


ops = st.sampled_from([Op.JOIN] * 6 + [Op.LEAVE, Op.KEEP_ALIVE, Op.KEEP_ALIVE, Op.STATUS, Op.CLOSE])

steps = st.builds(
    Step,
    node=st.integers(0, len(NODES) - 1),
    op=ops,
    advance_ms=st.one_of(st.just(0), st.integers(1, 400), st.integers(400, 3_000), st.just(20_000)),
    expired=st.sampled_from([False] * 9 + [True]),
    finished=st.booleans(),
)


@st.composite
def rules(draw: st.DrawFn) -> Rules:
    min_nodes = draw(st.integers(1, 4))
    max_nodes = draw(st.integers(min_nodes, 5))
    return Rules(
        min_nodes,
        max_nodes,
        last_call_ms=draw(st.sampled_from([1, 300, 1_000])),
        window_ms=draw(st.sampled_from([500, 2_000, 5_000])),
    )


scenarios = st.tuples(rules(), st.lists(steps, min_size=1, max_size=60))
