"""Properties of the pure core under random interleavings of many nodes (hypothesis).

A tiny simulated backend (a versioned cell with compare-and-set) is shared by nodes that
read stale copies, race their writes, die, leave, close and re-join while time jumps
forward. After every write the stored history must keep the rendezvous invariants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aelastic.rendezvous.api import RendezvousSettings
from aelastic.rendezvous.core import Op, Outcome, step, view
from aelastic.rendezvous.state import NodeDesc, RendezvousState, decode_state, encode_state


@dataclass
class Node:
    desc: NodeDesc
    cache: RendezvousState | None = None
    version: int = 0
    status: str = "joining"  # joining | member | dead | out
    deadline: float = 0.0
    round: int = -1
    members: frozenset[NodeDesc] = frozenset()


@dataclass
class World:
    settings: RendezvousSettings
    now: float = 1_000.0
    state: RendezvousState | None = None
    version: int = 0
    history: list[RendezvousState] = field(default_factory=list)
    groups: dict[int, dict[NodeDesc, int]] = field(default_factory=dict)
    finished: list[tuple[int, dict[NodeDesc, int]]] = field(default_factory=list)

    def cas(self, node: Node, new: RendezvousState) -> bool:
        if node.version != self.version:
            node.cache, node.version = self.state, self.version
            return False
        # Every write goes through the wire format, as on a real backend.
        new = decode_state(encode_state(new))
        self.check_write(new)
        self.state, self.version = new, self.version + 1
        self.history.append(new)
        node.cache, node.version = new, self.version
        return True

    def check_write(self, new: RendezvousState) -> None:
        s = self.settings
        previous = self.history[-1] if self.history else None
        if previous is not None:
            assert new.round >= previous.round, "rounds never go back"
            assert not previous.closed or new.closed, "a closed rendezvous stays closed"
        assert not (new.wait_list & new.participants.keys())
        expired = self.now - s.heartbeat_window
        for node, beat in new.last_heartbeats.items():
            assert beat >= expired, f"dead node {node} was written back"
        for node in new.participants:
            assert node in new.last_heartbeats
        if new.complete:
            ranks = dict(new.participants)
            assert len(set(ranks.values())) == len(ranks), "duplicate ranks"
            group = self.groups.get(new.round)
            if group is None:
                assert sorted(ranks.values()) == list(range(len(ranks)))
                assert s.min_nodes <= len(ranks) <= s.max_nodes, "world size out of bounds"
                self.groups[new.round] = ranks
            else:
                # At most one completed group per round: members may leave, none may join.
                assert ranks.keys() <= group.keys(), "a second group formed in one round"
                assert all(group[n] == r for n, r in ranks.items()), "ranks changed"

    def act(self, node: Node, op: Op) -> Outcome:
        for _ in range(10):
            result = step(op, node.cache, node.desc, self.settings, self.now, node.deadline)
            if result.outcome is not Outcome.WRITE:
                return result.outcome
            assert result.state is not None
            if self.cas(node, result.state) and result.restart_deadline:
                node.deadline = self.now + self.settings.join_timeout
        raise AssertionError(f"{op} did not settle within 10 writes at a fixed time")

    def refresh(self, node: Node) -> None:
        node.cache, node.version = self.state, self.version


def settings_strategy() -> st.SearchStrategy[RendezvousSettings]:
    return st.builds(
        lambda lo, extra, last_call: RendezvousSettings(
            "prop",
            lo,
            lo + extra,
            join_timeout=60.0,
            last_call_timeout=last_call,
            keep_alive_interval=2.0,
            keep_alive_max_attempt=2,
        ),
        st.integers(1, 3),
        st.integers(0, 3),
        st.sampled_from([0.5, 3.0, 10.0]),
    )


ACTIONS = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 5)),
    st.tuples(st.just("step"), st.integers(0, 5)),
    st.tuples(st.just("read"), st.integers(0, 5)),
    st.tuples(st.just("advance"), st.sampled_from([0.1, 0.5, 1.0, 2.5, 5.0])),
    st.tuples(st.just("kill"), st.integers(0, 5)),
    st.tuples(st.just("leave"), st.integers(0, 5)),
    st.tuples(st.just("rejoin"), st.integers(0, 5)),
    st.tuples(st.just("close"), st.integers(0, 5)),
)


def run_schedule(world: World, nodes: list[Node], actions: list[tuple[str, float]]) -> None:
    for kind, arg in actions:
        if kind == "advance":
            world.now += arg
            continue
        node = nodes[int(arg) % len(nodes)]
        if node.status == "dead":
            continue
        if kind == "read":
            world.refresh(node)
        elif kind == "kill":
            node.status = "dead"
        elif kind == "close":
            world.refresh(node)
            node.deadline = world.now + world.settings.close_timeout
            world.act(node, Op.CLOSE)
        elif kind == "leave":
            world.refresh(node)
            world.act(node, Op.LEAVE)
            node.status = "out"
        elif kind == "rejoin" and node.status == "out":
            node.status = "joining"
            node.deadline = world.now + world.settings.join_timeout
        elif kind == "step":
            advance(world, node)


def advance(world: World, node: Node) -> None:
    if node.status == "joining":
        outcome = world.act(node, Op.JOIN)
        if outcome is Outcome.FINISH:
            assert node.cache is not None
            node.status = "member"
            node.round = node.cache.round
            node.members = frozenset(node.cache.participants)
            world.finished.append((node.round, dict(node.cache.participants)))
        elif outcome is Outcome.WAIT:
            world.refresh(node)
        elif outcome is not Outcome.WRITE:
            node.status = "out"
    elif node.status == "member":
        world.refresh(node)
        seen = view(node.cache, node.desc, node.members, node.round, world.settings, world.now)
        if seen.changed:
            # What the agent does: re-rendezvous (leave, then join again).
            node.deadline = world.now + world.settings.join_timeout
            world.act(node, Op.LEAVE)
            node.status = "joining"
        else:
            node.deadline = world.now + world.settings.heartbeat_timeout
            world.act(node, Op.KEEP_ALIVE)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    s=settings_strategy(),
    count=st.integers(1, 6),
    actions=st.lists(ACTIONS, min_size=1, max_size=150),
)
def test_rendezvous_invariants_hold_under_any_interleaving(
    s: RendezvousSettings, count: int, actions: list[tuple[str, float]]
) -> None:
    world = World(s)
    nodes = [Node(NodeDesc(f"n{i}", 10 + i, 0), deadline=world.now + 60) for i in range(count)]
    run_schedule(world, nodes, actions)
    # Every member that finished agrees with the group of its round, rank for rank.
    for round_, seen in world.finished:
        group = world.groups[round_]
        assert seen.keys() <= group.keys()
        assert all(group[n] == r for n, r in seen.items())


@settings(max_examples=100, deadline=None)
@given(s=settings_strategy(), extra=st.integers(0, 3), seed=st.randoms(use_true_random=False))
def test_live_nodes_form_a_group_and_agree(s: RendezvousSettings, extra: int, seed: object) -> None:
    """At least min_nodes live nodes that keep stepping complete a round and agree on ranks."""
    import random

    assert isinstance(seed, random.Random)
    count = s.min_nodes + extra
    world = World(s)
    nodes = [Node(NodeDesc(f"n{i}", 10 + i, 0), deadline=world.now + 60) for i in range(count)]
    for _ in range(400):
        if all(n.status == "member" for n in nodes[: s.max_nodes]) or world.now > 1_050:
            break
        # A fair scheduler: every node steps once per tick, in a random order.
        for node in seed.sample(nodes, len(nodes)):
            advance(world, node)
        world.now += 0.1
    members = [n for n in nodes if n.status == "member"]
    assert len(members) >= s.min_nodes
    rounds = {n.round for n in members}
    assert len(rounds) == 1
    group = world.groups[rounds.pop()]
    assert {n.desc for n in members} <= group.keys()
    assert s.min_nodes <= len(group) <= s.max_nodes


def test_a_dead_node_disappears_from_the_next_write_after_the_window() -> None:
    s = RendezvousSettings("prop", 1, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    world = World(s)
    a, b = (Node(NodeDesc(f"n{i}", i, 0), deadline=world.now + 60) for i in range(2))
    advance(world, a)
    advance(world, b)
    b.status = "dead"
    world.now += 1.5
    world.refresh(a)
    world.act(a, Op.KEEP_ALIVE)
    assert world.state is not None and b.desc in world.state.last_heartbeats
    world.now += 0.6  # b's last heartbeat is now older than the 2 s window; a's is not
    world.act(a, Op.KEEP_ALIVE)
    assert world.state is not None and b.desc not in world.state.last_heartbeats
