"""The rendezvous state machine, one transition at a time (pure: no backend, no clock)."""

from __future__ import annotations

import pytest

from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.machine import (
    beat_due_ms,
    confirmable,
    departure_grace_ms,
    expiry_ms,
    reuse_grace_ms,
    snapshot_of,
    status_of,
    step,
)
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Reply, Request, RunState, Transition
from aelastic.core.token import NO_STATE
from aelastic.core.view import view_of

A, B, C, D = (NodeDesc("10.0.0.1", 100 + i, 0) for i in range(4))
T0 = 1_000_000


def rules(min_nodes: int = 2, max_nodes: int = 3, last_call: int = 1_000) -> Rules:
    return Rules(min_nodes, max_nodes, last_call_ms=last_call, window_ms=3_000)


def ask(
    state: RunState,
    node: NodeDesc,
    op: Op = Op.JOIN,
    now: int = T0,
    r: Rules | None = None,
    **flags: bool,
) -> Reply:
    return step(state, Request(op, node, r or rules(), port=1000 + node.pid, **flags), now)


def test_first_join_opens_the_round_and_waits_without_a_deadline() -> None:
    s = RunState("e")
    reply = ask(s, A)
    assert reply.outcome is Outcome.WAIT and reply.wake_at_ms is None
    assert reply.transition is Transition.ADD_TO_PARTICIPANTS
    assert reply.status.participants == 1 and reply.status.token == "e.0"
    assert reply.known


def test_min_nodes_starts_the_last_call_and_its_end_completes_the_round() -> None:
    s = RunState("e")
    ask(s, A)
    reply = ask(s, B, now=T0 + 10)
    assert reply.outcome is Outcome.WAIT and reply.wake_at_ms == T0 + 10 + 1_000
    assert reply.status.deadline_ms == T0 + 1_010 and reply.status.token == "e.1"
    assert ask(s, A, now=T0 + 500).outcome is Outcome.WAIT  # not yet
    done = ask(s, A, now=T0 + 1_010)
    assert done.outcome is Outcome.FINISH and done.transition is Transition.MARK_COMPLETE
    assert done.rank == 0 and done.status.world == 2 and done.status.complete
    assert (done.master_addr, done.master_port) == (A.addr, 1000 + A.pid)
    other = ask(s, B, now=T0 + 1_020)
    assert other.outcome is Outcome.FINISH and other.rank == 1
    assert (other.master_addr, other.master_port) == (A.addr, 1000 + A.pid)


def test_max_nodes_completes_at_once_with_ranks_in_torchs_order() -> None:
    """Ranks follow the sorted node descriptors (address, pid, local id), not join order."""
    s = RunState("e")
    for node in (C, A):
        ask(s, node, r=rules(3, 3))
    last = ask(s, B, r=rules(3, 3))
    assert last.outcome is Outcome.FINISH and last.rank == 1
    assert {n: e.rank for n, e in ((e.node, e) for e in snapshot_of(s, T0).participants)} == {
        A: 0,
        B: 1,
        C: 2,
    }
    assert last.master_addr == A.addr and last.master_port == 1000 + A.pid


@pytest.mark.parametrize(
    "nodes",
    [
        [NodeDesc("b", 1, 0), NodeDesc("a-b", 1, 0), NodeDesc("a", 1, 0), NodeDesc("a.b", 1, 0)],
        [NodeDesc("h", 10, 0), NodeDesc("h", 9, 0), NodeDesc("h", 100, 1), NodeDesc("h", 100, 0)],
        [NodeDesc("10.0.0.10", 1, 0), NodeDesc("10.0.0.9", 1, 0), NodeDesc("10.0.0.1", 2, 0)],
    ],
)
def test_ranks_are_sorted_as_tuples(nodes: list[NodeDesc]) -> None:
    s = RunState("e")
    r = rules(len(nodes), len(nodes))
    for node in nodes:
        ask(s, node, r=r)
    assert sorted(s.participants, key=s.participants.__getitem__) == sorted(nodes)


def test_only_watched_fields_move_the_token() -> None:
    s = RunState("e")
    r = rules(3, 4)
    ask(s, A, r=r)
    ask(s, B, r=r)
    assert s.generation == 0  # joins to a forming round notify nobody
    ask(s, A, Op.KEEP_ALIVE, now=T0 + 100, r=r)
    assert s.generation == 0  # nor does a heartbeat
    ask(s, C, r=r)
    assert s.generation == 1  # the last call started


