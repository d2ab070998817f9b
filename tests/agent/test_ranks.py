"""Workers' ranks: the rendezvous fixes each member's placement from what every member's join
said (torch's assignment), and the agent turns its own into workers (pure)."""

from __future__ import annotations

import pytest

from aelastic.agent.loop.ranks import workers_of
from aelastic.core.machine import step
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Placement, Request, RunState


def _round(*profiles: tuple[str, int]) -> dict[int, Placement]:
    """The placements of a round whose members (in rank order) said ``profiles``."""
    state, rules = RunState("e"), Rules(len(profiles), len(profiles), 1, 60_000)
    replies = []
    for i, (role, size) in enumerate(profiles):
        node = NodeDesc("host", 100 + i, 0)
        request = Request(
            Op.JOIN, node, rules, secret=f"{i:032d}", role=role, local_world_size=size
        )
        replies.append(step(state, request, 1_000))
    done = [step(state, Request(Op.JOIN, NodeDesc("host", 100 + i, 0), rules,
                                secret=f"{i:032d}"), 1_001)
            for i in range(len(profiles))]  # fmt: skip
    return {r.rank: r.placement for r in done if r.rank is not None and r.placement}


def test_homogeneous_ranks_are_prefix_sums() -> None:
    placements = _round(*[("trainer", 4)] * 3)
    workers = workers_of(placements[1], 4)
    assert [w.global_rank for w in workers] == [4, 5, 6, 7]
    assert [w.role_rank for w in workers] == [4, 5, 6, 7]
    assert {w.world_size for w in workers} == {12}
    assert {w.role_world_size for w in workers} == {12}
    assert [w.local_rank for w in workers] == [0, 1, 2, 3]


def test_heterogeneous_roles_and_sizes() -> None:
    sizes = {0: 2, 1: 1, 2: 3}
    placements = _round(("trainer", 2), ("reader", 1), ("trainer", 3))
    ranks = {g: workers_of(placements[g], sizes[g]) for g in range(3)}
    assert [w.global_rank for w in ranks[0]] == [0, 1]
    assert [w.global_rank for w in ranks[1]] == [2]
    assert [w.global_rank for w in ranks[2]] == [3, 4, 5]
    assert [w.role_rank for w in ranks[2]] == [2, 3, 4]
    assert [w.role_rank for w in ranks[1]] == [0]
    assert ranks[2][0].role_world_size == 5 and ranks[1][0].role_world_size == 1
    assert all(w.world_size == 6 for ws in ranks.values() for w in ws)
    every = sorted(w.global_rank for ws in ranks.values() for w in ws)
    assert every == list(range(6))


@pytest.mark.parametrize("count", [1, 2, 5])
def test_every_global_rank_is_given_once(count: int) -> None:
    profiles = [("trainer" if i % 2 else "reader", i + 1) for i in range(count)]
    placements = _round(*profiles)
    ranks = sorted(
        w.global_rank for g, (_, n) in enumerate(profiles) for w in workers_of(placements[g], n)
    )
    assert ranks == list(range(sum(n for _, n in profiles)))
