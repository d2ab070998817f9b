"""The rendezvous state machine, pure: no I/O, no clock reads, no ``await``.

How it works: ``step(state, request, now_ms)`` applies one node's request to a run's state
(in place) and returns the :class:`~.state.Reply`. Every in-process backend (memory, the
HTTP server) calls it under its own serialization; the Redis backend runs a Lua port of it
(``backends/redis/_lua``), held to the same answers by property tests that run both on the
same random interleavings. Its semantics are torch's ``DynamicRendezvousHandler``'s:

* JOIN: a node joins the participants of an open round. At ``min_nodes`` the last call
  starts (``last_call_timeout``); at ``max_nodes`` the round completes at once. A completed
  round admits latecomers to the wait list (the next round) or, at ``max_nodes``, to the
  redundancy list. Ranks are fixed at completion in torch's order, the sorted node
  descriptors (address, then pid, then local id), so every member agrees; the reply carries
  this node's rank and where rank 0's workers bootstrap. A participant asks
  again when the last call ends, and the first to ask then completes the round.
* LEAVE: the node removes itself; when the last participant of a complete round is gone
  the next round opens. A member that leaves a complete round is counted as finished (its
  workers succeeded: the others need not act) or lost.
* CLOSE: the run is closed; later joins fail with ``RendezvousClosedError`` (and end the
  joining node's part in it). Closing is a run-level act (torch's ``set_closed``): any
  requester closes it, a member or not, and a close of a run no join made makes it,
  closed. Once its last node has gone, a closed run stays closed for
  :func:`reuse_grace_ms` (two heartbeat windows), so that a late node of its job still
  learns that it closed; then the next join makes it a new run (the next round, the
  joiner's rules, no history): a job id can be used again. A run that is not closed but
  empty (it never formed, or its nodes all left or went silent) is free the same way.
* KEEP_ALIVE: the node's heartbeat. STATUS: nothing but the pruning.
* REPORT: a member reports its own workers' failure in its complete round (or sets its own
  host aside); the machine fills in who, where and the round and folds it into the job's
  health (:mod:`.health`), which also counts the hosts of members dropped for their silence.
  DONE: a member says its workers succeeded; the status counts it (``done``) and the exit
  barrier is passed once every member is done or left finished.
* DEPART: a backend's report (never a node's request) that a node's connection ended at
  ``since_ms``, a fact it can tell before the heartbeat window ends (the HTTP server sees
  the node's channel end without a goodbye; on Redis a survivor sees the node's named
  connection gone). A connection also ends on a network fault while the node lives, so
  the report only shortens the node's window: answered *wait* until
  :func:`departure_grace_ms` after ``since_ms``, then the node is lost if nothing was
  heard from it since (a live node's client reconnects and beats at once). A *confirmed*
  departure (a member said its collective broke since: the loss is seen from two sides,
  the store's and the workers') has no grace.

One set of rules per run: the join that makes a run fixes its rules (node bounds, last
call, heartbeat window), and every later decision uses them, whoever asks; a join whose
rules differ is refused (:attr:`~.state.Outcome.ERROR_RULES`, the reply names the run's).
A node acts only for itself: its first join stores the secret it sent, and a join,
keep-alive, leave, report or done for a listed node with another secret changes nothing
(:attr:`~.state.Outcome.ERROR_FORBIDDEN`). The job's control state (the workers' ranks,
fixed at completion from the members' joins; the exit barrier; the job's health) is made
here from such requests only, never read from anything a store client writes. A state that
no join or close made (a status, a leave, a report of an unknown run; the operator's close
of one) is answered and not stored.

Every request first prunes the nodes silent for the run's heartbeat window. Cost: O(1) per
request (plus O(pruned)), O(N) once per round at completion. The status's token changes
only when a field that watchers act on changes (see :meth:`~.state.Status.signature`).
The time rules (when a beat is due, when a node expires, the graces) live in :mod:`._times`
and are exported here.
"""

from __future__ import annotations

import hmac

