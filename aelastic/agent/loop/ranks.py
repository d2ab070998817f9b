"""Workers' ranks from the node's place in its round, and the port rank 0's workers bind.

How it works: every member's join says its worker role and local world size; the
rendezvous fixes, as the round completes, where each member's workers stand (torch's
assignment: global ranks are prefix sums of ``local_world_size`` in group-rank order, role
ranks the same sums within the role) and answers each member with its own
:class:`~aelastic.core.state.Placement`. Nothing here reads what another node wrote:
:func:`workers_of` is pure. The master port is offered by each node's join (a port it keeps
bound, :class:`ReservedPort`) and the rendezvous answers every member with group rank 0's.
"""

from __future__ import annotations

import socket

from ...core.state import Placement
from ..api import Worker

__all__ = ["ReservedPort", "workers_of"]


def workers_of(placement: Placement, local_world_size: int) -> list[Worker]:
    """This node's workers with their global and role ranks and world sizes.

    Args:
        placement: Where the node's workers stand in the round (its join's answer).
        local_world_size: How many workers the node runs.
    """
    return [
        Worker(
            local_rank=i,
            global_rank=placement.base + i,
            role_rank=placement.role_base + i,
            world_size=placement.world,
            role_world_size=placement.role_world,
        )
        for i in range(local_world_size)
    ]


class ReservedPort:
    """A free port that this node offers in its join for its workers' bootstrap, kept bound
    until its workers start if it is group rank 0 (so that nothing else takes MASTER_PORT
    meanwhile), let go at once otherwise."""

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
