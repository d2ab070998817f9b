"""The state machine ported onto the etcd layout: what one request decides, pure.

How it works: :func:`._decide.decide` is :func:`aelastic.core.machine.step` written for what one
read of etcd shows (a :class:`View`: the header, this node's own keys, the counts of the
lists, the first participant): it returns a :class:`Plan`, the reply and the writes (this
node's keys, the header when a round transition changed it) that the executor
(:mod:`._apply`) sends in one transaction, compared against what was read. Property tests
run the same random interleavings through this port on a real etcd and through the Python
machine and require the same replies and states (``tests/backends/test_etcd_machine.py``):
change one, change both.

What etcd does differently, and why it is still the machine's rule:

* **Silence** is measured by etcd: every node has a lease whose time to live is the run's
  heartbeat window (the stored rules' ``keep_alive_interval x keep_alive_max_attempt``, in
  etcd's whole seconds, never the requester's) and its keys are attached to it; a
  keep-alive renews the lease, and etcd deletes the keys of a node silent for the window.
  So the one clock that judges silence is the etcd leader's: the clocks of different
  machines are never compared (but for a closed run's vacancy, below). What the machine does
  when it prunes a node (the last call ends if too few participants are left, a complete
  round counts a lost member and names it, the next round opens when nobody is left, the
  waiting flag may fall) follows from the counts; the next request that reads the run
  writes it (:func:`reconcile`), as the machine's next request would prune.
* **Counts** are read, not stored: a join to a forming round writes only the node's own key
  (no shared value is rewritten, so a thousand joins do not conflict); the members lost and
  finished of a complete round are ``world - participants - finished`` and the ``q/``
  keys. The header records the counts as of its last write, for watchers.
* **The last call** is timed by each process from when it first saw the header that started
  it (the setter: from its own request), never from another machine's time: so no process
  ends it early, and a late observer only ends it later.
* **A closed run's vacancy** (its last node left: the run can be used again two heartbeat
  windows later, :func:`aelastic.core.machine.reuse_grace_ms`) is dated by the request that
  made it empty, in the header (``vacated``). When etcd dropped the last nodes (their leases
  expired), nobody saw when: the first request that finds the run empty dates it then (the
  machine dates it from the last node's expiry, which is earlier: etcd's run is reused no
  sooner). This is the one time written by one machine and read by others: clocks skewed
  by S move the reuse by S (the grace is two windows; NTP keeps S to milliseconds).
* **Trust** is the machine's: the rules the join that made the run stored in the header
  decide everything (a join with other ones is :attr:`~.Outcome.ERROR_RULES`), and a node's
  secret, stored in the value of its key, is compared in constant time with the request's
  before a join, keep-alive, leave or close acts for it (:attr:`~.Outcome.ERROR_FORBIDDEN`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

from ...core.machine import reuse_grace_ms
from ...core.params import Rules
from ...core.state import MAX_LOST_SAMPLE, NodeDesc, Outcome, Request, Status, Transition
from ...core.token import make
from ._layout import Header, member_parts, member_value

__all__ = [
    "LISTS",
    "DeadlineClock",
    "Member",
    "Plan",
    "Run",
    "View",
    "needs_names",
    "reconcile",
    "status_of",
]

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
        header_mod: Its mod revision (0 when absent).
        own: This node's keys by list (``p``, ``w``, ``r``), ``None`` where it is not.
        participants, waiting, redundant, finished: The counts of ``p/``, ``w/``, ``r/``,
            ``q/``.
        first: The first participant (rank 0 when the round completes) and its port.
        cut: The revision of the last completion (the ``c`` key), 0 if none.
        extras: When more than ``max_nodes`` joined a forming round at once (their joins
            raced its completion): the newest of them, which the completion sends back
            (they join again, as latecomers), and ``first`` is then the first of the others.
    """

    revision: int
    header: Header | None
    header_mod: int
    own: dict[str, Member | None]
    participants: int = 0
    waiting: int = 0
    redundant: int = 0
    finished: int = 0
    first: tuple[NodeDesc, int] | None = None
    cut: int = 0
    extras: tuple[Member, ...] | None = None

    def where(self) -> str | None:
        """The list this node is in, if any."""
        return next((w for w in LISTS if self.own.get(w) is not None), None)