from ._times import beat_due_ms, confirmable, departure_grace_ms, expiry_ms, reuse_grace_ms
from .health import JobHealth, reported, with_lost, with_quarantined
from .params import Rules
from .state import (
    MAX_LOST_SAMPLE,
    NodeDesc,
    Op,
    Outcome,
    Placement,
    Reply,
    Request,
    RunState,
    Transition,
    snapshot_of,
    status_of,
)

__all__ = [
    "LONG_AGO_MS",
    "beat_due_ms",
    "confirmable",
    "departure_grace_ms",
    "expiry_ms",
    "health_of",
    "prune",
    "reopen_at_ms",
    "reuse_grace_ms",
    "snapshot_of",
    "status_of",
    "step",
]


#: A vacancy so old that its grace is over whatever the clock says: a backend that knows no
#: node of the run's job can still come (the memory backend, once the last handler of the
#: process let go) dates the vacancy of an empty run so, and its id is free at once.
LONG_AGO_MS = -(1 << 53)


# -- when the token moves -------------------------------------------------------------------


def _all_done(state: RunState) -> bool:
    return state.complete and state.world > 0 and len(state.done) + state.finished >= state.world


def _signature(state: RunState) -> tuple[object, ...]:
    return (
        state.round,
        state.complete,
        state.closed,
        state.deadline_ms,
        bool(state.wait_list),
        state.lost > 0,
        state.finished > 0,
        _all_done(state),
    )


# -- changes --------------------------------------------------------------------------------


def _beat(state: RunState, node: NodeDesc, now_ms: int) -> None:
    beats = state.beats
    beats.pop(node, None)
    beats[node] = now_ms  # last in order: the newest beat


def _open_next_round(state: RunState) -> None:
    state.round += 1
    state.complete = False
    state.deadline_ms = None
    state.world = state.lost = state.finished = 0
    state.lost_sample = []
    state.master = None
    state.profiles.clear()
    state.placements.clear()
    state.done.clear()
    state.failed.clear()


def _owns(state: RunState, node: NodeDesc, secret: str) -> bool:
    """Whether ``node`` is listed under ``secret`` (compared in constant time)."""
    stored = state.secrets.get(node)
    return stored is not None and hmac.compare_digest(stored.encode(), secret.encode())


def _remove(
    state: RunState, node: NodeDesc, at_ms: int, finished: bool = False, silent: bool = False
) -> None:
    """Remove ``node`` (gone at ``at_ms``: a run empty since then may be reused). A member of
    a complete round that said it was done, or leaves ``finished``, counts as finished; else
    it is lost, and its host counted lost when it went ``silent`` (dropped, not a leave)."""
    assert state.rules is not None
    state.beats.pop(node, None)
    state.secrets.pop(node, None)
    if not state.beats:
        state.vacated_ms = at_ms
    if node not in state.participants:
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        return
    del state.participants[node]
    state.ports.pop(node, None)
    state.profiles.pop(node, None)
    if not state.complete:
        if len(state.participants) < state.rules.min_nodes:
            state.deadline_ms = None
        return
    done = node in state.done
    state.done.discard(node)
    if finished or done:
        state.finished += 1
    else:
        state.lost += 1
        if len(state.lost_sample) < MAX_LOST_SAMPLE:
            state.lost_sample.append(node.key)
        if silent:
            state.health = with_lost(state.health, node.addr, state.round, None) or state.health
    if not state.participants:
        _open_next_round(state)


def prune(state: RunState, now_ms: int) -> int:
    """Remove the nodes whose last heartbeat is older than the run's window; how many."""
    if state.rules is None:
        return 0
    expired = now_ms - state.rules.window_ms
    dead: list[tuple[int, str, NodeDesc]] = []
    for node, beat in state.beats.items():
        if beat >= expired:
            break  # ordered by beat: the rest are younger
        dead.append((beat, node.key, node))
    dead.sort()  # by time, then name: the order of a sorted set (Redis)
    for beat, _, node in dead:
        _remove(state, node, expiry_ms(beat, state.rules.window_ms), silent=True)
    return len(dead)


