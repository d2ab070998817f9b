"""The job's control state on etcd, pure: where a member's workers stand, and the job's health.

How it works:

* **Placement** is torch's rank assignment, as :func:`aelastic.core.machine.step` fixes it at
  completion (global ranks: prefix sums of the members' local world sizes in rank order; role
  ranks: the same within each role). On etcd each member works out its own from what it
  reads at the round's cut, never from an O(N) read: its rank (the count of ``p/`` keys
  before its own), the round's size (the header's ``world``), the run's profile (the
  header's) and the ``pm/`` keys at the cut, the members whose profile is another, with
  theirs (:class:`Seat`). Every member before it without a mark has the run's profile, so
  a uniform job (no mark: the usual case) is placed by arithmetic, and a mixed one by the
  marks alone.
* **The job's health** is one key (``a``) that requests change with a transaction compared
  against its revision. A failure report also writes the reporter's mark under the round
  (``x/<round>/<node>``): the newest incident's ``failed`` is the count of its round's marks
  (:class:`HealthRead`), so a report whose root cause is not better than the incident's
  writes its mark only, and a thousand members reporting one incident do not all rewrite
  one key. A new incident freezes the previous one's count in the document and drops its
  marks (:func:`report_failure`). Members etcd dropped (their leases expired) are counted
  lost by the request that accounts for them (:func:`with_losses`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...core.health import FailureRecord, JobHealth, with_failure, with_lost
from ...core.state import NodeDesc, Placement
from ._layout import Profile

__all__ = ["HealthRead", "Seat", "placement_of", "report_failure", "with_losses"]


@dataclass(frozen=True)
class Seat:
    """What a member reads at its round's cut to place its workers.

    Attributes:
        rank: Its rank (the ``p/`` keys before its own).
        marks: The ``pm/`` keys at the cut: (node key suffix, profile), in key order.
    """

    rank: int
    marks: tuple[tuple[str, Profile], ...] = ()


def placement_of(seat: Seat, own: str, world: int, profile: Profile) -> Placement:
    """Where the workers of the member whose key suffix is ``own`` stand, in a round of
    ``world`` members whose run's profile is ``profile`` (see the module docstring)."""
    run_role, run_size = profile
    mine = next((p for key, p in seat.marks if key == own), profile)
    before = [p for key, p in seat.marks if key < own]
    plain_before = max(seat.rank - len(before), 0)
    plain = max(world - len(seat.marks), 0)
    every = [p for _, p in seat.marks]
    role = mine[0]
    same = role == run_role
    return Placement(
        base=plain_before * run_size + sum(size for _, size in before),
        world=plain * run_size + sum(size for _, size in every),
        role_base=(plain_before * run_size if same else 0)
        + sum(size for r, size in before if r == role),
        role_world=(plain * run_size if same else 0) + sum(size for r, size in every if r == role),
    )


@dataclass(frozen=True)
class HealthRead:
    """The health key as read: its document, its mod revision (0: absent) and how many
    failure marks there are (those of the newest incident's round)."""

    stored: JobHealth
    mod: int = 0
    marks: int = 0

    @property
    def health(self) -> JobHealth:
        """The job's health: the document, its newest incident's ``failed`` counted."""
        latest = self.stored.latest
        if latest is None or not self.marks or latest.failed == self.marks:
            return self.stored
        counted = replace(latest, failed=self.marks)
        return replace(self.stored, incidents=(*self.stored.incidents[:-1], counted))


def report_failure(health: JobHealth, record: FailureRecord) -> tuple[JobHealth | None, int | None]:
    """``health`` (counted, :attr:`HealthRead.health`) after a member's failure ``record``:
    the document to store (``None``: unchanged, the report's mark alone counts it) and the
    round whose marks to drop (a new incident: the previous one's, its count kept)."""
    changed = with_failure(health, record)
    if changed is None:
        return None, None
    latest = health.latest
    drop = latest.round if latest is not None and latest.round != record.round else None
    return changed, drop


def with_losses(health: JobHealth, names: list[str], round_: int) -> JobHealth | None:
    """``health`` after the members named ``names`` (node keys) were lost in ``round_`` (their
    hosts counted lost: :func:`aelastic.core.health.with_lost`); ``None``: unchanged."""
    changed = None
    for name in names:
        host = NodeDesc.from_key(name).addr
        after = with_lost(changed or health, host, round_, None)
        if after is not None:
            changed = after
    return changed
