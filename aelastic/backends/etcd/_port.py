"""The state machine ported onto the etcd layout: what one request decides, pure.

How it works: :func:`._decide.decide` is :func:`aelastic.core.machine.step` written for what one
read of etcd shows (a :class:`~._plan.View`: the header, this node's own keys, the counts
of the lists, the first participant): it returns a :class:`~._plan.Plan`, the reply and the
writes (this node's keys, the header when a round transition changed it) that the executor
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
  (no shared value is rewritten, so a thousand joins do not conflict); of a complete round,
  the members done are the ``pd/`` keys, those done or finished the ``q/`` keys (a done
  member etcd dropped stays counted: ``q/`` has no lease), the members lost
  ``world - participants - finished``; of those, the ones that left (a leave is never
  counted lost in the job's health) are the ``l/`` keys, the rest etcd dropped. A member
  leaving its complete round writes its own keys only (its ``l/`` mark; the header too
  while the lost sample has room, or when a watched flag moves), compared against its own
  keys alone: so the survivors of a lost node, all leaving at once to re-rendezvous, do
  not contend on one key. The header records the counts as of its last write,
  for watchers; a request that finds them moved past a watched flag (all done, say) writes
  it.
* **The job's control state** is the machine's too: a join's profile (role, local world
  size) is a ``pm/`` mark when it is not the run's, and each member places its workers from
  what it reads at the cut (:mod:`._control`); ``DONE`` writes the member's ``pd/`` and
  ``q/`` keys; ``REPORT`` and the losses etcd made change the health key, compared against
  its revision and the node's own keys (still a participant of the complete round).
* **The last call** is timed by each process from when it first saw the header that started
  it (the setter: from its own request), never from another machine's time: so no process
  ends it early, and a late observer only ends it later.
* **A run's vacancy** (its last node left: the run can be used again two heartbeat
  windows later, :func:`aelastic.core.machine.reuse_grace_ms`) is dated by the request that
  made it empty, in the header (``vacated``). When etcd dropped the last nodes (their leases
  expired), nobody saw when: the first request that finds the run empty dates it then (the
  machine dates it from the last node's expiry, which is earlier: etcd's run is reused no
  sooner). This is the one time written by one machine and read by others: clocks skewed
  by S move the reuse by S (the grace is two windows; NTP keeps S to milliseconds). A run
  that no node entered since a request made it (an expired join's, a close's) has no
  vacancy to date, as in the machine (the header's ``entered``).
* **Losses in the job's health**: the hosts of the members etcd dropped are counted lost
  by the request that accounts for them (:func:`reconcile`), from the history of the
  deletions (best effort: a compacted history loses names, never counts).
* **Trust** is the machine's: the rules the join that made the run stored in the header
  decide everything (a join with other ones is :attr:`~.Outcome.ERROR_RULES`), and a node's
  secret, stored in the value of its key, is compared in constant time with the request's
  before a join, keep-alive, leave, report or done acts for it
  (:attr:`~.Outcome.ERROR_FORBIDDEN`). A close is the run's (anyone's) act.
"""

from __future__ import annotations

import hmac

from ...core.health import JobHealth
from ...core.machine import reuse_grace_ms
from ...core.state import MAX_LOST_SAMPLE, Outcome, Request, Status
from ...core.token import make
from ._control import with_losses
from ._layout import Header, member_parts, member_value, profile_value
from ._plan import Plan, View

__all__ = ["Run", "needs_names", "reconcile", "status_of"]


