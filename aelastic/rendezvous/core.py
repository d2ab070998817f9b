"""The rendezvous state machine, pure: no I/O, no clock reads, no ``await``.

How it works: ``step(op, state, node, settings, now, deadline)`` looks at the shared state
as one node sees it and returns a :class:`Step`: either a new state to write (compare-and-set,
then step again), or what to do next (wait, finish, or fail). Every backend and both facades
drive this one function, so its semantics are torch's ``DynamicRendezvousHandler``'s:

* JOIN: a node joins the participants of an open round. At ``min_nodes`` the last call starts
  (``last_call_timeout``); at ``max_nodes`` the round completes at once. A completed round
  admits latecomers to the wait list (the next round) or, at ``max_nodes``, to the redundancy
  list. Ranks are assigned at completion (sorted node ids) and stored, so every member agrees.
* LEAVE: the node removes itself from wherever it is; when the last participant of a complete
  round leaves, the next round opens.
* CLOSE: the run is closed; later joins fail with ``RendezvousClosedError``.
* KEEP_ALIVE: the node refreshes its heartbeat.

Before every decision, nodes whose heartbeat is older than the heartbeat window are pruned.
``now`` and ``deadline`` are wall-clock seconds; times written into the state are whole
milliseconds (the wire's precision).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from types import MappingProxyType

from .api import RendezvousSettings
from .state import NodeDesc, RendezvousState, millis

__all__ = [
    "MembershipView",
    "Op",
    "Outcome",
    "Step",
    "Transition",
    "prune",
    "step",
    "view",
]


class Op(enum.Enum):
    """What a node is trying to do."""

    JOIN = "join"
    LEAVE = "leave"
    CLOSE = "close"
    KEEP_ALIVE = "keep_alive"


class Outcome(enum.Enum):
    """What the driver of the core does next."""

    WRITE = "write"  # compare-and-set Step.state, then step again
    WAIT = "wait"  # wait for a change of the state, or until Step.wake_at
    FINISH = "finish"  # the operation is done
    ERROR_CLOSED = "error_closed"
    ERROR_TIMEOUT = "error_timeout"
    GRACEFUL_EXIT = "graceful_exit"


class Transition(enum.Enum):
    """The change a WRITE makes (for logs, events and tests)."""

    PRUNE = "prune"
    KEEP_ALIVE = "keep_alive"
    ADD_TO_PARTICIPANTS = "add_to_participants"
    ADD_TO_WAIT_LIST = "add_to_wait_list"
    ADD_TO_REDUNDANCY_LIST = "add_to_redundancy_list"
    REMOVE_FROM_REDUNDANCY_LIST = "remove_from_redundancy_list"
    REMOVE = "remove"
    MARK_COMPLETE = "mark_complete"
    MARK_CLOSED = "mark_closed"


@dataclass(frozen=True)
class Step:
    """The result of one :func:`step`."""

    outcome: Outcome
    state: RendezvousState | None = None
    transition: Transition | None = None
    wake_at: float | None = None
    #: The node left the redundancy list: its join timeout starts anew (as torch's does).
    restart_deadline: bool = False


_FINISH = Step(Outcome.FINISH)


def prune(
    state: RendezvousState,
    settings: RendezvousSettings,
    now: float,
    spare: NodeDesc | None = None,
) -> RendezvousState:
    """Remove the nodes whose last heartbeat is older than the heartbeat window.

    ``spare`` is never pruned (a node does not judge itself dead: only others can).
    Returns ``state`` itself when nobody is dead.
    """
    beats = state.last_heartbeats
    expired = now - settings.heartbeat_window
    if not beats or min(beats.values()) >= expired:
        return state
    dead = [n for n, beat in beats.items() if beat < expired and n != spare]
    if not dead:
        return state
    return _remove(state, settings, dead)


def _remove(
    state: RendezvousState, settings: RendezvousSettings, nodes: list[NodeDesc]
) -> RendezvousState:
    participants = dict(state.participants)
    beats = dict(state.last_heartbeats)
    removed_participant = False
    for node in nodes:
        beats.pop(node, None)
        if participants.pop(node, None) is not None:
            removed_participant = True
    gone = frozenset(nodes)
    new = replace(
        state,
        participants=MappingProxyType(participants),
        last_heartbeats=MappingProxyType(beats),
        wait_list=state.wait_list - gone,
        redundancy_list=state.redundancy_list - gone,
    )
    if not removed_participant:
        return new
    if new.complete:
        if not participants:
            return replace(new, complete=False, round=new.round + 1, deadline=None)
        return new
    if len(participants) < settings.min_nodes:
        return replace(new, deadline=None)
    return new


def _beat(state: RendezvousState, node: NodeDesc, now: float) -> dict[NodeDesc, float]:
    beats = dict(state.last_heartbeats)
    beats[node] = now
    return beats


def _write(state: RendezvousState, transition: Transition, *, restart: bool = False) -> Step:
    return Step(Outcome.WRITE, state=state, transition=transition, restart_deadline=restart)


def _complete(state: RendezvousState) -> RendezvousState:
    ranks = {node: rank for rank, node in enumerate(sorted(state.participants))}
    return replace(state, complete=True, deadline=None, participants=MappingProxyType(ranks))


def _add_to_participants(
    state: RendezvousState, node: NodeDesc, settings: RendezvousSettings, now: float
) -> Step:
    participants = dict(state.participants)
    participants[node] = 0
    new = replace(
        state,
        participants=MappingProxyType(participants),
        wait_list=state.wait_list - {node},
        last_heartbeats=MappingProxyType(_beat(state, node, now)),
    )
    if len(participants) == settings.min_nodes:
        new = replace(new, deadline=millis(now + settings.last_call_timeout))
    if len(participants) == settings.max_nodes:
        new = _complete(new)
    return _write(new, Transition.ADD_TO_PARTICIPANTS)


def _keep_alive_due(
    state: RendezvousState, node: NodeDesc, settings: RendezvousSettings, now: float
) -> bool:
    beat = state.last_heartbeats.get(node)
    return beat is not None and beat <= now - settings.keep_alive_interval


def _keep_alive(state: RendezvousState, node: NodeDesc, now: float) -> Step:
    new = replace(state, last_heartbeats=MappingProxyType(_beat(state, node, now)))
    return _write(new, Transition.KEEP_ALIVE)


def _wait(
    state: RendezvousState,
    node: NodeDesc,
    settings: RendezvousSettings,
    deadline: float | None,
) -> Step:
    """Wait for a change, or until the next thing this node must do by itself."""
    times = [] if deadline is None else [deadline]
    beat = state.last_heartbeats.get(node)
    if beat is not None:
        times.append(beat + settings.keep_alive_interval)
    if node in state.participants and not state.complete and state.deadline is not None:
        times.append(state.deadline)
    return Step(Outcome.WAIT, wake_at=min(times) if times else None)


def _join(
    state: RendezvousState,
    node: NodeDesc,
    settings: RendezvousSettings,
    now: float,
    deadline: float,
) -> Step:
    if state.closed:
        if node in state.redundancy_list:
            return Step(Outcome.GRACEFUL_EXIT)
        return Step(Outcome.ERROR_CLOSED)

    if node in state.redundancy_list:
        if len(state.participants) >= settings.max_nodes:
            # A redundant node waits without a deadline until a slot opens.
            if _keep_alive_due(state, node, settings, now):
                return _keep_alive(state, node, now)
            return _wait(state, node, settings, None)
        new = _remove(state, settings, [node])
        return _write(new, Transition.REMOVE_FROM_REDUNDANCY_LIST, restart=True)

    is_participant = node in state.participants
    if state.complete and is_participant:
        return _FINISH

    if now > deadline:
        if state.knows(node):
            return _write(_remove(state, settings, [node]), Transition.REMOVE)
        return Step(Outcome.ERROR_TIMEOUT)

    if state.complete:
        if node not in state.wait_list:
            # Room left: wait for the next round; none: stand by as redundant.
            beats = MappingProxyType(_beat(state, node, now))
            if len(state.participants) < settings.max_nodes:
                waiting = replace(state, wait_list=state.wait_list | {node}, last_heartbeats=beats)
                return _write(waiting, Transition.ADD_TO_WAIT_LIST)
            redundant = state.redundancy_list | {node}
            new = replace(state, redundancy_list=redundant, last_heartbeats=beats)
            return _write(new, Transition.ADD_TO_REDUNDANCY_LIST)
    elif is_participant:
        count = len(state.participants)
        if (
            settings.min_nodes <= count <= settings.max_nodes
            and state.deadline is not None
            and state.deadline <= now
        ):
            return _write(_complete(state), Transition.MARK_COMPLETE)
    else:
        return _add_to_participants(state, node, settings, now)

    if _keep_alive_due(state, node, settings, now):
        return _keep_alive(state, node, now)
    return _wait(state, node, settings, deadline)


def _leave(
    state: RendezvousState,
    node: NodeDesc,
    settings: RendezvousSettings,
    now: float,
    deadline: float,
) -> Step:
    if not state.knows(node):  # listed nodes are exactly those with a heartbeat
        return _FINISH
    if now > deadline:
        return Step(Outcome.ERROR_TIMEOUT)
    return _write(_remove(state, settings, [node]), Transition.REMOVE)


def _close(state: RendezvousState, now: float, deadline: float) -> Step:
    if state.closed:
        return _FINISH
    if now > deadline:
        return Step(Outcome.ERROR_TIMEOUT)
    return _write(replace(state, closed=True), Transition.MARK_CLOSED)


def _heartbeat(
    state: RendezvousState,
    node: NodeDesc,
    settings: RendezvousSettings,
    now: float,
    deadline: float,
) -> Step:
    beat = state.last_heartbeats.get(node)
    # A heartbeat younger than half an interval is fresh enough: the op is done.
    if beat is None or beat > now - settings.keep_alive_interval / 2:
        return _FINISH
    if now > deadline:
        return Step(Outcome.ERROR_TIMEOUT)
    return _keep_alive(state, node, now)


def step(
    op: Op,
    state: RendezvousState | None,
    node: NodeDesc,
    settings: RendezvousSettings,
    now: float,
    deadline: float,
) -> Step:
    """Decide what ``node`` does next to carry out ``op``.

    Args:
        op: The operation under way.
        state: The shared state as last read (``None``: none stored yet).
        node: The node taking the step.
        settings: The run's settings.
        now: Current wall-clock time, in seconds.
        deadline: Wall-clock time at which ``op`` times out.

    Returns:
        The next :class:`Step`. A WRITE carries the full new state (dead nodes pruned).
    """
    current = state if state is not None else RendezvousState()
    now = millis(now)  # times in the state have the wire's precision
    pruned = prune(current, settings, now)
    if op is Op.JOIN:
        result = _join(pruned, node, settings, now, deadline)
    elif op is Op.LEAVE:
        result = _leave(pruned, node, settings, now, deadline)
    elif op is Op.CLOSE:
        result = _close(pruned, now, deadline)
    else:
        result = _heartbeat(pruned, node, settings, now, deadline)
    if result.outcome is Outcome.WAIT and pruned is not current:
        # Persist the pruning so that other nodes (and watchers) see it.
        return _write(pruned, Transition.PRUNE)
    return result


@dataclass(frozen=True)
class MembershipView:
    """How the group of a completed round looks now, from one member's point of view."""

    round: int
    closed: bool
    #: This node is no longer a participant of the round it completed.
    removed: bool
    #: Members of that round that are gone (left, or dead for want of heartbeats).
    lost: frozenset[NodeDesc]
    #: Nodes waiting to join the next round (torch's ``num_nodes_waiting``).
    waiting: int

    @property
    def changed(self) -> bool:
        """Whether the group must re-rendezvous (someone is lost, waiting, or it closed)."""
        return self.closed or self.removed or bool(self.lost) or self.waiting > 0


def view(
    state: RendezvousState | None,
    node: NodeDesc,
    members: frozenset[NodeDesc],
    round_: int,
    settings: RendezvousSettings,
    now: float,
) -> MembershipView:
    """Compare the current state with the group ``node`` completed (``members`` in ``round_``).

    Dead nodes are pruned locally, so a silent peer shows as lost once its heartbeat window
    has passed, whether or not anybody wrote the pruned state yet.
    """
    stored = state if state is not None else RendezvousState()
    # Silent peers show as lost; this node itself is removed only when others removed it.
    current = prune(stored, settings, now, spare=node)
    same_round = current.round == round_
    present = current.participants.keys() if same_round else frozenset()
    return MembershipView(
        round=current.round,
        closed=current.closed,
        removed=node not in present,
        lost=frozenset(m for m in members if m != node and m not in present),
        waiting=len(current.wait_list),
    )


def member_expiry(
    state: RendezvousState | None, members: frozenset[NodeDesc], settings: RendezvousSettings
) -> float | None:
    """When the first of ``members`` would be pruned if it stays silent (wall-clock)."""
    if state is None:
        return None
    beats = [state.last_heartbeats[m] for m in members if m in state.last_heartbeats]
    return min(beats) + settings.heartbeat_window if beats else None
