"""The agent's side of the job's health: report failures, read the root cause, budget, quarantine.

How it works: the job's health is one document in the run's store
(:mod:`aelastic.core.health`). When this node's workers fail (or stall and are stopped), the
agent turns its own root cause into a :class:`~aelastic.core.health.FailureRecord`, counts
itself among the round's failed nodes, and folds the record into the document with
compare-and-set (:meth:`JobHealthKeeper.report_failure`); what it reads back is the job's
root cause, the same on every node, which it publishes (:class:`~.events.JobFailure`). The
document then says whether the job spent its job-wide budget (``job_max_restarts``) and
whether this host was the root cause ``quarantine_after`` times in a row: the policy turns
that into FAIL or QUARANTINE. Members lost (silent, or gone without saying they restart)
are counted per host (:meth:`note_lost`); a quarantined host's agent, back again, leaves
before joining (:meth:`before_rendezvous`). Every store call here is bounded in time and
never fails the run: a store that cannot be reached only costs the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import anyio

from ..core.errors import RendezvousError, StoreTimeoutError
from ..core.health import (
    HEALTH_KEY,
    FailureRecord,
    JobHealth,
    failed_key,
    primary_key,
    with_failure,
    with_lost,
    with_quarantined,
)
from ..core.store import Store
from ._services import last_word
from .api import ProcessFailure, RunResult, WorkerGroup, WorkerSpec, WorkerState
from .errors import error_details
from .events import JobFailure, Quarantined
from .policy import Observation

if TYPE_CHECKING:
    from ._publish import AgentPublisher
    from .membership import RoundGroup

__all__ = ["JobHealthKeeper", "NodeQuarantined"]

log = logging.getLogger("aelastic.agent")

#: Compare-and-set attempts per update (each loses only to another node's update).
_TRIES = 8
#: Seconds a node whose worker broke in a collective waits for the peer at fault's report.
_PEER_GRACE = 3.0


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
    """Reads and updates the job's health for one agent (see the module docstring).

    Args:
        spec: The worker spec (budget, quarantine).
        events: The agent's publisher.
    """

    def __init__(self, spec: WorkerSpec, events: AgentPublisher) -> None:
        handler = spec.rdzv_handler
        self._spec = spec
        self._events = events
        self._store = Store(handler.backend)  # run-wide keys, not a round's
        self._host = handler.node.addr
        self._limit = 2 * last_word(handler)
        #: The document as last read (``None``: never read).
        self.health: JobHealth | None = None
        #: Nodes that failed in the round of :attr:`health`'s newest incident.
        self.failed_nodes = 0

    async def _update(self, change: Callable[[JobHealth], JobHealth | None]) -> JobHealth:
        health = JobHealth()
        for _ in range(_TRIES):
            raw = await self._store.try_get(HEALTH_KEY)
            health = self._decode(raw)
            updated = change(health)
            if updated is None:
                break
            data = updated.encode()
            if await self._store.compare_set(HEALTH_KEY, raw or b"", data) == data:
                health = updated
                break
        self.health = health
        return health

    @staticmethod
    def _decode(raw: bytes | None) -> JobHealth:
        try:
            return JobHealth.decode(raw)
        except ValueError as exc:
            log.warning("the job's health record is unreadable, starting a new one: %s", exc)
            return JobHealth()

    async def read(self) -> JobHealth | None:
        """The document now (``None``: the store did not answer in time)."""
        with anyio.move_on_after(self._limit):
            try:
                self.health = self._decode(await self._store.try_get(HEALTH_KEY))
                latest = self.health.latest
                if latest is not None:
                    count = await self._store.try_get(failed_key(latest.round))
                    self.failed_nodes = int(count or 0)
                return self.health
            except (RendezvousError, ValueError) as exc:
                log.warning("could not read the job's health record: %s", exc)
        return None

    async def before_rendezvous(self, previous: RoundGroup | None) -> None:
        """Before each rendezvous (quarantine on): say that this node leaves its previous
        round on purpose (:meth:`leaving`), then leave the job if its host is set aside.

        Raises:
            NodeQuarantined: It is.
        """
        if self._spec.quarantine_after is None:
            return
        await self.leaving(previous)
        health = await self.read()
        reason = None if health is None else health.quarantined.get(self._host)
        if reason is not None:
            self._events.publish(Quarantined, host=self._host, reason=reason)
            raise NodeQuarantined(self._host, reason)

    async def observe(
        self,
        observation: Observation,
        failures: Mapping[int, ProcessFailure],
        group: WorkerGroup,
    ) -> Observation:
        """``observation`` with what the job's health adds: after this node's failures,
        whether its host is set aside or the job spent its budget; after a change of the
        group, the lost hosts are counted (quarantine on)."""
        if failures:
            quarantine, budget = await self.report_failure(failures, group)
            return replace(observation, quarantine=quarantine, job_budget_spent=budget)
        if observation.lost_hosts:
            await self.note_lost(observation.lost_hosts, group.round or 0)
        return observation

    async def leaving(self, round_group: RoundGroup | None) -> None:
        """Say in the round's store that this node leaves to restart or rescale, so that
        the others do not count it lost (quarantine on)."""
        if self._spec.quarantine_after is None or round_group is None:
            return
        with anyio.move_on_after(self._limit):
            try:
                await round_group.mark_leaving(self._spec.rdzv_handler.node)
            except RendezvousError as exc:
                log.warning("could not say that this node restarts: %s", exc)

    async def tell(self) -> None:
        """Read the job's health and publish its root cause, if any (the run ends)."""
        if await self.read() is not None:
            self.publish()

    async def report_failure(
        self, failures: Mapping[int, ProcessFailure], group: WorkerGroup
    ) -> tuple[str | None, str | None]:
        """Fold this node's root cause into the job's health; publish the job's root cause.

        Returns:
            ``(quarantine, budget_spent)``: why this host is to be set aside, why the job
            must stop (each ``None`` when not).
        """
        root = RunResult(WorkerState.FAILED, failures=dict(failures)).root_cause
        assert root is not None
        round_ = group.round or 0
        record = FailureRecord(
            time=root.timestamp,
            host=self._host,
            node=self._spec.rdzv_handler.node.key,
            node_rank=group.group_rank or 0,
            rank=root.global_rank,
            local_rank=root.local_rank,
            exitcode=root.exitcode,
            message=f"{error_details(root)}\n{root.message}"
            if root.stalled
            else error_details(root),
            round=round_,
            stalled=root.stalled,
            secondary=root.secondary,
        )
        health: JobHealth | None = None
        if record.secondary:  # the peer at fault most likely reports at once
            with anyio.move_on_after(_PEER_GRACE), suppress(StoreTimeoutError, RendezvousError):
                await self._store.wait([primary_key(round_)], _PEER_GRACE)
        with anyio.move_on_after(self._limit):
            try:
                self.failed_nodes = await self._store.add(failed_key(round_), 1)
                health = await self._update(lambda h: with_failure(h, record))
                if not record.secondary:
                    await self._store.set(primary_key(round_), b"1")
                self.failed_nodes = int(await self._store.try_get(failed_key(round_)) or 0)
            except RendezvousError as exc:
                log.warning("could not report the failure to the job's health record: %s", exc)
        if health is None or health.latest is None:
            return None, None
        return self._judge(health, round_)

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
        """Record this host as set aside; publish it; the error the agent ends with."""
        with anyio.move_on_after(self._limit):
            try:
                await self._update(lambda h: with_quarantined(h, self._host, reason))
            except RendezvousError as exc:
                log.warning("could not record the quarantine: %s", exc)
        self._events.publish(Quarantined, host=self._host, reason=reason)
        return NodeQuarantined(self._host, reason)

    async def note_lost(self, hosts: tuple[str, ...], round_: int) -> None:
        """Count each of ``hosts`` as lost in ``round_`` (quarantine on only)."""
        after = self._spec.quarantine_after
        if after is None:
            return
        with anyio.move_on_after(self._limit):
            try:
                for host in hosts:  # a host another survivor counted already costs a read
                    await self._update(
                        partial(with_lost, host=host, round_=round_, quarantine_after=after)
                    )
            except RendezvousError as exc:
                log.warning("could not count the lost node(s): %s", exc)