def test_latecomer_waits_for_the_next_round_then_joins_it() -> None:
    s = RunState("e")
    r = rules(2, 3, last_call=1)
    ask(s, A, r=r)
    ask(s, B, r=r)
    ask(s, A, now=T0 + 5, r=r)
    late = ask(s, C, now=T0 + 10, r=r)
    assert late.outcome is Outcome.WAIT and late.transition is Transition.ADD_TO_WAIT_LIST
    assert late.status.waiting == 1
    for node in (A, B):
        ask(s, node, Op.LEAVE, now=T0 + 20, r=r)
    assert s.round == 1 and not s.complete
    joined = ask(s, C, now=T0 + 30, r=r)
    assert joined.transition is Transition.ADD_TO_PARTICIPANTS and joined.status.waiting == 0


def test_beyond_max_nodes_is_redundant_and_exits_gracefully_on_close() -> None:
    s = RunState("e")
    r = rules(1, 2)
    ask(s, A, r=r)
    ask(s, B, r=r)
    extra = ask(s, C, r=r)
    assert extra.transition is Transition.ADD_TO_REDUNDANCY_LIST and extra.status.redundant == 1
    assert ask(s, C, now=T0 + 100, r=r).outcome is Outcome.WAIT  # waits, no deadline
    ask(s, A, Op.CLOSE, r=r)
    assert ask(s, C, r=r).outcome is Outcome.GRACEFUL_EXIT
    assert ask(s, D, r=r).outcome is Outcome.ERROR_CLOSED


def test_redundant_node_is_released_with_a_fresh_deadline_when_a_slot_opens() -> None:
    s = RunState("e")
    r = rules(1, 2)
    ask(s, A, r=r)
    ask(s, B, r=r)
    ask(s, C, r=r)
    ask(s, B, Op.LEAVE, r=r)
    released = ask(s, C, r=r, expired=True)
    assert released.restart_deadline and released.outcome is Outcome.WAIT
    assert released.transition is Transition.ADD_TO_WAIT_LIST


def test_join_timeout_removes_the_node_unless_its_round_completed() -> None:
    s = RunState("e")
    ask(s, A)
    timed_out = ask(s, A, expired=True)
    assert timed_out.outcome is Outcome.ERROR_TIMEOUT and not timed_out.known
    assert ask(s, B, expired=True).outcome is Outcome.ERROR_TIMEOUT
    s2 = RunState("e")
    ask(s2, A, r=rules(2, 2))
    ask(s2, B, r=rules(2, 2))
    assert ask(s2, A, r=rules(2, 2), expired=True).outcome is Outcome.FINISH


def test_silent_nodes_are_pruned_after_the_window_and_counted_lost() -> None:
    s = RunState("e")
    r = rules(2, 2)
    ask(s, A, r=r)
    ask(s, B, r=r)
    beat = ask(s, A, Op.KEEP_ALIVE, now=T0 + 2_000, r=r)
    assert beat.oldest_beat_ms == T0  # B's
    reply = ask(s, A, Op.KEEP_ALIVE, now=T0 + 3_001, r=r)
    assert reply.pruned == 1 and reply.transition is Transition.KEEP_ALIVE
    assert reply.status.lost == 1 and reply.status.lost_sample == (B.key,)
    view = view_of(reply.status, A, 0)
    assert view.changed and view.lost == {B} and view.lost_count == 1 and not view.removed


def test_pruning_the_last_participant_opens_the_next_round() -> None:
    s = RunState("e")
    r = rules(1, 1)
    ask(s, A, r=r)
    reply = ask(s, B, Op.STATUS, now=T0 + 5_000, r=r)
    assert reply.transition is Transition.PRUNE and s.round == 1 and not s.complete


def test_pruning_below_min_nodes_clears_the_last_call() -> None:
    s = RunState("e")
    ask(s, A)
    ask(s, B, now=T0 + 2_500)
    assert s.deadline_ms is not None
    ask(s, B, Op.KEEP_ALIVE, now=T0 + 3_001)  # A is silent past the window
    assert s.deadline_ms is None and not s.complete


