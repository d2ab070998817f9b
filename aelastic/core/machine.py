"""The rendezvous state machine, pure: no I/O, no clock reads, no ``await``.

How it works: ``step(state, request, now_ms)`` applies one node's request to a run's state
(in place) and returns the :class:`~.state.Reply`. Every in-process backend (memory, the
HTTP server) calls it under its own serialization; the Redis backend runs a Lua port of it
(``backends/redis/_lua``), held to the same answers by property tests that run both on the
same random interleavings. Its semantics are torch's ``DynamicRendezvousHandler``'s:

* JOIN: a node joins the participants of an open round. At ``min_nodes`` the last call
  starts (``last_call_timeout``); at ``max_nodes`` the round completes at once. A completed
  round admits latecomers to the wait list (the next round) or, at ``max_nodes``, to the
  redundancy list. Ranks are fixed at completion, in join order, so every member agrees; the
  reply carries this node's rank and where rank 0's workers bootstrap. A participant asks
  again when the last call ends, and the first to ask then completes the round.
* LEAVE: the node removes itself; when the last participant of a complete round is gone
  the next round opens. A member that leaves a complete round is counted as finished (its
  workers succeeded: the others need not act) or lost.
* CLOSE: the run is closed; later joins fail with ``RendezvousClosedError``.
* KEEP_ALIVE: the node's heartbeat. STATUS: nothing but the pruning.

Every request first prunes the nodes silent for the heartbeat window. Cost: O(1) per
request (plus O(pruned)), O(N) once per round at completion. The status's token changes
only when a field that watchers act on changes (see :meth:`~.state.Status.signature`).
"""

from __future__ import annotations

from .state import (
    MAX_LOST_SAMPLE,
    MemberEntry,
    NodeDesc,
    Op,
    Outcome,
    Reply,
    Request,
    RunState,
    Snapshot,
    Status,
    Transition,
)
from .token import make

__all__ = ["beat_due_ms", "expiry_ms", "prune", "snapshot_of", "status_of", "step"]


# -- the heartbeat rule ---------------------------------------------------------------------


def beat_due_ms(last_beat_ms: int, interval_ms: int) -> int:
    """When a node whose last recorded heartbeat is ``last_beat_ms`` beats next."""
    return last_beat_ms + interval_ms


def expiry_ms(last_beat_ms: int, window_ms: int) -> int:
    """When a node whose last heartbeat is ``last_beat_ms`` is dead (and pruned)."""
    return last_beat_ms + window_ms


# -- reading --------------------------------------------------------------------------------


def status_of(state: RunState, now_ms: int) -> Status:
    """The status header of ``state`` at ``now_ms``."""
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
    )


def snapshot_of(state: RunState, now_ms: int) -> Snapshot:
    """The whole membership of ``state`` at ``now_ms``."""
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
    )


