"""Random interleavings of rendezvous requests, for property tests of the state machine.

A scenario is a list of steps: a node (of a few), a request (join, leave, close, keep-alive,
status, with its flags; a backend's departure report in :data:`departure_scenarios`) and
how far the clock moves first. Some steps are forged (another
client's request for the node, with a secret that is not the node's), some carry other rules
than the scenario's (a forged window, other node bounds), some closes are the operator's.
The same scenario runs through the pure Python machine and through the Redis script, which
must answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request

#: Names that sort differently by bytes, by a locale and by join order: addresses that are
#: prefixes of others, with '.', '-' and '_', upper case, a non-ASCII one; pids of different
#: digit counts (torch's rank order: address, then pid, then local id).
NODES = [
    NodeDesc("10.0.0.1", 100, 0),
    NodeDesc("10.0.0.1", 99, 1),
    NodeDesc("10.0.0.10", 7, 0),
    NodeDesc("10.0.0-2", 1000, 0),
    NodeDesc("node-a.example", 5, 1),
    NodeDesc("node.a", 12345, 0),
    NodeDesc("Node_b", 3, 0),
    NodeDesc("nœud.example", 42, 0),
]
#: What a join says of the node's workers, by node: roles and local world sizes that differ.
PROFILES = [("default", 2), ("default", 1), ("trainer", 4), ("default", 2), ("trainer", 1),
            ("eval", 3), ("default", 1), ("trainer", 2)]  # fmt: skip
#: What a report says, by its variant: failures (primary, secondary, stalled) or a
#: quarantine of the node's own host.
REPORTS = [
    NodeReport(failure=FailureReport(time=5.0, rank=1, local_rank=1, exitcode=1, message="boom")),
    NodeReport(
        failure=FailureReport(
            time=3.0, rank=0, local_rank=0, exitcode=-6, message="gloo", secondary=True
        )
    ),
    NodeReport(
        failure=FailureReport(
            time=9.0, rank=2, local_rank=0, exitcode=-9, message="hung\nat x.py:3", stalled=True
        )
    ),
    NodeReport(quarantine="the job's root cause 2 times in a row"),
]

#: Each node's own secret; a forged request carries :data:`FORGED`.
SECRETS = [f"{i:02d}" + "c0ffee" * 5 for i in range(len(NODES))]
FORGED = "f0" * 16


def variant_rules(rules: Rules, variant: int) -> Rules:
    """The rules a step's request carries: the scenario's (0), a forged 1 ms window (1),
    other node bounds (2), another last call (3)."""
    if variant == 1:
        return replace(rules, window_ms=1)
    if variant == 2:
        return replace(rules, max_nodes=rules.max_nodes + 1)
    if variant == 3:
        return replace(rules, last_call_ms=rules.last_call_ms + 7)
    return rules


@dataclass(frozen=True)
class Step:
    node: int
    op: Op
    advance_ms: int
    expired: bool = False
    finished: bool = False
    forged: bool = False
    variant: int = 0
    operator: bool = False
    #: A departure: its moment, this long before the step's time.
    since_ago_ms: int = 0
    #: A departure a member backs (no grace).
    confirmed: bool = False

    @property
    def secret(self) -> str:
        return FORGED if self.forged else SECRETS[self.node]

    def request(self, rules: Rules, now_ms: int = 0) -> Request:
        if self.op is Op.DEPART:
            since = now_ms - self.since_ago_ms
            secret = "" if self.operator else self.secret
            return Request.departure(
                NODES[self.node], since, secret=secret, confirmed=self.confirmed
            )
        if self.operator:
            return Request.operator_close()
        role, size = PROFILES[self.node]
        return Request(
            self.op,
            NODES[self.node],
            variant_rules(rules, self.variant),
            expired=self.expired,
            finished=self.finished,
            port=1000 + self.node,
            secret=self.secret,
            role=role,
            local_world_size=size,
            report=REPORTS[self.variant] if self.op is Op.REPORT else None,
        )


ops = st.sampled_from(
    [Op.JOIN] * 6
    + [Op.LEAVE, Op.KEEP_ALIVE, Op.KEEP_ALIVE, Op.STATUS, Op.CLOSE, Op.REPORT, Op.REPORT, Op.DONE]
)

steps = st.builds(
    Step,
    node=st.integers(0, len(NODES) - 1),
    op=ops,
    advance_ms=st.one_of(st.just(0), st.integers(1, 400), st.integers(400, 3_000), st.just(20_000)),
    expired=st.sampled_from([False] * 9 + [True]),
    finished=st.booleans(),
    forged=st.sampled_from([False] * 7 + [True]),
    variant=st.sampled_from([0] * 12 + [1, 2, 3]),
    operator=st.sampled_from([False] * 30 + [True]),
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

#: Steps with backends' departure reports too (their moment up to 3 s back).
departures = st.builds(
    Step,
    node=st.integers(0, len(NODES) - 1),
    op=st.just(Op.DEPART),
    advance_ms=st.one_of(st.just(0), st.integers(1, 400), st.integers(400, 3_000)),
    forged=st.sampled_from([False] * 3 + [True]),
    operator=st.booleans(),
    since_ago_ms=st.one_of(st.just(0), st.integers(0, 3_000)),
    confirmed=st.booleans(),
)
departure_scenarios = st.tuples(
    rules(), st.lists(st.one_of(steps, steps, departures), min_size=1, max_size=60)
)

#: Steps of a run's job once its round is complete: reports (every kind), done, beats,
#: silences, leaves and joins again (the next rounds), now and then a close.
_JOB_OPS = [Op.REPORT] * 5 + [Op.DONE] * 3 + [Op.KEEP_ALIVE] * 3 + [Op.JOIN] * 3
job_steps = st.builds(
    Step,
    node=st.integers(0, len(NODES) - 1),
    op=st.sampled_from([*_JOB_OPS, Op.LEAVE, Op.STATUS, Op.CLOSE]),
    advance_ms=st.one_of(st.just(0), st.integers(1, 400), st.integers(400, 3_000)),
    finished=st.booleans(),
    forged=st.sampled_from([False] * 9 + [True]),
    variant=st.integers(0, len(REPORTS) - 1),
)


@st.composite
def job_scenarios(draw: st.DrawFn) -> tuple[Rules, list[Step]]:
    """Rounds of a job, one after the other: each completed by its first joins, then
    :data:`job_steps` (failures, quarantines, the exit barrier, losses), then every node
    leaves (the next round opens)."""
    min_nodes = draw(st.integers(1, 4))
    max_nodes = draw(st.integers(min_nodes, 5))
    window = draw(st.sampled_from([2_000, 5_000]))
    rules = Rules(min_nodes, max_nodes, last_call_ms=1, window_ms=window)
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, 4))):
        steps += [Step(i, Op.JOIN, 0) for i in range(max_nodes)]
        steps += draw(st.lists(job_steps, min_size=1, max_size=25))
        steps += [Step(i, Op.LEAVE, 1, finished=True) for i in range(len(NODES))]
    return rules, steps