def test_a_finished_member_leaving_is_not_a_loss() -> None:
    s = RunState("e")
    r = rules(2, 2)
    ask(s, A, r=r)
    ask(s, B, r=r)
    reply = ask(s, B, Op.LEAVE, r=r, finished=True)
    assert reply.status.finished == 1 and reply.status.lost == 0
    assert view_of(reply.status, A, 0).changed


def test_leave_is_idempotent_and_a_removed_node_sees_itself_removed() -> None:
    s = RunState("e")
    r = rules(1, 2)
    ask(s, A, r=r)
    ask(s, A, Op.LEAVE, r=r)
    again = ask(s, A, Op.LEAVE, r=r)
    assert again.outcome is Outcome.FINISH and again.transition is Transition.NONE
    assert not ask(s, A, Op.KEEP_ALIVE, r=r).known
    assert view_of(again.status, A, 0, removed=True).removed


def test_a_later_round_means_removed() -> None:
    s = RunState("e")
    r = rules(1, 1)
    ask(s, A, r=r)
    ask(s, A, Op.LEAVE, r=r)
    assert view_of(status_of(s, T0), A, 0).removed


@pytest.mark.parametrize("op", list(Op))
def test_an_empty_state_answers_every_request(op: Op) -> None:
    reply = ask(RunState("e"), A, op)
    assert reply.outcome in (Outcome.FINISH, Outcome.WAIT)


def test_the_heartbeat_rule() -> None:
    assert beat_due_ms(T0, 5_000) == T0 + 5_000
    assert expiry_ms(T0, 15_000) == T0 + 15_000


# -- one set of rules per run; a node acts only for itself ---------------------------------

SECRET_A, SECRET_B, FORGED = "a" * 32, "b" * 32, "f" * 32


def act(
    s: RunState, node: NodeDesc, op: Op, secret: str, now: int = T0, r: Rules | None = None
) -> Reply:
    return step(s, Request(op, node, r or rules(2, 2), port=1, secret=secret), now)


def test_the_first_join_fixes_the_rules_and_a_join_with_others_is_refused() -> None:
    s = RunState("e")
    assert act(s, A, Op.JOIN, SECRET_A).outcome is Outcome.WAIT
    assert s.rules == rules(2, 2)
    other = Rules(2, 2, last_call_ms=1_000, window_ms=15_000)
    refused = act(s, B, Op.JOIN, SECRET_B, r=other)
    assert refused.outcome is Outcome.ERROR_RULES and refused.run_rules == rules(2, 2)
    assert not s.knows(B) and not refused.known
    assert act(s, B, Op.JOIN, SECRET_B).outcome is Outcome.FINISH  # the run's rules: in


def test_a_forged_window_prunes_nobody_the_runs_own_does() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    act(s, B, Op.JOIN, SECRET_B)
    tiny = Rules(1, 1, last_call_ms=1, window_ms=1)
    for op in Op:  # any request from a stranger, with a 1 ms window
        reply = act(s, C, op, FORGED, now=T0 + 2_000, r=tiny)
        assert reply.pruned == 0 and len(s.participants) == 2, op
    reply = act(s, C, Op.STATUS, FORGED, now=T0 + 3_001, r=tiny)
    assert reply.pruned == 2 and not s.participants  # silent past the run's own window


FAILURE = NodeReport(failure=FailureReport(time=1.0, rank=0, local_rank=0, exitcode=1, message="x"))


def test_requests_for_a_node_need_its_secret() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    act(s, B, Op.JOIN, SECRET_B)
    before = (dict(s.participants), dict(s.beats), s.closed, s.generation, s.health, s.done)
    for op in (Op.JOIN, Op.LEAVE, Op.KEEP_ALIVE, Op.REPORT, Op.DONE):
        report = FAILURE if op is Op.REPORT else None
        request = Request(op, A, rules(2, 2), port=1, secret=FORGED, report=report)
        reply = step(s, request, T0 + 10)
        assert reply.outcome is Outcome.ERROR_FORBIDDEN and not reply.known, op
    assert (dict(s.participants), dict(s.beats), s.closed, s.generation, s.health, s.done) == (
        before
    )
    assert act(s, A, Op.KEEP_ALIVE, SECRET_A, now=T0 + 20).known  # the node's own: yes