def _complete(state: RunState) -> None:
    # Ranks in torch's order: the sorted node descriptors (address, then pid, then local
    # id), so hosts get a stable, name-ordered rank layout whatever the join order.
    order = sorted(state.participants)
    state.participants = {node: rank for rank, node in enumerate(order)}
    first = order[0]
    state.master = (first.addr, state.ports.get(first, 0))
    state.ports.clear()
    state.complete = True
    state.deadline_ms = None
    state.world = len(order)
    state.lost = state.finished = 0
    state.lost_sample = []
    state.placements = _placements(order, state.profiles)
    state.done.clear()
    state.failed.clear()


def _placements(
    order: list[NodeDesc], profiles: dict[NodeDesc, tuple[str, int]]
) -> dict[NodeDesc, Placement]:
    """Where each member's workers stand (torch's rank assignment), members in rank order."""
    sizes: dict[str, int] = {}
    for node in order:
        role, size = profiles.get(node, ("default", 1))
        sizes[role] = sizes.get(role, 0) + size
    world = sum(sizes.values())
    base, role_bases = 0, dict.fromkeys(sizes, 0)
    placements = {}
    for node in order:
        role, size = profiles.get(node, ("default", 1))
        placements[node] = Placement(base, world, role_bases[role], sizes[role])
        base += size
        role_bases[role] += size
    return placements


# -- the operations -------------------------------------------------------------------------


class _Answer:
    """What an operation decided (the reply is made from it and the final state)."""

    __slots__ = ("outcome", "restart", "transition", "wake_at_ms")

    def __init__(
        self,
        outcome: Outcome,
        transition: Transition = Transition.NONE,
        wake_at_ms: int | None = None,
        restart: bool = False,
    ) -> None:
        self.outcome = outcome
        self.transition = transition
        self.wake_at_ms = wake_at_ms
        self.restart = restart


_FORBIDDEN = _Answer(Outcome.ERROR_FORBIDDEN)


def _enter(state: RunState, req: Request, now_ms: int) -> None:
    """A node not yet listed is listed: its heartbeat and its secret."""
    if req.node not in state.secrets:
        state.secrets[req.node] = req.secret
    state.vacated_ms = None
    _beat(state, req.node, now_ms)


def reopen_at_ms(state: RunState) -> int | None:
    """When the run ``state``, empty, can be made a new one by a join of other rules or
    after it closed (``None``: nodes are still in it)."""
    if state.beats or state.vacated_ms is None or state.rules is None:
        return None
    return state.vacated_ms + reuse_grace_ms(state.rules)


def _reopen(state: RunState, rules: Rules) -> None:
    """The empty run becomes a new one: the next round, the joiner's rules, no history."""
    state.closed = False
    state.rules = rules
    state.vacated_ms = None
    state.health = JobHealth()
    _open_next_round(state)


def _join_closed(state: RunState, node: NodeDesc, now_ms: int) -> _Answer:
    """A join to a closed run ends this node's join (it is removed)."""
    redundant = node in state.redundancy_list
    transition = Transition.NONE
    if state.knows(node):
        _remove(state, node, now_ms)
        transition = Transition.REMOVE
    return _Answer(Outcome.GRACEFUL_EXIT if redundant else Outcome.ERROR_CLOSED, transition)