def _signature(state: RunState) -> tuple[object, ...]:
    return (
        state.round,
        state.complete,
        state.closed,
        state.deadline_ms,
        bool(state.wait_list),
        state.lost > 0,
        state.finished > 0,
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


def _remove(state: RunState, node: NodeDesc, rules_min: int, finished: bool = False) -> None:
    state.beats.pop(node, None)
    if node not in state.participants:
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        return
    del state.participants[node]
    state.ports.pop(node, None)
    if not state.complete:
        if len(state.participants) < rules_min:
            state.deadline_ms = None
    elif not state.participants:
        _open_next_round(state)
    elif finished:
        state.finished += 1
    else:
        state.lost += 1
        if len(state.lost_sample) < MAX_LOST_SAMPLE:
            state.lost_sample.append(node.key)


def prune(state: RunState, window_ms: int, now_ms: int, rules_min: int) -> int:
    """Remove the nodes whose last heartbeat is older than the window; how many."""
    expired = now_ms - window_ms
    dead: list[tuple[int, str, NodeDesc]] = []
    for node, beat in state.beats.items():
        if beat >= expired:
            break  # ordered by beat: the rest are younger
        dead.append((beat, node.key, node))
    dead.sort()  # by time, then name: the order of a sorted set (Redis)
    for _, _, node in dead:
        _remove(state, node, rules_min)
    return len(dead)


def _complete(state: RunState) -> None:
    order = sorted(state.participants, key=state.participants.__getitem__)
    state.participants = {node: rank for rank, node in enumerate(order)}
    first = order[0]
    state.master = (first.addr, state.ports.get(first, 0))
    state.ports.clear()
    state.complete = True
    state.deadline_ms = None
    state.world = len(order)
    state.lost = state.finished = 0
    state.lost_sample = []


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


def _join(state: RunState, req: Request, now_ms: int) -> _Answer:
    node, rules = req.node, req.rules
    if state.closed:
        if node in state.redundancy_list:
            return _Answer(Outcome.GRACEFUL_EXIT)
        return _Answer(Outcome.ERROR_CLOSED)
    expired, restart, transition = req.expired, False, Transition.NONE
    if node in state.redundancy_list:
        if len(state.participants) >= rules.max_nodes:
            # A redundant node waits, without a deadline, until a slot opens.
            _beat(state, node, now_ms)
            return _Answer(Outcome.WAIT, Transition.KEEP_ALIVE)
        _remove(state, node, rules.min_nodes)
        expired, restart = False, True
        transition = Transition.REMOVE_FROM_REDUNDANCY_LIST
    if state.complete and node in state.participants:
        _beat(state, node, now_ms)
        return _Answer(Outcome.FINISH, transition, restart=restart)
    if expired:
        if state.knows(node):
            _remove(state, node, rules.min_nodes)
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
        _beat(state, node, now_ms)
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
    _beat(state, node, now_ms)
    count = len(state.participants)
    if count == rules.min_nodes:
        state.deadline_ms = now_ms + rules.last_call_ms
    if count == rules.max_nodes:
        _complete(state)
        return _Answer(Outcome.FINISH, Transition.MARK_COMPLETE, restart=restart)
    return _Answer(Outcome.WAIT, Transition.ADD_TO_PARTICIPANTS, state.deadline_ms, restart)


def _apply(state: RunState, req: Request, now_ms: int) -> _Answer:
    node = req.node
    if req.op is Op.JOIN:
        return _join(state, req, now_ms)
    if req.op is Op.LEAVE:
        if not state.knows(node):
            return _Answer(Outcome.FINISH)
        _remove(state, node, req.rules.min_nodes, req.finished)
        return _Answer(Outcome.FINISH, Transition.REMOVE)
    if req.op is Op.CLOSE:
        if state.closed:
            return _Answer(Outcome.FINISH)
        state.closed = True
        return _Answer(Outcome.FINISH, Transition.MARK_CLOSED)
    if req.op is Op.KEEP_ALIVE and state.knows(node):
        _beat(state, node, now_ms)
        return _Answer(Outcome.FINISH, Transition.KEEP_ALIVE)
    return _Answer(Outcome.FINISH)


def step(state: RunState, request: Request, now_ms: int) -> Reply:
    """Apply ``request`` to ``state`` (in place) at the backend's time ``now_ms``.

    Args:
        state: The run's state; changed in place.
        request: What a node asks.
        now_ms: The backend's time in whole milliseconds.

    Returns:
        The reply: outcome, status, and for a finished join the node's rank and the
        bootstrap address.
    """
    before = _signature(state)
    pruned = prune(state, request.rules.window_ms, now_ms, request.rules.min_nodes)
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
    return Reply(
        outcome=answer.outcome,
        status=status_of(state, now_ms),
        transition=transition,
        rank=state.participants[node] if finished_join else None,
        master_addr=None if master is None else master[0],
        master_port=None if master is None else master[1],
        wake_at_ms=answer.wake_at_ms,
        restart_deadline=answer.restart,
        known=state.knows(node),
        oldest_beat_ms=oldest,
        pruned=pruned,
    )
