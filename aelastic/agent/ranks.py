"""Role-aware rank assignment from what every agent of a round published (pure).

How it works: after a round completes, each agent writes one :class:`AgentRecord` (its
role, its local world size, its rendezvous node, and for group rank 0 the MASTER_ADDR and
MASTER_PORT of the workers) under its group rank in the round's store. Group rank 0 reads
them all with one ``multi_get``, computes every agent's :class:`Assignment` (global ranks are
prefix sums of ``local_world_size`` in group-rank order, role ranks the same sums restricted
to the role) and writes each under its group rank; every other agent reads only its own.
So an agent makes two store operations whatever the size of the job, and group rank 0 makes
O(n). Records and assignments are versioned JSON, validated on decode. Everything here is
pure except :func:`exchange_ranks`, which does those store operations.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import RendezvousStateError
from ..core.state import NodeDesc
from ..core.store import Store
from .api import Worker

__all__ = [
    "AgentRecord",
    "Assignment",
    "ReservedPort",
    "assign_ranks",
    "assignment_key",
    "assignments",
    "exchange_ranks",
    "record_key",
]

_FORMAT = "aelastic.agent.record/1"
_ASSIGNMENT_FORMAT = "aelastic.agent.assignment/1"


def record_key(group_rank: int) -> str:
    """The store key of a group rank's record."""
    return f"agent/record/{group_rank}"


def assignment_key(group_rank: int) -> str:
    """The store key of a group rank's assignment (written by group rank 0)."""
    return f"agent/assignment/{group_rank}"


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


@dataclass(frozen=True)
class Assignment:
    """What group rank 0 tells one agent: where its workers stand in the job."""

    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    def workers(self) -> list[Worker]:
        """This agent's workers with their ranks and world sizes."""
        return [
            Worker(
                local_rank=i,
                global_rank=self.base_global_rank + i,
                role_rank=self.base_role_rank + i,
                world_size=self.world_size,
                role_world_size=self.role_world_size,
            )
            for i in range(self.local_world_size)
        ]

    def encode(self) -> bytes:
        """The assignment as JSON bytes."""
        doc = {
            "format": _ASSIGNMENT_FORMAT,
            "ranks": [self.base_global_rank, self.world_size, self.base_role_rank],
            "role_world_size": self.role_world_size,
            "local_world_size": self.local_world_size,
            "master": [self.master_addr, self.master_port],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Assignment:
        """Parse an assignment.

        Raises:
            RendezvousStateError: ``data`` is not an assignment this version wrote.
        """
        try:
            doc = json.loads(data)
            if doc["format"] != _ASSIGNMENT_FORMAT:
                raise ValueError(f"format {doc['format']!r}")
            base, world, base_role = (int(v) for v in doc["ranks"])
            addr, port = doc["master"]
            role_world, local = int(doc["role_world_size"]), int(doc["local_world_size"])
            return cls(base, world, base_role, role_world, local, str(addr), int(port))
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousStateError(f"invalid rank assignment {data[:200]!r}: {exc}") from exc


def assignments(records: Sequence[AgentRecord]) -> list[Assignment]:
    """Every agent's assignment, by group rank (group rank 0 computes them).

    Raises:
        RendezvousStateError: Group rank 0's record names no MASTER_ADDR/MASTER_PORT.
    """
    master = records[0]
    if master.master_addr is None or master.master_port is None:
        raise RendezvousStateError("group rank 0 published no MASTER_ADDR/MASTER_PORT")
    world_size = sum(r.local_world_size for r in records)
    role_sizes: dict[str, int] = {}
    for r in records:
        role_sizes[r.role] = role_sizes.get(r.role, 0) + r.local_world_size
    out, base, role_bases = [], 0, dict.fromkeys(role_sizes, 0)
    for r in records:
        role_base, role_size = role_bases[r.role], role_sizes[r.role]
        addr, port = master.master_addr, master.master_port
        out.append(
            Assignment(base, world_size, role_base, role_size, r.local_world_size, addr, port)
        )
        base += r.local_world_size
        role_bases[r.role] += r.local_world_size
    return out


async def exchange_ranks(
    store: Store, group_rank: int, world_size: int, mine: AgentRecord, timeout: float
) -> Assignment:
    """Publish ``mine``; group rank 0 assigns every agent; the others read their own.

    Raises:
        StoreTimeoutError: The records (rank 0) or this agent's assignment did not appear
            within ``timeout`` (callers race this against a change of the group).
        RendezvousStateError: A record or assignment is not valid.
    """
    await store.set(record_key(group_rank), mine.encode())
    if group_rank != 0:
        return Assignment.decode(await store.get(assignment_key(group_rank), timeout))
    keys = [record_key(i) for i in range(world_size)]
    records = [AgentRecord.decode(data) for data in await store.multi_get(keys, timeout)]
    assigned = assignments(records)
    await asyncio.gather(
        *(store.set(assignment_key(rank), a.encode()) for rank, a in enumerate(assigned) if rank)
    )
    return assigned[0]


class ReservedPort:
    """A free port that group rank 0 keeps bound from the rank exchange until its workers
    start (so that nothing else takes MASTER_PORT meanwhile)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def reserve(self) -> int:
        """Bind a free port (releasing the one held before); its number."""
        self.release()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("", 0))
        self._sock = sock
        port: int = sock.getsockname()[1]
        return port

    def release(self) -> None:
        """Let the port go (harmless when none is held)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
