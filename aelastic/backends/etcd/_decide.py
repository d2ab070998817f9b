"""The requests of the machine's port onto etcd: what a join, close, leave, keep-alive, report,
done or status decides, pure (the rest of the port, and why it is the machine's rule:
:mod:`._port`).

How it works: :func:`decide` takes one read of the run (a :class:`~._port.View`), does what
the machine's pruning would have done (:func:`~._port.reconcile`), then the request, each
operation written line for line after :mod:`aelastic.core.machine`'s, and returns the
:class:`~._port.Plan`: the reply's parts, the writes, the status after them.
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.health import JobHealth, with_quarantined
from ...core.state import Op, Outcome, Request, Status, Transition
from ...core.token import NO_STATE
from ._control import report_failure
from ._plan import DeadlineClock, Plan, View
from ._port import Run, reconcile, status_of

__all__ = ["decide"]


def _join(run: Run, req: Request, now: int, deadline_of: Callable[[], int | None]) -> None:
    plan = run.plan
    if run.where is not None and not run.owns:
        plan.outcome = Outcome.ERROR_FORBIDDEN
        return
    reopen = run.reopen_at()
    if reopen is not None and reopen <= now:
        run.reopen(req)  # empty for its grace: a new job may take the id
    elif run.h.closed:
        _join_closed(run, now)
        return
    if req.rules != run.rules:
        plan.outcome, plan.run_rules = Outcome.ERROR_RULES, run.rules
        plan.reopen_at_ms = run.reopen_at()
        return
    rules, h = run.rules, run.h
    expired, restart, transition = req.expired, False, Transition.NONE
    if run.where == "r":
        if run.np >= rules.max_nodes:
            plan.outcome, plan.transition, plan.beat = Outcome.WAIT, Transition.KEEP_ALIVE, True
            return
        run.remove(now)
        expired, restart = False, True
        transition = Transition.REMOVE_FROM_REDUNDANCY_LIST
    plan.restart = restart
    if h.complete and run.where == "p":
        plan.outcome, plan.transition, plan.beat, plan.rank = Outcome.FINISH, transition, True, True
        return
    if expired:
        if run.where is not None:
            run.remove(now)
            transition = Transition.REMOVE
        plan.outcome, plan.transition = Outcome.ERROR_TIMEOUT, transition
        return
    if h.complete:
        if run.where != "w":
            if run.np < rules.max_nodes:
                run.add_own("w")
                transition = Transition.ADD_TO_WAIT_LIST
            else:
                run.add_own("r")
                transition = Transition.ADD_TO_REDUNDANCY_LIST
        plan.outcome, plan.transition, plan.beat = Outcome.WAIT, transition, True
        return
    if run.where == "p":
        deadline = deadline_of()
        ready = rules.min_nodes <= run.np <= rules.max_nodes
        plan.beat = True
        if ready and deadline is not None and deadline <= now:
            run.complete()
            plan.outcome, plan.transition = Outcome.FINISH, Transition.MARK_COMPLETE
            plan.rank = True
            return
        plan.outcome, plan.transition = Outcome.WAIT, Transition.KEEP_ALIVE
        plan.wake_at_ms = deadline
        return
    if run.where == "w":
        run.drop_own("w")
    run.add_own("p")
    plan.beat = True
    if run.np == rules.min_nodes:
        run.h = run.h.evolve(deadline=(-1, now + rules.last_call_ms))  # id set below
        plan.guard = True
    if run.np == rules.max_nodes:
        run.complete()
        plan.outcome, plan.transition = Outcome.FINISH, Transition.MARK_COMPLETE
        plan.rank = True
        return
    plan.outcome, plan.transition = Outcome.WAIT, Transition.ADD_TO_PARTICIPANTS
    plan.wake_at_ms = deadline_of()


def _join_closed(run: Run, now: int) -> None:
    """A join to a closed run ends this node's part in it (it is removed)."""
    plan = run.plan
    plan.outcome = Outcome.GRACEFUL_EXIT if run.where == "r" else Outcome.ERROR_CLOSED
    if run.where is not None:
        run.remove(now)
        plan.transition = Transition.REMOVE
    if plan.outcome is Outcome.ERROR_CLOSED:
        plan.reopen_at_ms = run.reopen_at()
        plan.run_rules = run.rules  # (with the reopening: when the run emptied)


def _close(run: Run, req: Request, now: int) -> None:
    """A run-level act: anyone closes the run; a close of a run no join made makes it,
    closed (but the operator's: nothing stored)."""
    plan = run.plan
    if run.h.closed or (run.fresh and req.operator):
        return  # closed already, or nothing to close
    h = run.h
    run.h = h.evolve(closed=True, vacated=h.vacated if run.listed else now)
    plan.transition = Transition.MARK_CLOSED