@dataclass
class Plan:
    """What a request decided: the reply's parts and the writes.

    Attributes:
        header: The header to write (``None``: unchanged).
        put: This node's keys to write: list -> value (``p`` with its port).
        delete: This node's keys to delete (lists).
        clear_finished: Delete the ``q/`` keys (the next round opened).
        mark_cut: Write the ``c`` key (the round completed in this request).
        guard: The decision used the participants' count: the write must fail if a
            participant joined since the read.
        extras: Other nodes' ``p/`` keys the completion deletes (see :attr:`View.extras`).
        need_extras: The decision needs a read with the extras (how many).
        beat: Renew this node's lease.
        rank: The reply needs this node's rank (a finished join).
        rules: The run's rules after the request (the requester's for a run no join made).
        made: Whether a join made the run (a state no join made is not written).
        run_rules: The run's rules, for a join refused for other ones.
        reopen_at_ms: When a closed run refusing a join can be used again.
    """

    outcome: Outcome
    transition: Transition = Transition.NONE
    wake_at_ms: int | None = None
    restart: bool = False
    header: Header | None = None
    put: dict[str, bytes] = field(default_factory=dict, repr=False)
    delete: list[str] = field(default_factory=list)
    clear_finished: bool = False
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


#: A process's lookup of the last call's end: (epoch, deadline id, last call ms, now) -> ms.
DeadlineClock = Callable[[str, int, int, int], int]


class Run:
    """The run's logical state while a request is decided (the header plus the counts)."""

    def __init__(self, view: View, epoch: str, req: Request) -> None:
        h = view.header
        self.h = h if h is not None else Header(epoch=epoch, rules=req.rules)
        self.fresh = h is None
        self.np, self.nw, self.nr, self.nq = (
            view.participants,
            view.waiting,
            view.redundant,
            view.finished,
        )
        self.where = view.where()
        self.first = view.first
        self.node = req.node
        self.secret = req.secret
        self.port = req.port
        self.rules = self.h.rules or req.rules
        self.plan = Plan(Outcome.FINISH)
        own = view.own.get(self.where) if self.where is not None else None
        stored = None if own is None else member_parts(own.value)[1]
        #: The node is listed under the request's secret (compared in constant time).
        self.owns = stored is not None and hmac.compare_digest(stored, req.secret.encode())

    @property
    def listed(self) -> int:
        """How many nodes are in the run (the machine's heartbeats)."""
        return self.np + self.nw + self.nr

    def reopen_at(self) -> int | None:
        """The machine's ``reopen_at_ms``: when the closed, empty run can be used again."""
        h = self.h
        if self.listed or h.vacated is None:
            return None
        return h.vacated + reuse_grace_ms(self.rules)

    @property
    def lost(self) -> int:
        h = self.h
        return max(h.world - self.np - self.nq, 0) if h.complete else 0

    def signature(self, deadline: tuple[int, int] | None) -> tuple[object, ...]:
        h = self.h
        lost = self.lost > 0
        fin = self.nq > 0 if h.complete else False
        return (h.round, h.complete, h.closed, deadline and deadline[0], self.nw > 0, lost, fin)

    # -- changes (the machine's, on this layout) ------------------------------------------

    def open_next_round(self) -> None:
        h = self.h
        self.h = h.evolve(
            round=h.round + 1,
            complete=False,
            deadline=None,
            world=0,
            sample=(),
            sampled=0,
            master=None,
        )
        if self.nq:
            self.plan.clear_finished = True
        self.nq = 0

    def drop_own(self, where: str) -> None:
        plan = self.plan
        if where in plan.put:
            del plan.put[where]
        else:
            plan.delete.append(where)
        if where == "p":
            self.np -= 1
        elif where == "w":
            self.nw -= 1
        else:
            self.nr -= 1
        self.where = None

    def add_own(self, where: str) -> None:
        plan = self.plan
        if where in plan.delete:
            plan.delete.remove(where)
        plan.put[where] = member_value(self.port if where == "p" else 0, self.secret)
        self.owns = True
        if where == "p":
            self.np += 1
        elif where == "w":
            self.nw += 1
        else:
            self.nr += 1
        self.where = where

    def remove(self, now: int, finished: bool = False) -> None:
        """The machine's ``_remove`` of this node (gone at ``now``)."""
        where = self.where
        if where is None:
            return
        self.drop_own(where)
        self.owns = False
        if self.h.closed and not self.listed:
            self.h = self.h.evolve(vacated=now)
        if where != "p":
            return
        h = self.h
        if not h.complete:
            if self.np < self.rules.min_nodes:
                self.h = h.evolve(deadline=None)
        elif self.np == 0:
            self.open_next_round()
        elif finished:
            self.plan.put["q"] = b""
            self.nq += 1
        else:
            sample = h.sample
            if len(sample) < MAX_LOST_SAMPLE:
                sample = (*sample, self.node.key)
            self.h = h.evolve(sample=sample, sampled=h.sampled + 1)

    def complete(self) -> None:
        """The machine's ``_complete``: ranks are the sorted order of the ``p/`` keys."""
        first = self.first
        if "p" in self.plan.put and (first is None or self.node < first[0]):
            first = (self.node, self.port)
        master = None if first is None else (first[0].addr, first[1])
        self.h = self.h.evolve(
            complete=True, deadline=None, world=self.np, sample=(), sampled=0, master=master
        )
        self.plan.mark_cut = True
        self.plan.guard = True


