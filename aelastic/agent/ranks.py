"""Role-aware rank assignment from what every agent of a round published (pure).

How it works: after a round completes, each agent writes one :class:`AgentRecord` (its
role, its local world size, its rendezvous node, and for group rank 0 the MASTER_ADDR and
MASTER_PORT of the workers) under its group rank in the round's store, then reads all of
them with a single ``multi_get``: two store operations per agent, O(n) for the job. Every
agent then computes the same answer locally: global ranks are prefix sums of
``local_world_size`` in group-rank order, role ranks the same sums restricted to the role.
Records are versioned JSON, validated on decode.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import RendezvousStateError
from ..core.state import NodeDesc
from .api import Worker

__all__ = ["AgentRecord", "assign_ranks", "record_key"]

_FORMAT = "aelastic.agent.record/1"


def record_key(group_rank: int) -> str:
    """The store key of a group rank's record."""
    return f"agent/record/{group_rank}"


@dataclass(frozen=True)
class AgentRecord:
    """What one agent tells the others of its round."""

    role: str
    local_world_size: int
    node: NodeDesc
    master_addr: str | None = None
    master_port: int | None = None

    def encode(self) -> bytes:
        """The record as JSON bytes."""
        doc: dict[str, Any] = {
            "format": _FORMAT,
            "role": self.role,
            "local_world_size": self.local_world_size,
            "node": [self.node.addr, self.node.pid, self.node.local_id],
        }
        if self.master_addr is not None:
            doc["master"] = [self.master_addr, self.master_port]
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> AgentRecord:
        """Parse a record.

        Raises:
            RendezvousStateError: ``data`` is not a record this version wrote.
        """
        try:
            doc = json.loads(data)
            if doc["format"] != _FORMAT:
                raise ValueError(f"format {doc['format']!r}")
            addr, pid, local_id = doc["node"]
            master = doc.get("master")
            record = cls(
                role=str(doc["role"]),
                local_world_size=int(doc["local_world_size"]),
                node=NodeDesc(str(addr), int(pid), int(local_id)),
                master_addr=None if master is None else str(master[0]),
                master_port=None if master is None else int(master[1]),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RendezvousStateError(f"invalid agent record {data[:200]!r}: {exc}") from exc
        if record.local_world_size <= 0:
            raise RendezvousStateError(f"invalid local_world_size in agent record {data!r}")
        return record


def assign_ranks(records: Sequence[AgentRecord], group_rank: int) -> list[Worker]:
    """The workers of ``group_rank`` with their global and role ranks and world sizes.

    Args:
        records: Every agent's record, indexed by group rank.
        group_rank: The rank of the agent whose workers are wanted.
    """
    mine = records[group_rank]
    before = records[:group_rank]
    base_global = sum(r.local_world_size for r in before)
    base_role = sum(r.local_world_size for r in before if r.role == mine.role)
    world_size = sum(r.local_world_size for r in records)
    role_world_size = sum(r.local_world_size for r in records if r.role == mine.role)
    return [
        Worker(
            local_rank=i,
            global_rank=base_global + i,
            role_rank=base_role + i,
            world_size=world_size,
            role_world_size=role_world_size,
        )
        for i in range(mine.local_world_size)
    ]