def _join(state: RunState, req: Request, now_ms: int) -> _Answer:
    node = req.node
    if state.knows(node) and not _owns(state, node, req.secret):
        return _FORBIDDEN
    reopen = reopen_at_ms(state)
    if reopen is not None and reopen <= now_ms:
        _reopen(state, req.rules)  # empty for its grace: a new job may take the id
    elif state.closed:
        return _join_closed(state, node, now_ms)
    if state.rules is None:
        state.rules = req.rules  # this join makes the run: its rules are the run's
    elif req.rules != state.rules:
        return _Answer(Outcome.ERROR_RULES)
    rules = state.rules
    expired, restart, transition = req.expired, False, Transition.NONE
    if node in state.redundancy_list:
        if len(state.participants) >= rules.max_nodes:
            # A redundant node waits, without a deadline, until a slot opens.
            _beat(state, node, now_ms)
            return _Answer(Outcome.WAIT, Transition.KEEP_ALIVE)
        _remove(state, node, now_ms)
        expired, restart = False, True
        transition = Transition.REMOVE_FROM_REDUNDANCY_LIST
    if state.complete and node in state.participants:
        _beat(state, node, now_ms)
        return _Answer(Outcome.FINISH, transition, restart=restart)
    if expired:
        if state.knows(node):
            _remove(state, node, now_ms)
            transition = Transition.REMOVE
        return _Answer(Outcome.ERROR_TIMEOUT, transition)
    if state.complete:
        if node not in state.wait_list:
            # Room left: wait for the next round; none: stand by as redundant.
            if len(state.participants) < rules.max_nodes:
                state.wait_list.add(node)
                transition = Transition.ADD_TO_WAIT_LIST
            else:
                state.redundancy_list.add(node)
                transition = Transition.ADD_TO_REDUNDANCY_LIST
        _enter(state, req, now_ms)
        return _Answer(Outcome.WAIT, transition, restart=restart)
    if node in state.participants:
        count = len(state.participants)
        deadline = state.deadline_ms
        ready = rules.min_nodes <= count <= rules.max_nodes
        if ready and deadline is not None and deadline <= now_ms:
            _complete(state)
            _beat(state, node, now_ms)
            return _Answer(Outcome.FINISH, Transition.MARK_COMPLETE, restart=restart)
        _beat(state, node, now_ms)
        return _Answer(Outcome.WAIT, Transition.KEEP_ALIVE, deadline, restart)
    state.wait_list.discard(node)
    state.seq += 1
    state.participants[node] = state.seq
    state.ports[node] = req.port
    state.profiles[node] = (req.role, req.local_world_size)
    _enter(state, req, now_ms)
    count = len(state.participants)
    if count == rules.min_nodes:
        state.deadline_ms = now_ms + rules.last_call_ms
    if count == rules.max_nodes:
        _complete(state)
        return _Answer(Outcome.FINISH, Transition.MARK_COMPLETE, restart=restart)
    return _Answer(Outcome.WAIT, Transition.ADD_TO_PARTICIPANTS, state.deadline_ms, restart)


def _close(state: RunState, req: Request, now_ms: int) -> _Answer:
    """Close the run: a run-level act that any handler of it may do (torch's ``set_closed``),
    a member or not; a close of a run no join made makes it, closed (a handler that never
    joined closes the run for everyone), but the operator's close of an unknown run."""
    if state.closed:
        return _Answer(Outcome.FINISH)  # closed already: the same answer
    if not state.made:
        if req.operator:
            return _Answer(Outcome.FINISH)  # nothing to close, nothing stored
        state.rules = req.rules
    state.closed = True
    if not state.beats:
        state.vacated_ms = now_ms
    return _Answer(Outcome.FINISH, Transition.MARK_CLOSED)


def _report(state: RunState, req: Request, now_ms: int) -> _Answer:
    """A member's report of itself: its workers' failure in its complete round (folded into
    the job's health, who and where filled in here), or its own host set aside."""
    node, report = req.node, req.report
    if report is None:
        return _Answer(Outcome.FINISH)
    _beat(state, node, now_ms)
    if report.quarantine is not None:
        changed = with_quarantined(state.health, node.addr, report.quarantine)
        if changed is None:
            return _Answer(Outcome.FINISH)
        state.health = changed
        return _Answer(Outcome.FINISH, Transition.REPORT)
    assert report.failure is not None
    rank = state.participants.get(node)
    if not state.complete or rank is None:
        return _Answer(Outcome.FINISH)  # in no complete round: nothing to report of
    state.failed.add(node)
    record = report.failure.record(node.addr, node.key, rank, state.round)
    state.health = reported(state.health, record, len(state.failed))
    return _Answer(Outcome.FINISH, Transition.REPORT)


