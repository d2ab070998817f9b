"""What the agent does about what it observed: a pure function, tested without processes.

How it works: the agent watches its workers and the rendezvous group at the same time; the
first thing that happens becomes an :class:`Observation`, and :func:`decide` maps it, with
the restarts left, to a :class:`Decision`. The agent only carries the decision out.

* All local workers succeeded -> FINISH (exit barrier, then SUCCEEDED).
* A worker failed (or stalled, and was stopped: when a worker is hung is
  :mod:`aelastic.agent.health.hang_rule`'s) -> QUARANTINE when this node's host is to
  be set aside (:mod:`aelastic.core.health`), FAIL when the job spent its job-wide budget,
  else RESTART (spends one restart) while restarts remain, else FAIL.
* Workers kept for in-place recovery did not join their new group in time -> RESCALE
  (they are stopped and started again the old way; no restart spent).
* The agent did not run past the deadline its workers watch (it was frozen), and they
  stopped themselves -> RESCALE (its peers may have dropped the node: no restart spent, as
  for a node removed from its round).
* The group changed:
  - the run was closed by another node -> ABORT (the job is over for everybody);
  - this node was removed from its round, or a member is lost (left, or silent past the
    heartbeat window) without having finished -> RESCALE (re-rendezvous, no restart spent);
  - nodes wait to join -> RESCALE, unless some member already finished (the job is
    draining: scaling up now would restart the others for nothing) -> CONTINUE;
  - only members that finished are lost -> CONTINUE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Action", "Decision", "Observation", "Trigger", "decide"]


class Trigger(enum.Enum):
    """What woke the agent up."""

    WORKERS_SUCCEEDED = "workers_succeeded"
    WORKER_FAILED = "worker_failed"
    MEMBERSHIP_CHANGED = "membership_changed"
    RECOVERY_TIMED_OUT = "recovery_timed_out"
    AGENT_LAPSED = "agent_lapsed"


class Action(enum.Enum):
    """What the agent does next."""

    FINISH = "finish"  # exit barrier, then SUCCEEDED
    RESTART = "restart"  # stop the workers, spend a restart, re-rendezvous
    RESCALE = "rescale"  # stop the workers, re-rendezvous without spending a restart
    FAIL = "fail"  # stop the workers, FAILED
    ABORT = "abort"  # stop the workers: the run was closed elsewhere
    QUARANTINE = "quarantine"  # stop the workers, leave the job: this host is set aside
    CONTINUE = "continue"  # keep the workers running


@dataclass(frozen=True)
class Observation:
    """What happened, as the policy needs to know it.

    Attributes:
        trigger: The kind of event.
        closed: The rendezvous was closed.
        removed: This node is no longer a member of its round.
        lost: Members of the round that are gone without having finished.
        lost_finished: Members that are gone after their workers succeeded.
        waiting: Nodes waiting to join the next round.
        peers_finished: Some member of the round already finished (its workers succeeded).
        quarantine: Why this node's host is set aside (``None``: it is not).
        job_budget_spent: Why the job spent its job-wide restart budget (``None``: it did
            not, or there is none).
    """

    trigger: Trigger
    closed: bool = False
    removed: bool = False
    lost: int = 0
    lost_finished: int = 0
    waiting: int = 0
    peers_finished: bool = False
    quarantine: str | None = None
    job_budget_spent: str | None = None


@dataclass(frozen=True)
class Decision:
    """An action and why."""

    action: Action
    reason: str


def decide(observation: Observation, restarts_left: int) -> Decision:
    """Decide what the agent does about ``observation``.

    Args:
        observation: What happened.
        restarts_left: Restarts the agent may still spend on worker failures.

    Returns:
        The action to take and a human-readable reason.
    """
    trigger = observation.trigger
    if trigger is Trigger.WORKERS_SUCCEEDED:
        return Decision(Action.FINISH, "all local workers succeeded")
    if trigger is Trigger.WORKER_FAILED:
        if observation.quarantine:
            return Decision(Action.QUARANTINE, observation.quarantine)
        if observation.job_budget_spent:
            return Decision(Action.FAIL, observation.job_budget_spent)
        if restarts_left > 0:
            return Decision(Action.RESTART, f"a worker failed ({restarts_left} restarts left)")
        return Decision(Action.FAIL, "a worker failed and no restarts are left")
    if trigger is Trigger.RECOVERY_TIMED_OUT:
        return Decision(Action.RESCALE, "workers did not recover in place in time: restarting")
    if trigger is Trigger.AGENT_LAPSED:
        return Decision(
            Action.RESCALE, "this agent was frozen past its heartbeat window: its workers stopped"
        )
    return _membership(observation)


def _membership(obs: Observation) -> Decision:
    if obs.closed:
        return Decision(Action.ABORT, "the rendezvous was closed by another node")
    if obs.removed:
        return Decision(Action.RESCALE, "this node was removed from its round")
    if obs.lost:
        return Decision(Action.RESCALE, f"{obs.lost} member(s) of the round lost")
    if obs.waiting and not obs.peers_finished:
        return Decision(Action.RESCALE, f"{obs.waiting} node(s) waiting to join")
    if obs.waiting:
        return Decision(Action.CONTINUE, "nodes waiting, but the job is finishing")
    return Decision(Action.CONTINUE, f"{obs.lost_finished} member(s) left after succeeding")
