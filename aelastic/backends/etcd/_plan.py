"""What the machine's port onto etcd reads and decides: one read of a run (:class:`View`) and
what a request decided (:class:`Plan`), as plain data (the port itself: :mod:`._port`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...core.health import JobHealth
from ...core.params import Rules
from ...core.state import NodeDesc, Op, Outcome, Reply, Request, Status, Transition
from ._control import HealthRead, Seat, placement_of
from ._layout import DEFAULT_PROFILE, Header, Profile, sort_key

__all__ = ["LISTS", "DeadlineClock", "Member", "Plan", "View"]

#: The lists a node can be in: participants, waiting, redundant.
LISTS = ("p", "w", "r")


@dataclass(frozen=True)
class Member:
    """One key of the run as read: its revisions, value and lease."""

    key: str
    mod: int
    create: int
    value: bytes = field(default=b"", repr=False)  # a node's key: its port and secret
    lease: int = 0


@dataclass(frozen=True)
class View:
    """What one read of the run shows (all at one revision).

    Attributes:
        revision: The revision read at.
        header: The header (``None``: the run has no state).
        header_mod: Its mod revision (0 when absent); ``header_create`` its create revision
            (the same: the header was never rewritten).
        own: This node's keys by list (``p``, ``w``, ``r``; ``pd`` its done mark), ``None``
            where it is not.
        participants, waiting, redundant, finished, done, left: The counts of ``p/``,
            ``w/``, ``r/``, ``q/`` (members done or gone finished), ``pd/`` (members done),
            ``l/`` (members that left unfinished).
        first: The first participant (rank 0 when the round completes) and its port.
        cut: The revision of the last completion (the ``c`` key), 0 if none.
        extras: When more than ``max_nodes`` joined a forming round at once (their joins
            raced its completion): the newest of them, which the completion sends back
            (they join again, as latecomers), and ``first`` is then the first of the others.
        health: The health key, read for the requests that may change it.
        rank: This node's rank at the cut, read for a failure report.
    """

    revision: int
    header: Header | None
    header_mod: int
    own: dict[str, Member | None]
    header_create: int = 0
    participants: int = 0
    waiting: int = 0
    redundant: int = 0
    finished: int = 0
    done: int = 0
    left: int = 0
    first: tuple[NodeDesc, int] | None = None
    cut: int = 0
    extras: tuple[Member, ...] | None = None
    health: HealthRead | None = None
    rank: int | None = None

    def where(self) -> str | None:
        """The list this node is in, if any."""
        return next((w for w in LISTS if self.own.get(w) is not None), None)


@dataclass
class Plan:
    """What a request decided: the reply's parts and the writes.

    Attributes:
        header: The header to write (``None``: unchanged).
        put: This node's keys to write: list -> value (``p`` with its port; ``pm`` its
            profile, ``pd`` and ``q`` its done marks, ``l`` its mark of a lost leave).
        delete: This node's keys to delete (lists).
        clear_marks: Delete the ``q/`` and ``l/`` keys (the next round opened).
        own_only: The decision rests on the node's own keys alone (a member leaving its
            complete round, the header left as it is): the write is compared against
            them, not against the header (see :func:`._txns.write_txn`).
        mark_cut: Write the ``c`` key (the round completed in this request).
        guard: The decision used the participants' count: the write must fail if a
            participant joined since the read.
        extras: Other nodes' ``p/`` keys the completion deletes (see :attr:`View.extras`).
        need_extras: The decision needs a read with the extras (how many).
        beat: Renew this node's lease.
        rank: The reply needs this node's rank (a finished join).
        rules: The run's rules after the request (the requester's for a run no join made).
        made: Whether the run has a state (one no join or close made is not written).
        run_rules: The run's rules, for a join refused for other ones or because the run
            closed.
        reopen_at_ms: When a run refusing a join can be used again.
        health: The job's health to store (``None``: unchanged), compared against
            ``health_mod``.
        fail_mark: The round of this node's failure mark to write.
        drop_failed: The round whose failure marks to delete (a new incident).
        reset_health: Delete the health and the failure marks (a new run).
        world, profile: The round's size and the run's profile after the request (a
            member's workers are placed from them: :mod:`._control`).
    """

    outcome: Outcome
    transition: Transition = Transition.NONE
    wake_at_ms: int | None = None
    restart: bool = False
    header: Header | None = None
    put: dict[str, bytes] = field(default_factory=dict, repr=False)
    delete: list[str] = field(default_factory=list)
    clear_marks: bool = False
    own_only: bool = False
    mark_cut: bool = False
    guard: bool = False
    extras: list[str] = field(default_factory=list)
    need_extras: int = 0
    beat: bool = False
    rank: bool = False
    known: bool = False
    master: tuple[str, int] | None = None
    where: str | None = None
    status: Status = field(default_factory=Status)
    rules: Rules = field(default_factory=lambda: Rules(1, 1, 1, 1))
    made: bool = True
    run_rules: Rules | None = None
    reopen_at_ms: int | None = None
    world: int = 0
    profile: Profile = DEFAULT_PROFILE
    health: JobHealth | None = None
    health_mod: int = 0
    fail_mark: int | None = None
    drop_failed: int | None = None
    reset_health: bool = False

    def reply(self, request: Request, seat: Seat | None) -> Reply:
        """The reply to ``request`` (a finished join's rank and placement from ``seat``,
        its seat at the round's cut)."""
        finished_join = request.op is Op.JOIN and self.outcome is Outcome.FINISH
        master = self.master if finished_join else None
        rank, placement = None, None
        if finished_join and seat is not None:
            rank = seat.rank
            placement = placement_of(seat, sort_key(request.node), self.world, self.profile)
        return Reply(
            outcome=self.outcome,
            status=self.status,
            transition=self.transition,
            rank=rank,
            master_addr=None if master is None else master[0],
            master_port=None if master is None else master[1],
            wake_at_ms=self.wake_at_ms,
            restart_deadline=self.restart,
            known=self.known,
            run_rules=self.run_rules,
            reopen_at_ms=self.reopen_at_ms,
            placement=placement,
        )


#: A process's lookup of the last call's end: (epoch, deadline id, last call ms, now) -> ms.
DeadlineClock = Callable[[str, int, int, int], int]
