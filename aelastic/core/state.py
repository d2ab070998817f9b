"""The rendezvous state of one run, and the values that travel between nodes and backends.

How it works: a run's state is a small header (round, complete, closed, last-call deadline,
counters, and the run's own :class:`~.params.Rules`, fixed by the join that made it) plus
one entry per node: the participants (join order, then rank), the wait and redundancy lists,
a heartbeat time and the node's secret (drawn by the node, sent with each of its requests: a
request for a node without its secret changes nothing). A node never handles the whole
state: it sends a :class:`Request` (join, leave, close, keep-alive, status) and the backend
applies the state machine (:mod:`.machine`) to its copy, answering with a :class:`Reply` of
constant size (outcome, this node's rank, and the :class:`Status` header). Watchers are sent
a :class:`Status` when the round's status changes, never on a heartbeat. A :class:`Snapshot`
is the full membership, for ``aelastic status`` and tests.

All times in the state are the backend's own clock in whole milliseconds, so clocks of
different machines are never compared.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from ._ops import Op, Outcome, Transition
from .health import JobHealth, NodeReport
from .params import Rules
from .token import NO_STATE, make

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_LOCAL_WORLD_SIZE",
    "MAX_LOST_SAMPLE",
    "MAX_ROLE",
    "OPERATOR",
    "MemberEntry",
    "NodeDesc",
    "Op",
    "Outcome",
    "Placement",
    "Reply",
    "Request",
    "RunState",
    "Snapshot",
    "Status",
    "Transition",
    "snapshot_of",
    "status_of",
]

#: Format tag of the rendezvous state.
FORMAT = "aelastic.rendezvous.state"
#: Version of the state's layout and wire format. Version 1 was one JSON blob per run;
#: version 2 took each request's rules and had no node secrets; version 3 kept the job's
#: control state (ranks of workers, failures, the exit barrier) in the members' store.
FORMAT_VERSION = 4
#: Characters of a worker role's name at most.
MAX_ROLE = 256
#: Workers of one node at most (a join saying more is refused on the wire).
MAX_LOCAL_WORLD_SIZE = 1 << 16
#: How many lost members a status names (the counts are exact).
MAX_LOST_SAMPLE = 4


class NodeDesc(NamedTuple):
    """A node of the rendezvous: its address, its process id and a process-wide counter.

    A tuple, so hashing and ordering run at C speed. Its :attr:`key` (``addr_pid_id``) is
    how backends name it.
    """

    addr: str
    pid: int
    local_id: int

    def __str__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"

    @property
    def key(self) -> str:
        """The node's name in a backend (``addr_pid_localid``)."""
        return f"{self.addr}_{self.pid}_{self.local_id}"

    @classmethod
    def from_key(cls, key: str) -> NodeDesc:
        """The node named ``key``.

        Raises:
            ValueError: ``key`` is not ``addr_pid_localid`` with a non-empty address.
        """
        addr, _, rest = key.rpartition("_")
        addr, _, pid = addr.rpartition("_")
        if not addr or not pid.isdigit() or not rest.isdigit() or not key.isprintable():
            raise ValueError(f"{key!r} is not a node name (addr_pid_localid)")
        return cls(addr, int(pid), int(rest))


#: Who an operator's request names (it acts for no node).
OPERATOR = NodeDesc("operator", 0, 0)


@dataclass(frozen=True)
class Request:
    """One node's request.

    Attributes:
        op: What it asks.
        node: Who asks.
        rules: The node's view of the run's rules (bounds, last call, heartbeat window):
            the join that makes a run fixes them; a later join with other rules is refused.
        expired: The node's join timeout has passed (a join then gives up).
        finished: A leave after this node's workers succeeded (the others need not act).
        port: A free port on the node, for the workers' bootstrap if it becomes rank 0.
        now_ms: The time to decide at; only an in-process backend takes it (from the
            handler's clock); servers use their own.
        secret: The node's secret (never shown): a request acting for a node that is in
            the run under another secret is refused.
        operator: A close by the run's operator (``aelastic status --close``), or a
            departure a backend vouches for: the backend made it for a caller it trusts;
            never sent by a node.
        since_ms: A departure's moment (the backend's time): when the node's connection
            was last known to work. The node is lost if it was not heard from after it.
        confirmed: A departure a member backs: one of the run's members, heard since, said
            its workers' collective broke after the connection ended (the backend checked
            both); no grace then.
        role: A join's worker role (torch's ``WorkerSpec.role``): the workers' role ranks
            count within it.
        local_world_size: A join's number of workers on the node: the round's worker
            ranks are fixed from these (:class:`Placement`).
        report: What a REPORT says of the node itself (its failure, or its host set aside).
    """

    op: Op
    node: NodeDesc
    rules: Rules
    expired: bool = False
    finished: bool = False
    port: int = 0
    now_ms: int | None = None
    secret: str = field(default="", repr=False)
    operator: bool = False
    since_ms: int | None = None
    confirmed: bool = False
    role: str = "default"
    local_world_size: int = 1
    report: NodeReport | None = None

    @classmethod
    def departure(
        cls,
        node: NodeDesc,
        since_ms: int,
        secret: str = "",
        now_ms: int | None = None,
        confirmed: bool = False,
    ) -> Request:
        """A backend's report that ``node``'s connection ended at ``since_ms`` (its time).

        With ``secret`` (the one the node's own requests carried on that connection) it
        acts for the node under the usual check; without, it is the backend's own word
        (``operator``: a backend trusted as the run's operator, e.g. Redis' credentials).
        """
        return cls(
            Op.DEPART,
            node,
            Rules(1, 1, 1, 1),
            now_ms=now_ms,
            secret=secret,
            operator=not secret,
            since_ms=since_ms,
            confirmed=confirmed,
        )

    @classmethod
    def operator_close(cls, now_ms: int | None = None) -> Request:
        """The request closing a run for its operator (no node acts; no rules apply)."""
        return cls(Op.CLOSE, OPERATOR, Rules(1, 1, 1, 1), now_ms=now_ms, operator=True)