class Run:
    """The run's logical state while a request is decided (the header plus the counts)."""

    def __init__(self, view: View, epoch: str, req: Request) -> None:
        h = view.header
        self.profile = (req.role, req.local_world_size)
        self.h = (
            h
            if h is not None
            else Header(epoch=epoch, rules=req.rules, entered=False, profile=self.profile)
        )
        self.fresh = h is None
        self.np, self.nw, self.nr, self.nq, self.nd, self.nl = (
            view.participants,
            view.waiting,
            view.redundant,
            view.finished,
            view.done,
            view.left,
        )
        self.where = view.where()
        self.first = view.first
        self.node = req.node
        self.secret = req.secret
        self.port = req.port
        self.rules = self.h.rules or req.rules
        self.plan = Plan(Outcome.FINISH)
        #: Whether this node said it was done (its ``pd/`` key).
        self.is_done = view.own.get("pd") is not None
        #: The job's health as this request leaves it (``None``: not read).
        self.health = None if view.health is None else view.health.health
        self.plan.health_mod = 0 if view.health is None else view.health.mod
        self.rank = view.rank
        own = view.own.get(self.where) if self.where is not None else None
        stored = None if own is None else member_parts(own.value)[1]
        #: The node is listed under the request's secret (compared in constant time).
        self.owns = stored is not None and hmac.compare_digest(stored, req.secret.encode())

    @property
    def listed(self) -> int:
        """How many nodes are in the run (the machine's heartbeats)."""
        return self.np + self.nw + self.nr

    def reopen_at(self) -> int | None:
        """The machine's ``reopen_at_ms``: when the empty run can be used again."""
        h = self.h
        if self.listed or h.vacated is None:
            return None
        return h.vacated + reuse_grace_ms(self.rules)

    @property
    def finished(self) -> int:
        """Members of the complete round gone after their workers succeeded."""
        return max(self.nq - self.nd, 0) if self.h.complete else 0

    @property
    def lost(self) -> int:
        h = self.h
        return max(h.world - self.np - self.finished, 0) if h.complete else 0

    @property
    def unaccounted(self) -> int:
        """Members of the complete round etcd dropped that the header has not accounted
        for: the lost less those that left (``l/``) less those accounted (``dropped``)."""
        return max(self.lost - self.nl - self.h.dropped, 0)

    @property
    def all_done(self) -> bool:
        h = self.h
        return h.complete and h.world > 0 and self.nq >= h.world

    def signature(self, deadline: tuple[int, int] | None) -> tuple[object, ...]:
        h = self.h
        lost, fin = self.lost > 0, self.finished > 0
        return (
            h.round, h.complete, h.closed, deadline and deadline[0], self.nw > 0, lost, fin,
            self.all_done,
        )  # fmt: skip

    def set_health(self, health: JobHealth) -> None:
        """The job's health becomes ``health`` (written with the request)."""
        self.health = self.plan.health = health

    # -- changes (the machine's, on this layout) ------------------------------------------

    def open_next_round(self) -> None:
        h = self.h
        self.h = h.evolve(
            round=h.round + 1,
            complete=False,
            deadline=None,
            world=0,
            sample=(),
            dropped=0,
            master=None,
        )
        if self.nq or self.nl:
            self.plan.clear_marks = True
        self.nq = self.nl = 0

    def _drop(self, where: str) -> None:
        plan = self.plan
        if where in plan.put:
            del plan.put[where]
        else:
            plan.delete.append(where)

    def drop_own(self, where: str) -> None:
        self._drop(where)
        if where == "p":
            self._drop("pm")
            self.np -= 1
        elif where == "w":
            self.nw -= 1
        else:
            self.nr -= 1
        self.where = None

    def _add(self, where: str, value: bytes) -> None:
        plan = self.plan
        if where in plan.delete:
            plan.delete.remove(where)
        plan.put[where] = value

    def add_own(self, where: str) -> None:
        """The machine's ``_enter`` of this node into list ``where``."""
        self._add(where, member_value(self.port if where == "p" else 0, self.secret))
        self.owns = True
        if not self.h.entered or self.h.vacated is not None:
            self.h = self.h.evolve(entered=True, vacated=None)
        if where == "p":
            if self.profile != self.h.profile:
                self._add("pm", profile_value(self.profile))
            self.np += 1
        elif where == "w":
            self.nw += 1
        else:
            self.nr += 1
        self.where = where

    def remove(self, now: int, finished: bool = False) -> None:
        """The machine's ``_remove`` of this node (gone at ``now``): a done member is
        finished (its ``q/`` key stays), another finished or lost."""
        where = self.where
        if where is None:
            return
        done = where == "p" and self.is_done
        self.drop_own(where)
        self.owns = False
        if not self.listed:
            self.h = self.h.evolve(vacated=now)
        if done:
            self._drop("pd")
            self.nd -= 1
            self.is_done = False
        if where != "p":
            return
        h = self.h
        if not h.complete:
            if self.np < self.rules.min_nodes:
                self.h = h.evolve(deadline=None)
        elif self.np == 0:
            self.open_next_round()
        elif done:
            pass  # finished: counted by its q/ key
        elif finished:
            self.plan.put["q"] = b""
            self.nq += 1
        else:  # lost: its mark (the header only while the sample has room)
            self.plan.put["l"] = b""
            self.nl += 1
            if len(h.sample) < MAX_LOST_SAMPLE:
                self.h = h.evolve(sample=(*h.sample, self.node.key))

    def complete(self) -> None:
        """The machine's ``_complete``: ranks are the sorted order of the ``p/`` keys."""
        first = self.first
        if "p" in self.plan.put and (first is None or self.node < first[0]):
            first = (self.node, self.port)
        master = None if first is None else (first[0].addr, first[1])
        self.h = self.h.evolve(
            complete=True, deadline=None, world=self.np, sample=(), dropped=0, master=master
        )
        self.plan.mark_cut = True
        self.plan.guard = True

    def reopen(self, req: Request) -> None:
        """The machine's ``_reopen``: the empty run becomes a new one (the next round, the
        joiner's rules and profile, no health)."""
        self.h = self.h.evolve(
            closed=False, rules=req.rules, vacated=None, entered=False, profile=self.profile
        )
        self.rules = req.rules
        self.open_next_round()
        self.health = JobHealth()
        self.plan.health = None
        self.plan.reset_health = True

    def fold_losses(self, names: list[str]) -> None:
        """The hosts of members etcd dropped (``names``) counted lost in this round."""
        if names and self.health is not None:
            changed = with_losses(self.health, names, self.h.round)
            if changed is not None:
                self.set_health(changed)


