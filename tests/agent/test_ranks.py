"""Rank assignment from the agents' records (pure) and the record codec."""

from __future__ import annotations

import pytest

from aelastic.agent.ranks import AgentRecord, Assignment, assign_ranks, assignments
from aelastic.core.state import NodeDesc
from aelastic.rendezvous import RendezvousStateError


def record(role: str, size: int, n: int = 0) -> AgentRecord:
    return AgentRecord(role, size, NodeDesc("host", 100 + n, 0))


def test_homogeneous_ranks_are_prefix_sums() -> None:
    records = [record("trainer", 4, i) for i in range(3)]
    workers = assign_ranks(records, 1)
    assert [w.global_rank for w in workers] == [4, 5, 6, 7]
    assert [w.role_rank for w in workers] == [4, 5, 6, 7]
    assert {w.world_size for w in workers} == {12}
    assert {w.role_world_size for w in workers} == {12}
    assert [w.local_rank for w in workers] == [0, 1, 2, 3]


def test_heterogeneous_roles_and_sizes() -> None:
    records = [record("trainer", 2, 0), record("reader", 1, 1), record("trainer", 3, 2)]
    ranks = {g: assign_ranks(records, g) for g in range(3)}
    assert [w.global_rank for w in ranks[0]] == [0, 1]
    assert [w.global_rank for w in ranks[1]] == [2]
    assert [w.global_rank for w in ranks[2]] == [3, 4, 5]
    assert [w.role_rank for w in ranks[2]] == [2, 3, 4]
    assert [w.role_rank for w in ranks[1]] == [0]
    assert ranks[2][0].role_world_size == 5 and ranks[1][0].role_world_size == 1
    assert all(w.world_size == 6 for ws in ranks.values() for w in ws)
    every = sorted(w.global_rank for ws in ranks.values() for w in ws)
    assert every == list(range(6))


def test_record_round_trip() -> None:
    plain = record("trainer", 2)
    assert AgentRecord.decode(plain.encode()) == plain
    master = AgentRecord("trainer", 2, NodeDesc("h", 1, 2), "10.0.0.1", 29500)
    assert AgentRecord.decode(master.encode()) == master


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"format": "other/1"}',
        b'{"format": "aelastic.agent.record/1", "role": "t", "local_world_size": 0, '
        b'"node": ["h", 1, 0]}',
        b'{"format": "aelastic.agent.record/1", "role": "t", "local_world_size": 1}',
    ],
)
def test_foreign_records_are_refused(data: bytes) -> None:
    with pytest.raises(RendezvousStateError):
        AgentRecord.decode(data)


def test_assignments_agree_with_every_agents_own_computation() -> None:
    roles = ["trainer", "trainer", "reader", "trainer", "reader"]
    records = [
        AgentRecord(role, n, NodeDesc("h", 10 + g, 0), *(("h", 2900) if g == 0 else (None, None)))
        for g, (role, n) in enumerate(zip(roles, [4, 2, 1, 3, 2], strict=True))
    ]
    assigned = assignments(records)
    for g, a in enumerate(assigned):
        mine = [
            (w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size)
            for w in assign_ranks(records, g)
        ]
        assert [
            (w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size)
            for w in a.workers()
        ] == mine
        assert (a.master_addr, a.master_port) == ("h", 2900)
        assert Assignment.decode(a.encode()) == a


def test_a_rank_0_without_master_is_a_state_error() -> None:
    records = [AgentRecord("trainer", 1, NodeDesc("h", 1, 0))]
    with pytest.raises(RendezvousStateError, match="MASTER_ADDR"):
        assignments(records)