@dataclass(frozen=True)
class Status:
    """The header of a run's state: what a watcher needs, in constant size.

    Attributes:
        token: Version of the status; it changes exactly when a notifying field changes
            (round, complete, closed, deadline, or whether nodes are waiting, members lost,
            members finished), never on a join to an open round or a heartbeat.
        now_ms: The backend's time when the status was made (``deadline_ms`` and heartbeat
            times are on the same clock).
        participants: Current participants (of the complete round: those still there).
        world: Size of the round at completion (0 while it forms).
        lost: Members of the complete round that left or died before finishing.
        finished: Members of the complete round that left after their workers succeeded.
        lost_sample: Names of the first lost members (at most :data:`MAX_LOST_SAMPLE`).
        done: Members of the complete round that said their workers succeeded and are
            still there (the exit barrier is passed once ``done + finished == world``).
    """

    token: str = ""
    round: int = 0
    complete: bool = False
    closed: bool = False
    deadline_ms: int | None = None
    now_ms: int = 0
    participants: int = 0
    world: int = 0
    waiting: int = 0
    redundant: int = 0
    lost: int = 0
    finished: int = 0
    lost_sample: tuple[str, ...] = ()
    done: int = 0

    @property
    def all_done(self) -> bool:
        """Whether every member of the complete round said its workers succeeded (or left
        after they did): the exit barrier is passed."""
        return self.complete and self.world > 0 and self.done + self.finished >= self.world

    def signature(self) -> tuple[object, ...]:
        """The fields whose change notifies watchers."""
        return (
            self.round,
            self.complete,
            self.closed,
            self.deadline_ms,
            self.waiting > 0,
            self.lost > 0,
            self.finished > 0,
            self.all_done,
        )


@dataclass(frozen=True)
class Placement:
    """Where one node's workers stand in the round's job, fixed at completion from every
    member's join (torch's rank assignment: global ranks are prefix sums of the members'
    local world sizes in rank order, role ranks the same sums within the role).

    Attributes:
        base: The global rank of the node's first worker.
        world: Workers in the round (torch's ``WORLD_SIZE``).
        role_base: The role rank of the node's first worker.
        role_world: Workers of the node's role in the round.
    """

    base: int
    world: int
    role_base: int
    role_world: int


@dataclass(frozen=True)
class Reply:
    """The answer to a :class:`Request`.

    Attributes:
        outcome: What the node does next.
        status: The run's status after the request.
        transition: The main change the request made.
        rank: This node's rank (a join that finished).
        master_addr, master_port: Where rank 0's workers bootstrap (a join that finished).
        wake_at_ms: When the node must ask again by itself (the last call's end), if ever.
        restart_deadline: The node left the redundancy list: its join timeout starts anew.
        known: Whether the node is in the state under the request's secret (after it).
        oldest_beat_ms: The oldest heartbeat of any node (a keep-alive's answer), so the
            caller can check when it expires.
        pruned: How many silent nodes this request removed.
        run_rules: The run's rules, when a join was refused for other ones
            (:attr:`Outcome.ERROR_RULES`) or because the run closed
            (:attr:`Outcome.ERROR_CLOSED`: with ``reopen_at_ms``, the node can tell when
            the run's last node left).
        reopen_at_ms: When a run refusing a join (closed, or of other rules) can be used
            again by a new job (:attr:`Outcome.ERROR_CLOSED`, :attr:`Outcome.ERROR_RULES`;
            ``None``: nodes are still in it).
        placement: Where this node's workers stand in the round (a join that finished).
    """

    outcome: Outcome
    status: Status
    transition: Transition = Transition.NONE
    rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    wake_at_ms: int | None = None
    restart_deadline: bool = False
    known: bool = False
    oldest_beat_ms: int | None = None
    pruned: int = 0
    run_rules: Rules | None = None
    reopen_at_ms: int | None = None
    placement: Placement | None = None


@dataclass(frozen=True)
class MemberEntry:
    """One node in a :class:`Snapshot`: where it is, its rank, its last heartbeat."""

    node: NodeDesc
    beat_ms: int
    rank: int | None = None