def reconcile(run: Run, view: View, lost_names: list[str], now: int) -> None:
    """What the machine's pruning would have done: effects of the nodes etcd removed.

    ``lost_names`` are the members of the complete round that etcd removed since the
    header's last write, in order (for the sample and the job's health: their hosts are
    counted lost; the count comes from the counts: :attr:`Run.unaccounted`).

    Joins race: a forming round may hold ``min_nodes`` participants without a last call, or
    ``max_nodes`` without being complete, when the joins that reached them ran at once. The
    request that sees it does what the join would have done (never in a serial run, where
    the join itself does it).
    """
    h, rules = run.h, run.rules
    if not run.listed and h.vacated is None and h.entered and not run.fresh:
        run.h = h = h.evolve(vacated=now)  # etcd dropped its last nodes: dated now
    if h.complete and run.np == 0:
        run.fold_losses(lost_names[: run.unaccounted])
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
    unaccounted = run.unaccounted
    if unaccounted:
        names = lost_names[:unaccounted]
        sample = list(h.sample)
        for name in names:
            if len(sample) < MAX_LOST_SAMPLE:
                sample.append(name)
        run.h = h.evolve(sample=tuple(sample), dropped=h.dropped + unaccounted)
        run.fold_losses(names)


def needs_names(view: View) -> int:
    """How many lost members' names a request on ``view`` needs (0: none): those etcd
    removed from the complete round since the header accounted for its drops (for the
    sample and the job's health; :attr:`Run.unaccounted`)."""
    h = view.header
    if h is None or not h.complete:
        return 0
    lost = h.world - view.participants - max(view.finished - view.done, 0)
    return max(lost - view.left - h.dropped, 0)


def status_of(
    h: Header, participants: int, waiting: int, redundant: int, marked: int, done: int,
    now: int, deadline_ms: int | None,
) -> Status:  # fmt: skip
    """The status of a run whose header is ``h`` and whose lists hold these counts
    (``marked``: the ``q/`` keys, members done or finished; ``done``: the ``pd/`` keys)."""
    finished = max(marked - done, 0)
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
        done=done if h.complete else 0,
    )