def test_a_retried_join_with_the_same_secret_gets_the_same_answer() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    first = act(s, B, Op.JOIN, SECRET_B)
    again = act(s, B, Op.JOIN, SECRET_B, now=T0 + 5)  # its reply was lost
    assert first.outcome is again.outcome is Outcome.FINISH and first.rank == again.rank


def test_a_node_dropped_from_the_run_may_come_back_under_a_new_secret() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    act(s, A, Op.LEAVE, SECRET_A)
    assert act(s, A, Op.JOIN, SECRET_B).outcome is Outcome.WAIT and s.secrets[A] == SECRET_B


def test_any_requester_closes_a_run_as_in_torch_and_a_second_close_changes_nothing() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    closed = act(s, C, Op.CLOSE, FORGED)  # a handler that never joined
    assert closed.transition is Transition.MARK_CLOSED and s.closed
    again = act(s, A, Op.CLOSE, SECRET_A)
    assert again.outcome is Outcome.FINISH and again.transition is Transition.NONE
    t = RunState("e")
    act(t, A, Op.JOIN, SECRET_A)
    assert step(t, Request.operator_close(), T0).transition is Transition.MARK_CLOSED


def test_a_close_of_a_run_no_join_made_makes_it_closed_but_the_operators() -> None:
    s = RunState("e")
    closed = act(s, A, Op.CLOSE, SECRET_A)
    assert s.made and s.closed and closed.status.closed and s.vacated_ms == T0
    assert act(s, B, Op.JOIN, SECRET_B, now=T0 + 1).outcome is Outcome.ERROR_CLOSED
    t = RunState("e")
    assert not step(t, Request.operator_close(), T0).status.closed and not t.made


@pytest.mark.parametrize("op", [Op.STATUS, Op.LEAVE, Op.KEEP_ALIVE, Op.REPORT, Op.DONE])
def test_only_a_join_or_a_close_makes_a_run(op: Op) -> None:
    s = RunState("e")
    report = FAILURE if op is Op.REPORT else None
    reply = step(s, Request(op, A, rules(2, 2), secret=SECRET_A, report=report), T0)
    assert not s.made and reply.status.token == NO_STATE and not reply.known


# -- a job id used again ------------------------------------------------------------------


def test_a_closed_run_is_reused_once_empty_for_two_windows() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    act(s, B, Op.JOIN, SECRET_B)  # round 0: A and B
    act(s, A, Op.CLOSE, SECRET_A, now=T0 + 10)
    act(s, A, Op.LEAVE, SECRET_A, now=T0 + 20)
    late = act(s, C, Op.JOIN, FORGED, now=T0 + 30)
    assert late.outcome is Outcome.ERROR_CLOSED and late.reopen_at_ms is None  # B is in it
    act(s, B, Op.LEAVE, SECRET_B, now=T0 + 40)  # the last node leaves
    grace = reuse_grace_ms(rules(2, 2))
    assert grace == 2 * 3_000
    late = act(s, C, Op.JOIN, FORGED, now=T0 + 40 + grace - 1)
    assert late.outcome is Outcome.ERROR_CLOSED and late.reopen_at_ms == T0 + 40 + grace
    other = Rules(1, 1, last_call_ms=1, window_ms=60_000)
    before = s.round
    fresh = act(s, C, Op.JOIN, FORGED, now=T0 + 40 + grace, r=other)
    assert fresh.outcome is Outcome.FINISH and fresh.rank == 0  # a new run, the new rules
    assert s.round == before + 1 and not s.closed and s.rules == other


def test_a_join_to_a_closed_run_ends_the_nodes_part_in_it() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A, r=rules(1, 1))
    act(s, B, Op.JOIN, SECRET_B, r=rules(1, 1))  # redundant
    act(s, C, Op.JOIN, FORGED, r=rules(1, 1))  # redundant too
    step(s, Request.operator_close(), T0 + 5)
    assert act(s, B, Op.JOIN, SECRET_B, r=rules(1, 1)).outcome is Outcome.GRACEFUL_EXIT
    assert not s.knows(B)
    closed = act(s, A, Op.JOIN, SECRET_A, now=T0 + 6, r=rules(1, 1))
    assert closed.outcome is Outcome.ERROR_CLOSED and not s.knows(A)
    assert s.vacated_ms is None  # C is still in it
    act(s, C, Op.KEEP_ALIVE, FORGED, now=T0 + 2_000, r=rules(1, 1))
    pruned = act(s, A, Op.STATUS, SECRET_A, now=T0 + 10_000, r=rules(1, 1))
    assert pruned.pruned == 1 and s.vacated_ms == T0 + 2_000 + 3_000  # when C expired


