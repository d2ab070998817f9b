"""The restart/rescale policy, a pure function: no processes, no rendezvous."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aelastic.agent.loop.policy import Action, Decision, Observation, Trigger, decide

MEMBERSHIP = Trigger.MEMBERSHIP_CHANGED


def test_success_finishes() -> None:
    assert decide(Observation(Trigger.WORKERS_SUCCEEDED), 0).action is Action.FINISH


@pytest.mark.parametrize(
    ("left", "action"), [(3, Action.RESTART), (1, Action.RESTART), (0, Action.FAIL)]
)
def test_failure_restarts_while_restarts_remain(left: int, action: Action) -> None:
    decision = decide(Observation(Trigger.WORKER_FAILED), left)
    assert decision.action is action
    assert "failed" in decision.reason


@pytest.mark.parametrize(
    ("observation", "action"),
    [
        (Observation(MEMBERSHIP, closed=True, lost=1, waiting=2), Action.ABORT),
        (Observation(MEMBERSHIP, removed=True), Action.RESCALE),
        (Observation(MEMBERSHIP, lost=1), Action.RESCALE),
        (Observation(MEMBERSHIP, lost=1, lost_finished=1, peers_finished=True), Action.RESCALE),
        (Observation(MEMBERSHIP, waiting=1), Action.RESCALE),
        (Observation(MEMBERSHIP, waiting=1, peers_finished=True), Action.CONTINUE),
        (Observation(MEMBERSHIP, lost_finished=2, peers_finished=True), Action.CONTINUE),
        (Observation(MEMBERSHIP), Action.CONTINUE),
    ],
)
def test_membership_changes(observation: Observation, action: Action) -> None:
    assert decide(observation, 3).action is action
    assert decide(observation, 0).action is action  # membership never spends restarts


@given(
    trigger=st.sampled_from(list(Trigger)),
    closed=st.booleans(),
    removed=st.booleans(),
    lost=st.integers(0, 3),
    lost_finished=st.integers(0, 3),
    waiting=st.integers(0, 3),
    peers_finished=st.booleans(),
    left=st.integers(0, 5),
)
def test_properties(
    trigger: Trigger,
    closed: bool,
    removed: bool,
    lost: int,
    lost_finished: int,
    waiting: int,
    peers_finished: bool,
    left: int,
) -> None:
    observation = Observation(
        trigger, closed, removed, lost, lost_finished, waiting, peers_finished or lost_finished > 0
    )
    action = decide(observation, left).action
    # Only a worker failure spends a restart or fails the run.
    assert (action in (Action.RESTART, Action.FAIL)) == (trigger is Trigger.WORKER_FAILED)
    if trigger is Trigger.MEMBERSHIP_CHANGED:
        # A group that lost an unfinished member, or this node, always re-forms (or ends).
        if lost or removed or closed:
            assert action in (Action.RESCALE, Action.ABORT)
        # Members that finished never make the others restart.
        if not (lost or removed or closed or (waiting and not observation.peers_finished)):
            assert action is Action.CONTINUE


def test_a_quarantined_host_leaves_and_a_spent_job_budget_fails_before_local_restarts() -> None:
    quarantined = Observation(Trigger.WORKER_FAILED, quarantine="root cause 2 times in a row")
    assert decide(quarantined, 5) == Decision(Action.QUARANTINE, "root cause 2 times in a row")
    spent = Observation(Trigger.WORKER_FAILED, job_budget_spent="the job spent its budget")
    assert decide(spent, 5) == Decision(Action.FAIL, "the job spent its budget")
    both = Observation(Trigger.WORKER_FAILED, quarantine="q", job_budget_spent="b")
    assert decide(both, 5).action is Action.QUARANTINE
