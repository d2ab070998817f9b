"""How the group of a completed round looks to one of its members (pure).

:func:`view_of` turns the run's :class:`~.state.Status` (which the backend sends on every
round transition and with every reply) into a :class:`MembershipView`: whether the group
changed since the round completed, and how.
"""

from __future__ import annotations

from dataclasses import dataclass

from .state import NodeDesc, Status

__all__ = ["MembershipView", "view_of"]


@dataclass(frozen=True)
class MembershipView:
    """How the group of a completed round looks now, from one member's point of view.

    Attributes:
        round: The run's current round.
        closed: The run is closed.
        removed: This node is no longer a participant of the round it completed (it was
            pruned, or the round is over).
        lost: Some of the members that left or went silent before finishing (at most a
            few; ``lost_count`` is exact).
        waiting: Nodes waiting to join the next round (torch's ``num_nodes_waiting``).
        lost_count: How many members left or went silent before finishing.
        finished: How many members left after their workers succeeded.
        done: How many members said their workers succeeded and are still there.
        all_done: Every member said its workers succeeded (or left after they did).
    """

    round: int
    closed: bool
    removed: bool
    lost: frozenset[NodeDesc]
    waiting: int
    lost_count: int = 0
    finished: int = 0
    done: int = 0
    all_done: bool = False

    @property
    def changed(self) -> bool:
        """Whether the group differs from the round as it completed."""
        return (
            self.closed
            or self.removed
            or self.lost_count > 0
            or self.waiting > 0
            or self.finished > 0
            or self.all_done
        )


def view_of(status: Status, node: NodeDesc, round_: int, removed: bool = False) -> MembershipView:
    """The view of ``node``, a member of round ``round_``, given the run's ``status``.

    Args:
        status: The run's latest status.
        node: The member looking.
        round_: The round it completed.
        removed: It learnt that it is no longer in the state (its heartbeat was refused).
    """
    same = status.round == round_ and status.complete
    lost = frozenset(n for n in (NodeDesc.from_key(k) for k in status.lost_sample) if n != node)
    return MembershipView(
        round=status.round,
        closed=status.closed,
        removed=removed or not same,
        lost=lost if same else frozenset(),
        waiting=status.waiting,
        lost_count=status.lost if same else 0,
        finished=status.finished if same else 0,
        done=status.done if same else 0,
        all_done=same and status.all_done,
    )
