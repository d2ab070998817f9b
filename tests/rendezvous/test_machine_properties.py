"""Properties of the state machine under random interleavings of many nodes (hypothesis).

Nodes join, leave, close, beat and go silent in any order while the clock jumps, and other
clients forge requests for them (another secret, another window, other bounds); after every
request the state must keep the rendezvous invariants under the run's own rules, the reply
must agree with it, a forged request must change nothing, and no secret is ever shown.
"""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aelastic.core.machine import prune, snapshot_of, step
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request, RunState
from aelastic.core.token import NO_STATE, parse
from aelastic.core.wire import reply_to_json, snapshot_to_json
from tests._machine_steps import FORGED, NODES, PROFILES, SECRETS, Step, scenarios

T0 = 1_000_000


class Checker:
    """The invariants, checked after each step against what came before."""

    def __init__(self) -> None:
        self.rules: Rules | None = None
        self.groups: dict[int, dict[object, int]] = {}
        self.round = 0
        self.closed = False
        self.generation = 0
        self.signature: tuple[object, ...] | None = None

    def check(
        self,
        s: RunState,
        now: int,
        request: Request,
        outcome: Outcome,
        rank: int | None,
        empty: bool,
    ) -> None:
        """``empty``: the run was empty once the step's pruning was done, before its request."""
        if not s.made:
            assert not s.beats and not s.closed, "a state no join or close made holds nothing"
            return
        reused = s.round > self.round and s.vacated_ms is None and not s.closed
        if self.closed and not s.closed:  # a closed run made again by a join
            assert empty and reused, "reused in a new round"
            self.rules = None  # the joiner's
        if self.rules is not None and s.rules != self.rules:  # an empty run made new
            assert empty and reused and request.op is Op.JOIN, "rules changed in use"
            assert s.health.incidents_total == 0, "a new run's health starts empty"
            self.rules = None
        if self.rules is None:
            self.rules = s.rules
        assert s.rules is not None and s.rules == self.rules, "a run's rules never change"
        r = self.rules
        assert s.round >= self.round, "rounds never go back"
        if s.closed and not s.beats:
            assert s.vacated_ms is not None, "an empty closed run knows since when"
        self.round, self.closed = s.round, s.closed
        parts, waiting, redundant = set(s.participants), s.wait_list, s.redundancy_list
        assert not (parts & waiting) and not (parts & redundant) and not (waiting & redundant)
        assert set(s.beats) == parts | waiting | redundant, "exactly the listed nodes beat"
        assert set(s.secrets) == set(s.beats), "exactly the listed nodes have a secret"
        assert all(b >= now - r.window_ms for b in s.beats.values()), "a dead node stayed"
        assert list(s.beats.values()) == sorted(s.beats.values()), "beats in time order"
        all_done = s.complete and s.world > 0 and len(s.done) + s.finished >= s.world
        signature = (
            s.round, s.complete, s.closed, s.deadline_ms, bool(waiting), s.lost > 0,
            s.finished > 0, all_done,
        )  # fmt: skip
        assert s.generation >= self.generation
        if self.signature is not None:
            moved = s.generation != self.generation
            assert moved == (signature != self.signature), "the token moves iff watched fields do"
        self.signature, self.generation = signature, s.generation
        if s.complete:
            ranks = dict(s.participants)
            assert len(set(ranks.values())) == len(ranks), "duplicate ranks"
            group = self.groups.get(s.round)
            if group is None:
                assert sorted(ranks.values()) == list(range(len(ranks)))
                assert sorted(ranks, key=ranks.__getitem__) == sorted(ranks), "torch's order"
                assert r.min_nodes <= len(ranks) <= r.max_nodes, "world size out of bounds"
                assert s.world == len(ranks)
                self.groups[s.round] = ranks
            else:
                assert ranks.items() <= group.items(), "a second group formed in one round"
            assert s.lost + s.finished + len(ranks) == s.world
            assert s.done <= parts and s.failed <= set(self.groups[s.round]), "done, failed"
            _check_placements(s, self.groups[s.round])
        else:
            assert len(parts) <= r.max_nodes
            assert (s.deadline_ms is not None) == (len(parts) >= r.min_nodes)
            assert not s.done and not s.failed
        for incident in s.health.incidents:
            root = incident.root
            assert incident.round == root.round <= s.round
            assert root.host == NodeDesc.from_key(root.node).addr, "a report names its node"
            assert root.node_rank == self.groups[root.round][NodeDesc.from_key(root.node)]
        if request.op is Op.JOIN and outcome is Outcome.FINISH:
            assert s.complete and rank == s.participants[request.node]