def _done(state: RunState, node: NodeDesc, now_ms: int) -> _Answer:
    """A member says its workers succeeded in its complete round (the exit barrier)."""
    _beat(state, node, now_ms)
    if not state.complete or node not in state.participants or node in state.done:
        return _Answer(Outcome.FINISH)
    state.done.add(node)
    return _Answer(Outcome.FINISH, Transition.MARK_DONE)


def _depart(state: RunState, req: Request, now_ms: int) -> _Answer:
    """A backend's report that the node's connection ended at ``req.since_ms``."""
    assert state.rules is not None
    if req.since_ms is None:
        return _Answer(Outcome.FINISH)  # no moment: nothing to decide
    due = req.since_ms + (0 if req.confirmed else departure_grace_ms(state.rules))
    if now_ms < due:
        return _Answer(Outcome.WAIT, wake_at_ms=due)  # ask again then
    if state.beats[req.node] > req.since_ms:
        return _Answer(Outcome.FINISH)  # heard from since: it is alive
    _remove(state, req.node, now_ms, silent=True)
    return _Answer(Outcome.FINISH, Transition.REMOVE)


def _apply(state: RunState, req: Request, now_ms: int) -> _Answer:
    node, op = req.node, req.op
    if op is Op.JOIN:
        return _join(state, req, now_ms)
    if op is Op.CLOSE:
        return _close(state, req, now_ms)
    if op is Op.STATUS or not state.knows(node):
        return _Answer(Outcome.FINISH)
    if op is Op.DEPART and req.operator:
        return _depart(state, req, now_ms)
    if not _owns(state, node, req.secret):
        return _FORBIDDEN  # a leave, a heartbeat, a report or a departure for another node
    if op is Op.DEPART:
        return _depart(state, req, now_ms)
    if op is Op.LEAVE:
        _remove(state, node, now_ms, req.finished)
        return _Answer(Outcome.FINISH, Transition.REMOVE)
    if op is Op.REPORT:
        return _report(state, req, now_ms)
    if op is Op.DONE:
        return _done(state, node, now_ms)
    _beat(state, node, now_ms)
    return _Answer(Outcome.FINISH, Transition.KEEP_ALIVE)


def step(state: RunState, request: Request, now_ms: int) -> Reply:
    """Apply ``request`` to ``state`` (in place) at the backend's time ``now_ms``.

    Args:
        state: The run's state; changed in place. A state that is not
            :attr:`~.state.RunState.made` afterwards is not to be stored.
        request: What a node asks.
        now_ms: The backend's time in whole milliseconds.

    Returns:
        The reply: outcome, status, and for a finished join the node's rank and the
        bootstrap address; for a join refused for its rules, the run's rules.
    """
    before = _signature(state)
    pruned = prune(state, now_ms)
    answer = _apply(state, request, now_ms)
    if _signature(state) != before:
        state.generation += 1
    transition = answer.transition
    if transition is Transition.NONE and pruned:
        transition = Transition.PRUNE
    node = request.node
    finished_join = request.op is Op.JOIN and answer.outcome is Outcome.FINISH
    master = state.master if finished_join else None
    oldest = next(iter(state.beats.values()), None) if request.op is Op.KEEP_ALIVE else None
    refused_rules = answer.outcome is Outcome.ERROR_RULES
    closed = answer.outcome in (Outcome.ERROR_CLOSED, Outcome.ERROR_RULES)
    return Reply(
        outcome=answer.outcome,
        status=status_of(state, now_ms),
        transition=transition,
        rank=state.participants[node] if finished_join else None,
        master_addr=None if master is None else master[0],
        master_port=None if master is None else master[1],
        wake_at_ms=answer.wake_at_ms,
        restart_deadline=answer.restart,
        known=_owns(state, node, request.secret),
        oldest_beat_ms=oldest,
        pruned=pruned,
        run_rules=state.rules if refused_rules or closed else None,
        reopen_at_ms=reopen_at_ms(state) if closed else None,
        placement=state.placements.get(node) if finished_join else None,
    )


def health_of(state: RunState) -> JobHealth:
    """The job's health as the run keeps it."""
    return state.health