def reconcile(run: Run, view: View, lost_names: list[str], now: int) -> None:
    """What the machine's pruning would have done: effects of the nodes etcd removed.

    ``lost_names`` are the members of the complete round that etcd removed since the
    header's last write, in order (for the sample; the count comes from the counts).

    Joins race: a forming round may hold ``min_nodes`` participants without a last call, or
    ``max_nodes`` without being complete, when the joins that reached them ran at once. The
    request that sees it does what the join would have done (never in a serial run, where
    the join itself does it).
    """
    h, rules = run.h, run.rules
    if h.closed and not run.listed and h.vacated is None and not run.fresh:
        run.h = h = h.evolve(vacated=now)  # etcd dropped its last nodes: dated now
    if h.complete and run.np == 0:
        run.open_next_round()
        return
    if not h.complete:
        if h.deadline is not None and run.np < rules.min_nodes:
            run.h = h.evolve(deadline=None)
        elif h.closed:
            return
        elif run.np >= rules.max_nodes:
            extra = run.np - rules.max_nodes
            if extra and (view.extras is None or len(view.extras) < extra):
                run.plan.need_extras = extra
                return
            keys = [m.key for m in (view.extras or ())[:extra]]
            own = view.own.get("p")
            if own is not None and own.key in keys:
                keys.remove(own.key)
                run.drop_own("p")  # this node's own join came too late: it joins again
            run.plan.extras = keys
            run.np -= len(keys)
            run.complete()
        elif run.np >= rules.min_nodes and h.deadline is None:
            run.h = h.evolve(deadline=(-1, now + rules.last_call_ms))
        return
    lost = run.lost
    if lost > h.sampled:
        sample = list(h.sample)
        for name in lost_names[: lost - h.sampled]:
            if len(sample) < MAX_LOST_SAMPLE:
                sample.append(name)
        run.h = h.evolve(sample=tuple(sample), sampled=lost)


def needs_names(view: View) -> int:
    """How many lost members' names a request on ``view`` needs (0: none)."""
    h = view.header
    if h is None or not h.complete or len(h.sample) >= MAX_LOST_SAMPLE:
        return 0
    lost = h.world - view.participants - view.finished
    return max(lost - h.sampled, 0)


def status_of(
    h: Header, participants: int, waiting: int, redundant: int, finished: int, now: int,
    deadline_ms: int | None,
) -> Status:  # fmt: skip
    """The status of a run whose header is ``h`` and whose lists hold these counts."""
    lost = max(h.world - participants - finished, 0) if h.complete else 0
    return Status(
        token=make(h.epoch, h.gen),
        round=h.round,
        complete=h.complete,
        closed=h.closed,
        deadline_ms=deadline_ms,
        now_ms=now,
        participants=participants,
        world=h.world,
        waiting=waiting,
        redundant=redundant,
        lost=lost,
        finished=finished if h.complete else 0,
        lost_sample=h.sample,
    )
