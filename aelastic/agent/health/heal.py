"""The agent's side of the job's health: report failures, read the root cause, budget, quarantine.

How it works: the job's health is kept by the rendezvous itself (:mod:`aelastic.core.health`;
the state machine changes it only on a member's report of itself, and counts the hosts of
members dropped for their silence). When this node's workers fail (or stall and are
stopped), the agent turns its own root cause into a
:class:`~aelastic.core.health.FailureReport` and reports it (the rendezvous fills in the
host, the node, its rank and the round: :meth:`JobHealthKeeper.report_failure`); what it
reads back is the job's root cause, the same on every node, which it publishes
(:class:`~.events.JobFailure`). The health then says whether the job spent its job-wide
budget (``job_max_restarts``) and whether this host was the root cause ``quarantine_after``
times in a row: the policy turns that into FAIL or QUARANTINE, and this node reports its
own host set aside. A host the rendezvous counted lost ``quarantine_after`` times, or set
aside, makes its agent, back again, leave before joining (:meth:`before_rendezvous`). Every
call here is bounded in time and never fails the run: a rendezvous that cannot be reached
only costs the report.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import anyio

from ...core.errors import RendezvousError
from ...core.health import FailureReport, JobHealth, NodeReport
from ..api import ProcessFailure, RunResult, WorkerGroup, WorkerSpec, WorkerState
from ..events import JobFailure, Quarantined
from .errors import error_details

if TYPE_CHECKING:
    from ...rendezvous.handler import DynamicRendezvousHandler
    from ..output.publish import AgentPublisher

__all__ = ["JobHealthKeeper", "NodeQuarantined", "last_word"]

log = logging.getLogger("aelastic.agent")

#: Seconds a node whose worker broke in a collective waits for the peer at fault's report.
_PEER_GRACE = 3.0
#: Seconds between two reads of the health while it waits for that report.
_PEER_POLL = 0.2


def last_word(handler: DynamicRendezvousHandler) -> float:
    """How long the last requests (a report, a close, a leave) may take once the work is
    over: one heartbeat's timeout, not the backend's whole retry period (a store gone at the
    end of a job must not hold the launcher for minutes)."""
    settings = getattr(handler, "settings", None)
    return max(float(getattr(settings, "heartbeat_timeout", 5.0)), 1.0)


class NodeQuarantined(Exception):
    """This node's host was set aside (``--quarantine-after``): its agent left the job.

    Attributes:
        host: The host.
        reason: Why (root cause N times in a row, or lost N times).
    """

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"host {host} is quarantined: {reason}")
        self.host = host
        self.reason = reason


class JobHealthKeeper:
    """Reads the job's health and reports this node's part in it (see the module docstring).

    Args:
        spec: The worker spec (budget, quarantine; its handler is the rendezvous).
        events: The agent's publisher.
    """

    def __init__(self, spec: WorkerSpec, events: AgentPublisher) -> None:
        self._spec = spec
        self._handler = spec.rdzv_handler
        self._events = events
        self._host = self._handler.node.addr
        self._limit = 2 * last_word(self._handler)
        #: The health as last read (``None``: never read).
        self.health: JobHealth | None = None

    @property
    def failed_nodes(self) -> int:
        """Nodes that failed in the round of :attr:`health`'s newest incident."""
        latest = None if self.health is None else self.health.latest
        return 0 if latest is None else latest.failed

    async def read(self) -> JobHealth | None:
        """The health now (``None``: the rendezvous did not answer in time)."""
        with anyio.move_on_after(self._limit):
            try:
                self.health = await self._handler.health() or JobHealth()
                return self.health
            except RendezvousError as exc:
                log.warning("could not read the job's health: %s", exc)
        return None

    def _set_aside(self, health: JobHealth) -> str | None:
        """Why this host is set aside, by ``health`` (``None``: it is not)."""
        reason = health.quarantined.get(self._host)
        after = self._spec.quarantine_after
        lost = health.lost.get(self._host)
        if reason is None and after is not None and lost is not None and lost.count >= after:
            reason = f"lost {lost.count} times"
        return reason

    async def before_rendezvous(self) -> None:
        """Before each rendezvous (quarantine on): leave the job if this host is set aside.

        Raises:
            NodeQuarantined: It is.
        """
        if self._spec.quarantine_after is None:
            return
        health = await self.read()
        reason = None if health is None else self._set_aside(health)
        if reason is not None:
            raise await self.quarantine(reason)

    async def tell(self) -> None:
        """Read the job's health and publish its root cause, if any (the run ends)."""
        if await self.read() is not None:
            self.publish()

    async def report_failure(
        self, failures: Mapping[int, ProcessFailure], group: WorkerGroup
    ) -> tuple[str | None, str | None]:
        """Report this node's root cause to the job's health; publish the job's root cause.

        Returns:
            ``(quarantine, budget_spent)``: why this host is to be set aside, why the job
            must stop (each ``None`` when not).
        """
        root = RunResult(WorkerState.FAILED, failures=dict(failures)).root_cause
        assert root is not None
        report = FailureReport(
            time=root.timestamp,
            rank=root.global_rank,
            local_rank=root.local_rank,
            exitcode=root.exitcode,
            message=f"{error_details(root)}\n{root.message}"
            if root.stalled
            else error_details(root),
            stalled=root.stalled,
            secondary=root.secondary,
        )
        round_ = group.round or 0
        if report.secondary:  # the peer at fault most likely reports at once
            await self._wait_for_primary(round_)
        health: JobHealth | None = None
        with anyio.move_on_after(self._limit):
            try:
                if not await self._handler.report(NodeReport(failure=report)):
                    log.warning(
                        "the failure was not recorded in the job's health: this node is in "
                        "no complete round any more"
                    )
                health = await self.read()
            except RendezvousError as exc:
                log.warning("could not report the failure to the job's health: %s", exc)
        if health is None or health.latest is None:
            return None, None
        return self._judge(health, round_)

    async def _wait_for_primary(self, round_: int) -> None:
        """Until a failure of a worker itself (not one broken in a collective) is reported
        in ``round_``, or :data:`_PEER_GRACE` passed."""
        with anyio.move_on_after(_PEER_GRACE):
            while True:
                try:
                    health = await self._handler.health()
                except RendezvousError:
                    return
                latest = None if health is None else health.latest
                if latest is not None and latest.round >= round_ and not latest.root.secondary:
                    return
                await anyio.sleep(_PEER_POLL)

    def _judge(self, health: JobHealth, round_: int) -> tuple[str | None, str | None]:
        spec, latest = self._spec, health.latest
        assert latest is not None
        budget = None
        if spec.job_max_restarts is not None and health.incidents_total > spec.job_max_restarts:
            budget = (
                f"the job spent its budget of {spec.job_max_restarts} job-wide restart(s) "
                f"({health.incidents_total} failures)"
            )
        quarantine = None
        mine = latest.round == round_ and latest.root.host == self._host
        # A root cause that broke in a collective (no primary report came) names a victim
        # as likely as a culprit: it sets no host aside.
        mine = mine and not latest.root.secondary
        if mine and spec.quarantine_after is not None and latest.streak >= spec.quarantine_after:
            quarantine = f"the job's root cause {latest.streak} times in a row"
        self.publish()
        return quarantine, budget

    def publish(self) -> None:
        """Publish the job's root cause as last read (nothing when there is none)."""
        health, budget = self.health, self._spec.job_max_restarts
        if health is None or health.latest is None:
            return
        self._events.publish(
            JobFailure,
            root=health.latest.root.to_json(),
            failed_nodes=self.failed_nodes,
            incidents=health.incidents_total,
            job_max_restarts=self._spec.job_max_restarts,
            quarantined=tuple(sorted(health.quarantined)),
            budget_spent=budget is not None and health.incidents_total > budget,
        )

    async def quarantine(self, reason: str) -> NodeQuarantined:
        """Set this host aside in the job's health; publish it; the error the agent ends
        with."""
        with anyio.move_on_after(self._limit):
            try:
                await self._handler.report(NodeReport(quarantine=reason))
            except RendezvousError as exc:
                log.warning("could not record the quarantine: %s", exc)
        self._events.publish(Quarantined, host=self._host, reason=reason)
        return NodeQuarantined(self._host, reason)
