"""The pure state machine, one transition at a time (no I/O, time passed in)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from aelastic.rendezvous.api import RendezvousSettings
from aelastic.rendezvous.core import (
    Op,
    Outcome,
    Transition,
    member_expiry,
    prune,
    step,
    view,
)
from aelastic.rendezvous.state import NodeDesc, RendezvousState

A, B, C, D = (NodeDesc("host", 100 + i, 0) for i in range(4))
T0 = 1_000.0
FAR = T0 + 600


def settings(min_nodes: int = 2, max_nodes: int = 3, **kw: float) -> RendezvousSettings:
    base: dict[str, float] = {
        "last_call_timeout": 30.0,
        "keep_alive_interval": 20.0,
        "keep_alive_max_attempt": 3,
    }
    base.update(kw)
    return RendezvousSettings("run", min_nodes, max_nodes, **base)  # type: ignore[arg-type]


def settle(
    op: Op,
    state: RendezvousState | None,
    node: NodeDesc,
    s: RendezvousSettings,
    now: float = T0,
    deadline: float = FAR,
) -> tuple[RendezvousState, Outcome, list[Transition]]:
    """Apply WRITE steps (as an uncontended backend would) until the node must wait or stop."""
    transitions: list[Transition] = []
    current = state or RendezvousState()
    for _ in range(20):
        result = step(op, current, node, s, now, deadline)
        if result.outcome is not Outcome.WRITE:
            return current, result.outcome, transitions
        assert result.state is not None and result.transition is not None
        transitions.append(result.transition)
        current = result.state
    raise AssertionError("the core kept writing")


def test_first_join_creates_the_round_and_waits() -> None:
    s = settings()
    state, outcome, transitions = settle(Op.JOIN, None, A, s)
    assert transitions == [Transition.ADD_TO_PARTICIPANTS]
    assert outcome is Outcome.WAIT
    assert dict(state.participants) == {A: 0}
    assert state.deadline is None and not state.complete
    assert state.last_heartbeats[A] == T0


def test_min_nodes_starts_the_last_call_and_its_deadline_completes_the_round() -> None:
    s = settings(min_nodes=2, max_nodes=3, last_call_timeout=30)
    state, _, _ = settle(Op.JOIN, None, A, s)
    state, outcome, _ = settle(Op.JOIN, state, B, s)
    assert state.deadline == T0 + 30
    assert outcome is Outcome.WAIT
    wait = step(Op.JOIN, state, A, s, T0 + 1, FAR)
    assert wait.outcome is Outcome.WAIT and wait.wake_at is not None and wait.wake_at <= T0 + 30
    state, outcome, transitions = settle(Op.JOIN, state, A, s, now=T0 + 30)
    assert transitions == [Transition.MARK_COMPLETE]
    assert outcome is Outcome.FINISH
    assert state.complete and dict(state.participants) == {A: 0, B: 1}


def test_max_nodes_completes_at_once_with_sorted_ranks() -> None:
    s = settings(min_nodes=1, max_nodes=3)
    state = None
    for node in (C, A, B):
        state, _, _ = settle(Op.JOIN, state, node, s)
    assert state is not None and state.complete
    assert dict(state.participants) == {A: 0, B: 1, C: 2}
    for node in (A, B, C):
        assert settle(Op.JOIN, state, node, s)[1] is Outcome.FINISH


def complete_round(s: RendezvousSettings, *nodes: NodeDesc) -> RendezvousState:
    state: RendezvousState | None = None
    for node in nodes:
        state, _, _ = settle(Op.JOIN, state, node, s)
    assert state is not None
    if not state.complete:
        state, _, _ = settle(Op.JOIN, state, nodes[0], s, now=T0 + s.last_call_timeout)
    assert state.complete
    return state


def test_latecomer_waits_for_the_next_round() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    state = complete_round(s, A, B)
    state, outcome, transitions = settle(Op.JOIN, state, C, s, now=T0 + 31)
    assert transitions == [Transition.ADD_TO_WAIT_LIST]
    assert outcome is Outcome.WAIT
    assert C in state.wait_list and C not in state.participants
    # Members see the waiting node; the completed group is unchanged.
    seen = view(state, A, frozenset({A, B}), state.round, s, T0 + 31)
    assert seen.waiting == 1 and seen.changed and not seen.lost


def test_members_leaving_open_the_next_round_for_waiting_nodes() -> None:
    s = settings(min_nodes=2, max_nodes=3)
    state = complete_round(s, A, B)
    state, _, _ = settle(Op.JOIN, state, C, s, now=T0 + 31)
    first_round = state.round
    state, _, _ = settle(Op.LEAVE, state, A, s, now=T0 + 32)
    assert state.complete and state.round == first_round
    state, _, _ = settle(Op.LEAVE, state, B, s, now=T0 + 32)
    assert not state.complete and state.round == first_round + 1
    state, _, transitions = settle(Op.JOIN, state, C, s, now=T0 + 33)
    assert transitions == [Transition.ADD_TO_PARTICIPANTS]
    assert C not in state.wait_list and C in state.participants


def test_beyond_max_nodes_goes_to_the_redundancy_list_and_exits_gracefully_on_close() -> None:
    s = settings(min_nodes=1, max_nodes=2)
    state = complete_round(s, A, B)
    state, outcome, transitions = settle(Op.JOIN, state, C, s)
    assert transitions == [Transition.ADD_TO_REDUNDANCY_LIST]
    assert outcome is Outcome.WAIT and C in state.redundancy_list
    assert view(state, A, frozenset({A, B}), state.round, s, T0).waiting == 0
    # A redundant node has no join deadline.
    assert step(Op.JOIN, state, C, s, T0 + 1, T0).outcome is Outcome.WAIT
    closed, _, _ = settle(Op.CLOSE, state, A, s)
    assert settle(Op.JOIN, closed, C, s)[1] is Outcome.GRACEFUL_EXIT


def test_redundant_node_is_released_when_a_slot_opens_with_a_fresh_deadline() -> None:
    s = settings(min_nodes=1, max_nodes=2)
    state = complete_round(s, A, B)
    state, _, _ = settle(Op.JOIN, state, C, s)
    state, _, _ = settle(Op.LEAVE, state, B, s)
    result = step(Op.JOIN, state, C, s, T0, FAR)
    assert result.transition is Transition.REMOVE_FROM_REDUNDANCY_LIST
    assert result.restart_deadline


def test_closed_rendezvous_refuses_joins_and_stays_closed() -> None:
    s = settings()
    state, _, _ = settle(Op.JOIN, None, A, s)
    state, outcome, transitions = settle(Op.CLOSE, state, A, s)
    assert transitions == [Transition.MARK_CLOSED] and outcome is Outcome.FINISH
    assert state.closed
    assert settle(Op.JOIN, state, B, s)[1] is Outcome.ERROR_CLOSED
    for op in Op:
        after, _, _ = settle(op, state, A, s, now=T0 + 1)
        assert after.closed


def test_join_timeout_removes_the_node_then_fails() -> None:
    s = settings(min_nodes=2, max_nodes=2)
    state, _, _ = settle(Op.JOIN, None, A, s)
    state, outcome, transitions = settle(Op.JOIN, state, A, s, now=T0 + 10, deadline=T0 + 5)
    assert transitions == [Transition.REMOVE]
    assert outcome is Outcome.ERROR_TIMEOUT
    assert not state.knows(A) and A not in state.last_heartbeats


def test_keep_alive_is_due_after_the_interval() -> None:
    s = settings(keep_alive_interval=5)
    state, _, _ = settle(Op.JOIN, None, A, s)
    early = step(Op.JOIN, state, A, s, T0 + 1, FAR)
    assert early.outcome is Outcome.WAIT and early.wake_at == T0 + 5
    due = step(Op.JOIN, state, A, s, T0 + 5, FAR)
    assert due.transition is Transition.KEEP_ALIVE
    assert due.state is not None and due.state.last_heartbeats[A] == T0 + 5
    assert step(Op.KEEP_ALIVE, state, A, s, T0 + 1, FAR).outcome is Outcome.FINISH
    beat = step(Op.KEEP_ALIVE, state, A, s, T0 + 2.6, FAR)
    assert beat.transition is Transition.KEEP_ALIVE
    assert beat.state is not None
    # One write settles the op.
    assert step(Op.KEEP_ALIVE, beat.state, A, s, T0 + 2.7, FAR).outcome is Outcome.FINISH
    assert step(Op.KEEP_ALIVE, state, B, s, T0 + 1, FAR).outcome is Outcome.FINISH


def test_dead_nodes_are_pruned_after_the_heartbeat_window() -> None:
    s = settings(min_nodes=1, max_nodes=2, keep_alive_interval=5, keep_alive_max_attempt=3)
    state = complete_round(s, A, B)
    state = replace(state, last_heartbeats=MappingProxyType({A: T0 + 20, B: T0}))
    assert prune(state, s, T0 + 15) is state
    pruned = prune(state, s, T0 + 15.1)
    assert dict(pruned.participants) == {A: 0} and pruned.complete
    seen = view(state, A, frozenset({A, B}), state.round, s, T0 + 15.1)
    assert seen.lost == {B} and seen.changed and not seen.removed
    assert member_expiry(state, frozenset({A, B}), s) == T0 + 15


def test_pruning_the_last_participant_of_a_complete_round_opens_the_next() -> None:
    s = settings(min_nodes=1, max_nodes=2)
    state = complete_round(s, A)
    pruned = prune(state, s, T0 + 100)
    assert pruned.round == state.round + 1 and not pruned.complete and not pruned.participants


def test_pruning_below_min_nodes_clears_the_last_call() -> None:
    s = settings(min_nodes=2, max_nodes=3, keep_alive_interval=5)
    state, _, _ = settle(Op.JOIN, None, A, s)
    state, _, _ = settle(Op.JOIN, state, B, s, now=T0 + 10)
    assert state.deadline is not None
    pruned = prune(state, s, T0 + 15.5)
    assert dict(pruned.participants) == {B: 0} and pruned.deadline is None


def test_a_waiting_node_persists_pruning_so_watchers_see_it() -> None:
    s = settings(min_nodes=3, max_nodes=3, keep_alive_interval=5)
    state, _, _ = settle(Op.JOIN, None, A, s)
    state, _, _ = settle(Op.JOIN, state, B, s, now=T0 + 14)
    result = step(Op.JOIN, state, B, s, T0 + 15.5, FAR)
    assert result.transition is Transition.PRUNE
    assert result.state is not None and A not in result.state.participants


def test_leave_is_idempotent_and_removed_node_sees_itself_removed() -> None:
    s = settings(min_nodes=1, max_nodes=3)
    state = complete_round(s, A, B)
    after, outcome, transitions = settle(Op.LEAVE, state, A, s)
    assert transitions == [Transition.REMOVE] and outcome is Outcome.FINISH
    assert settle(Op.LEAVE, after, A, s)[2] == []
    assert view(after, A, frozenset({A, B}), state.round, s, T0).removed
    assert view(after, B, frozenset({A, B}), state.round, s, T0).lost == {A}


def test_view_of_a_later_round_means_removed() -> None:
    s = settings(min_nodes=1, max_nodes=3)
    state = complete_round(s, A)
    later = replace(state, round=state.round + 1, complete=False)
    assert view(later, A, frozenset({A}), state.round, s, T0).removed


@pytest.mark.parametrize("op", list(Op))
def test_no_state_is_handled_like_an_empty_one(op: Op) -> None:
    s = settings()
    assert step(op, None, A, s, T0, FAR) == step(op, RendezvousState(), A, s, T0, FAR)


def test_a_node_never_prunes_itself_in_its_own_view() -> None:
    s = settings(min_nodes=1, max_nodes=2, keep_alive_interval=5, keep_alive_max_attempt=2)
    state = complete_round(s, A, B)
    late = T0 + 10.5  # both heartbeats are older than the 10 s window
    seen = view(state, A, frozenset({A, B}), state.round, s, late)
    assert not seen.removed and seen.lost == {B}
    assert prune(state, s, late, spare=A).participants.keys() == {A}
    assert not prune(state, s, late).participants