def _report(run: Run, req: Request) -> None:
    """The machine's ``_report``: the node's own failure in its complete round (its mark,
    and the health when its root cause is better), or its own host set aside."""
    plan, report = run.plan, req.report
    if report is None:
        return
    plan.beat = True
    health = run.health if run.health is not None else JobHealth()
    if report.quarantine is not None:
        changed = with_quarantined(health, req.node.addr, report.quarantine)
        if changed is not None:
            run.set_health(changed)
            plan.transition = Transition.REPORT
        return
    assert report.failure is not None
    h = run.h
    if not h.complete or run.where != "p" or run.rank is None:
        return  # in no complete round: nothing to report of
    record = report.failure.record(req.node.addr, req.node.key, run.rank, h.round)
    stored, drop = report_failure(health, record)
    if stored is not None:
        run.set_health(stored)
        plan.drop_failed = drop
    plan.fail_mark = h.round
    plan.transition = Transition.REPORT


def _done(run: Run) -> None:
    """The machine's ``_done``: a member of the complete round says its workers succeeded."""
    plan = run.plan
    plan.beat = True
    if not run.h.complete or run.where != "p" or run.is_done:
        return
    plan.put["pd"] = plan.put["q"] = b""
    run.nd += 1
    run.nq += 1
    run.is_done = True
    plan.transition = Transition.MARK_DONE


def _other(run: Run, req: Request, now: int) -> None:
    """A leave, a keep-alive, a report, a done or a status (or a departure: etcd learns of
    none, see :mod:`._backend`; one is answered as a status)."""
    plan = run.plan
    if req.op is Op.STATUS or req.op is Op.DEPART or run.where is None:
        return
    if not run.owns:
        plan.outcome = Outcome.ERROR_FORBIDDEN  # a request for another node
    elif req.op is Op.LEAVE:
        run.remove(now, req.finished)
        plan.transition = Transition.REMOVE
    elif req.op is Op.REPORT:
        _report(run, req)
    elif req.op is Op.DONE:
        _done(run)
    else:
        plan.beat, plan.transition = True, Transition.KEEP_ALIVE


def decide(
    view: View,
    req: Request,
    now: int,
    epoch: str,
    deadline_clock: DeadlineClock,
    lost_names: list[str] | None = None,
) -> Plan:
    """What ``req`` does to the run that ``view`` shows, at this process's time ``now``.

    Args:
        view: One read of the run.
        req: The node's request.
        now: This process's time (ms): the last call is timed on it.
        epoch: The epoch of a state this request creates.
        deadline_clock: This process's lookup of the last call's end.
        lost_names: Members of the complete round etcd removed since the header's last
            write, in order (see :func:`needs_names`).

    Returns:
        The plan: reply parts, the writes, and the status after them.
    """
    run = Run(view, epoch, req)
    before_h = run.h
    before = (
        before_h.round, before_h.complete, before_h.closed,
        before_h.deadline and before_h.deadline[0], *before_h.flags,
    )  # fmt: skip
    reconcile(run, view, lost_names or [], now)
    if run.plan.need_extras:
        return run.plan

    def deadline_of() -> int | None:
        d = run.h.deadline
        if d is None:
            return None
        if d[0] < 0:
            return d[1]
        return deadline_clock(run.h.epoch, d[0], run.rules.last_call_ms, now)

    plan = run.plan
    if req.op is Op.JOIN:
        _join(run, req, now, deadline_of)
    elif req.op is Op.CLOSE:
        _close(run, req, now)
    else:
        _other(run, req, now)
    h = run.h
    plan.rules = run.rules
    plan.known = run.where is not None and run.owns
    plan.where = run.where
    if run.fresh and req.op is not Op.JOIN and plan.transition is not Transition.MARK_CLOSED:
        # A state that no join or close made is answered and not stored.
        plan.made = False
        plan.status = Status(token=NO_STATE, now_ms=now)
        return plan
    after = run.signature(h.deadline)
    gen = h.gen + 1 if after != before else h.gen
    if h.deadline is not None and h.deadline[0] < 0:
        h = h.evolve(deadline=(gen, h.deadline[1]))
    done = run.nd if h.complete else 0
    h = h.evolve(
        gen=gen,
        rules=run.rules,
        counts=(run.np, run.nw, run.nr, run.lost, run.finished, done),
        flags=(run.nw > 0, run.lost > 0, run.finished > 0, run.all_done),
    )
    # The counts are recorded when the header is written for a transition, never a reason
    # to write it: a join to a forming round must not rewrite a shared value.
    changed = run.fresh or h.evolve(counts=before_h.counts) != before_h
    plan.header = h if changed else None
    # A member leaving its complete round, the header left as it is: what it writes (its
    # own keys, its l/ or q/ mark) holds whatever else changed in the header meanwhile, as
    # long as its own keys did not (the round cannot have moved on while its p/ key is
    # there: the next round opens once the last one is gone).
    plan.own_only = (
        req.op is Op.LEAVE and plan.header is None and before_h.complete
        and view.where() == "p" and plan.health is None and not plan.clear_marks
    )  # fmt: skip
    plan.master = h.master
    plan.world, plan.profile = h.world, h.profile
    plan.status = status_of(h, run.np, run.nw, run.nr, run.nq, run.nd, now, deadline_of())
    run.h = h
    return plan