def _check_placements(s: RunState, group: dict[NodeDesc, int]) -> None:
    """Each member's workers placed as torch assigns ranks: prefix sums in rank order."""
    order = sorted(group, key=group.__getitem__)
    sizes = [PROFILES[NODES.index(n)] for n in order]
    world = sum(size for _, size in sizes)
    base = 0
    for node, (role, size) in zip(order, sizes, strict=True):
        placed = s.placements[node]
        before = sum(n for r, n in sizes[: group[node]] if r == role)
        assert (placed.base, placed.world, placed.role_base) == (base, world, before)
        assert placed.role_world == sum(n for r, n in sizes if r == role)
        base += size


def _membership(s: RunState) -> tuple[object, ...]:
    """Everything of a state but its version (a prune may move it)."""
    return (
        s.rules, s.round, s.complete, s.closed, s.deadline_ms, s.seq, s.world, s.lost,
        s.finished, list(s.lost_sample), s.master, list(s.participants.items()),
        dict(s.ports), set(s.wait_list), set(s.redundancy_list), list(s.beats.items()),
        dict(s.secrets), set(s.done), set(s.failed), s.health,
    )  # fmt: skip


def run(rules: Rules, steps: list[Step]) -> None:
    s = RunState("feed")
    checker = Checker()
    now = T0
    for item in steps:
        now += item.advance_ms
        request = item.request(rules)
        pruned = copy.deepcopy(s)
        prune(pruned, now)
        held = pruned.secrets.get(request.node)
        if not request.operator and held is not None and held != request.secret:
            # A request for a listed node under another secret (forged) changes nothing
            # but what the run's own window prunes anyway.
            reply = step(s, request, now)
            if request.op is Op.CLOSE:  # a run-level act: anyone closes a run
                pruned.closed = s.closed
                pruned.generation = s.generation
                pruned.vacated_ms = s.vacated_ms
            harmless = request.op in (Op.STATUS, Op.CLOSE)
            assert reply.outcome is Outcome.ERROR_FORBIDDEN or harmless, item
            assert _membership(s) == _membership(pruned), item
            assert not reply.known
        else:
            reply = step(s, request, now)
        if reply.outcome is Outcome.ERROR_RULES:
            assert reply.run_rules == s.rules != request.rules
        text = json.dumps(reply_to_json(reply)) + json.dumps(snapshot_to_json(snapshot_of(s, now)))
        assert not any(secret in text for secret in (*SECRETS, FORGED)), "a secret was shown"
        if s.made:
            assert parse(reply.status.token) == ("feed", s.generation)
        else:
            assert reply.status.token == NO_STATE
        checker.check(s, now, request, reply.outcome, reply.rank, not pruned.beats)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_invariants_hold_under_any_interleaving(scenario: tuple[Rules, list[Step]]) -> None:
    run(*scenario)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 4).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 6))),
    st.integers(0, 2),
)
def test_live_nodes_that_keep_asking_form_one_group_and_agree(
    bounds: tuple[int, int], extra: int
) -> None:
    min_nodes, max_nodes = bounds
    rules = Rules(min_nodes, max_nodes, last_call_ms=500, window_ms=5_000)
    count = min(max_nodes + extra, len(NODES))
    s = RunState("e")
    now = T0
    ranks: dict[int, int] = {}
    for _ in range(20):
        for i in range(count):
            reply = step(s, Request(Op.JOIN, NODES[i], rules, secret=SECRETS[i]), now)
            if reply.outcome is Outcome.FINISH:
                assert reply.rank is not None
                ranks[i] = reply.rank
        now += 100
    assert s.complete
    group = min(count, max_nodes)
    assert sorted(ranks.values()) == list(range(group))
    assert len(s.wait_list) + len(s.redundancy_list) == count - group