# -- a backend's departure report ---------------------------------------------------------


def _pair() -> tuple[RunState, Rules]:
    s, r = RunState("e"), rules(2, 2)
    ask(s, A, r=r)
    ask(s, B, r=r)
    return s, r


def test_a_departed_member_is_lost_once_the_grace_passed_unheard() -> None:
    s, r = _pair()
    grace = departure_grace_ms(r)
    assert grace == 1_000  # half the 3 s window, at most a second
    gone = T0 + 100
    early = step(s, Request.departure(B, gone, secret=""), gone + 10)
    assert early.outcome is Outcome.WAIT and early.wake_at_ms == gone + grace
    assert s.knows(B) and s.lost == 0
    reply = step(s, Request.departure(B, gone, secret=""), gone + grace)
    assert reply.transition is Transition.REMOVE and not s.knows(B)
    assert reply.status.lost == 1 and reply.status.lost_sample == (B.key,)
    assert view_of(reply.status, A, 0).lost == {B}  # long before the 3 s window


def test_a_departed_member_heard_from_since_stays() -> None:
    s, r = _pair()
    gone = T0 + 100
    ask(s, B, Op.KEEP_ALIVE, now=gone + 1, r=r)  # its client reconnected and beat
    reply = step(s, Request.departure(B, gone), T0 + 5_000 - 2_000)
    assert reply.transition is Transition.NONE and s.knows(B) and s.lost == 0


def test_a_confirmed_departure_has_no_grace_but_spares_a_node_heard_since() -> None:
    s, _ = _pair()
    gone = T0 + 100
    reply = step(s, Request.departure(B, gone, secret="", confirmed=True), gone + 5)
    assert reply.transition is Transition.REMOVE and not s.knows(B)
    s, r = _pair()
    ask(s, B, Op.KEEP_ALIVE, now=gone + 1, r=r)  # its client reconnected and beat
    reply = step(s, Request.departure(B, gone, secret="", confirmed=True), gone + 5)
    assert reply.transition is Transition.NONE and s.knows(B)


def test_departures_are_confirmable_for_at_most_half_the_nodes() -> None:
    assert confirmable(1, 2) and confirmable(1, 3) and confirmable(2, 4)
    assert not confirmable(2, 3) and not confirmable(3, 4) and not confirmable(1, 1)


def test_a_short_window_halves_the_grace() -> None:
    assert departure_grace_ms(Rules(1, 2, 1, 600)) == 300
    assert departure_grace_ms(Rules(1, 2, 1, 15_000)) == 1_000


def test_only_a_backend_or_the_nodes_own_connection_reports_a_departure() -> None:
    s = RunState("e")
    act(s, A, Op.JOIN, SECRET_A)
    forged = step(s, Request.departure(A, T0, secret=FORGED), T0 + 1_500)
    assert forged.outcome is Outcome.ERROR_FORBIDDEN and s.knows(A)
    # The node's own secret (the HTTP server passes what its connection carried) ...
    assert step(s, Request.departure(A, T0, secret=SECRET_A), T0 + 1_500).pruned == 0
    assert not s.knows(A)
    # ... or the backend's own word (no secret: operator).
    act(s, B, Op.JOIN, SECRET_B, now=T0 + 2_000)
    assert Request.departure(B, T0 + 2_100).operator
    step(s, Request.departure(B, T0 + 2_100), T0 + 3_200)
    assert not s.knows(B)


def test_a_departure_of_an_unknown_node_changes_nothing() -> None:
    s, _ = _pair()
    reply = step(s, Request.departure(C, T0), T0 + 2_000)
    assert reply.outcome is Outcome.FINISH and reply.transition is Transition.NONE