@dataclass(frozen=True)
class Snapshot:
    """The whole membership of a run (``aelastic status``, dashboards, tests), and the
    run's rules (``None`` only when a backend of another version answered)."""

    status: Status
    participants: tuple[MemberEntry, ...] = ()
    wait_list: tuple[MemberEntry, ...] = ()
    redundancy_list: tuple[MemberEntry, ...] = ()
    master_addr: str | None = None
    master_port: int | None = None
    rules: Rules | None = None

    def knows(self, node: NodeDesc) -> bool:
        """Whether ``node`` is anywhere in the state."""
        return any(e.node == node for e in self.members())

    def members(self) -> tuple[MemberEntry, ...]:
        """Every node of the state."""
        return self.participants + self.wait_list + self.redundancy_list

    def ranks(self) -> dict[NodeDesc, int | None]:
        """Participants and their ranks (``None`` while the round forms)."""
        return {e.node: e.rank for e in self.participants}


@dataclass(eq=False)
class RunState:
    """A run's state as an in-process backend keeps it (the Redis layout mirrors it).

    ``participants`` maps a node to its join sequence number while the round forms, to its
    rank once it is complete (dicts keep insertion order, which is join order).
    ``beats`` is ordered by heartbeat: a beat moves its node to the end, so the oldest is
    first and finding the silent nodes costs nothing while nobody is silent (an
    ``OrderedDict``: a plain dict's iteration skips the slots its moved entries left, as many
    as hundreds per beat at thousands of nodes, until it is resized; measured 3.3 us against
    1.0 us a beat at 4,096 nodes). ``rules`` is
    ``None`` until a join makes the run (a state without rules is not stored); ``secrets``
    holds each listed node's secret (never shown); ``vacated_ms`` when the run's last node
    left (the run can be reused :func:`~.machine.reuse_grace_ms` later). ``profiles`` holds
    each participant's role and local world size (from its join), ``placements`` where each
    member's workers stand once the round is complete; ``done`` the members that said their
    workers succeeded, ``failed`` those that reported a failure, in this round; ``health``
    the job's health (:mod:`.health`), kept across rounds.
    """

    epoch: str
    rules: Rules | None = None
    generation: int = 0
    round: int = 0
    complete: bool = False
    closed: bool = False
    deadline_ms: int | None = None
    seq: int = 0
    world: int = 0
    lost: int = 0
    finished: int = 0
    lost_sample: list[str] = field(default_factory=list)
    master: tuple[str, int] | None = None
    participants: dict[NodeDesc, int] = field(default_factory=dict)
    ports: dict[NodeDesc, int] = field(default_factory=dict)
    wait_list: set[NodeDesc] = field(default_factory=set)
    redundancy_list: set[NodeDesc] = field(default_factory=set)
    beats: OrderedDict[NodeDesc, int] = field(default_factory=OrderedDict)
    secrets: dict[NodeDesc, str] = field(default_factory=dict, repr=False)
    #: When the run's last node left (``None``: nodes are in it, or none ever was).
    vacated_ms: int | None = None
    profiles: dict[NodeDesc, tuple[str, int]] = field(default_factory=dict)
    placements: dict[NodeDesc, Placement] = field(default_factory=dict)
    done: set[NodeDesc] = field(default_factory=set)
    failed: set[NodeDesc] = field(default_factory=set)
    health: JobHealth = field(default_factory=JobHealth)

    @property
    def made(self) -> bool:
        """Whether a join made the run (it has rules): only then is the state stored."""
        return self.rules is not None

    def knows(self, node: NodeDesc) -> bool:
        """Whether ``node`` is anywhere in the state (every listed node has a heartbeat)."""
        return node in self.beats


# -- reading a state ------------------------------------------------------------------------


def status_of(state: RunState, now_ms: int) -> Status:
    """The status header of ``state`` at ``now_ms`` (an empty one, token ``NO_STATE``,
    when no join made the run)."""
    if not state.made:
        return Status(token=NO_STATE, now_ms=now_ms)
    return Status(
        token=make(state.epoch, state.generation),
        round=state.round,
        complete=state.complete,
        closed=state.closed,
        deadline_ms=state.deadline_ms,
        now_ms=now_ms,
        participants=len(state.participants),
        world=state.world,
        waiting=len(state.wait_list),
        redundant=len(state.redundancy_list),
        lost=state.lost,
        finished=state.finished,
        lost_sample=tuple(state.lost_sample),
        done=len(state.done),
    )


def snapshot_of(state: RunState, now_ms: int) -> Snapshot:
    """The whole membership of ``state`` at ``now_ms`` (never its secrets)."""
    beats = state.beats
    rank = state.complete
    return Snapshot(
        status=status_of(state, now_ms),
        participants=tuple(
            MemberEntry(n, beats.get(n, 0), r if rank else None)
            for n, r in state.participants.items()
        ),
        wait_list=tuple(MemberEntry(n, beats.get(n, 0)) for n in sorted(state.wait_list)),
        redundancy_list=tuple(
            MemberEntry(n, beats.get(n, 0)) for n in sorted(state.redundancy_list)
        ),
        master_addr=None if state.master is None else state.master[0],
        master_port=None if state.master is None else state.master[1],
        rules=state.rules,
    )
