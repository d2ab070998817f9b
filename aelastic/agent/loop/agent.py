"""The elastic agent: rendezvous, start workers, await what happens, act, stop cleanly.

How it works (one attempt per loop turn)::

    rendezvous (the join says the node's workers) -> its answer: ranks, MASTER_ADDR/PORT
        -> start workers (group rank 0 keeps the master port bound until the spawn)
        -> wait for the FIRST of: a worker exit, a change of the rendezvous group, a stall
        -> a failure that broke in a collective: a member lost within the heartbeat window
           explains it (a rescale, no restart spent)
        -> after a failure, the job's health (root cause, budget, quarantine)
        -> policy.decide(observation, restarts_left) -> finish | restart | rescale | fail | ...

The agent composes the run's objects and hands each step what it needs: the workers,
attempt after attempt (:class:`~aelastic.agent.loop.attempt.Attempts`: the worker set, the
spares, the master port, the beat the workers watch), what the run holds for its length
(:class:`~aelastic.agent.loop.run.RunPlace`: directories, fork server, its seat and round),
a peer's loss (:class:`~aelastic.agent.loop.recover.PeerLoss`, with the channel to the
workers) and the job's health (:class:`~aelastic.agent.health.heal.JobHealthKeeper`). A
rescale keeps workers that recover in place (every local worker alive and opted in): they
are told the group changes, the agent re-rendezvouses and sends them their new ranks
instead of restarting them.

Nothing polls: worker exits are awaited (pidfds), group changes come from
``handler.watch()``, which the backend wakes. On success the node says it is done (a request
of its own to the rendezvous) and waits at the exit barrier; once every member is done, the
job is over and the rendezvous is closed. Whatever ends ``run()`` (return, error,
cancellation), the cleanup runs to the end, shielded (:mod:`aelastic.agent.loop.ending`, the
one place a run ends). ``run_sync()`` runs it on a private event loop
(:mod:`aelastic.agent.loop.blocking`).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from ...core.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    typed,
)
from ...core.events import Event
from ...core.health import JobHealth
from ..api import DEFAULT_ROLE, ProcessFailure, RunResult, WorkerGroup, WorkerSpec, WorkerState
from ..events import AgentMetrics, EventKind, EventStream, Restart
from ..health.errors import format_failures
from ..health.heal import JobHealthKeeper
from ..output.publish import AgentPublisher
from ..processes.beat import AgentBeat
from .aio import uncancellable
from .attempt import Attempts
from .blocking import run_blocking
from .ending import finish, shutdown
from .policy import Action, Decision, Trigger, decide
from .recover import PeerLoss
from .round import form_round, prepare_join
from .run import RunPlace
from .services import agent_services
from .supervise import supervise

__all__ = ["ElasticAgent"]

log = logging.getLogger("aelastic.agent")


class ElasticAgent:
    """Runs the workers of one node under an elastic rendezvous (torch's ``LocalElasticAgent``).

    ``run()`` installs no signal handler and never blocks the event loop; cancelling it
    stops every worker, leaves the rendezvous and returns with no worker process left.

    Args:
        spec: What to run and how.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self._handler = spec.rdzv_handler
        self._group = WorkerGroup(spec)
        self._events = AgentPublisher(self._handler, self._group, spec.role)
        self._restarts_left = spec.max_restarts
        self._used = False
        self._heal = JobHealthKeeper(spec, self._events)
        self._place = RunPlace(spec)  # directories, fork server, seat in the rendezvous
        self._peer = PeerLoss(self._handler)  # a peer's loss: no restart, workers kept
        # The workers, attempt after attempt; the beat they watch (a frozen agent's workers
        # stop by themselves).
        beat = AgentBeat(self._handler)
        self._attempts = Attempts(self._group, self._events, self._peer.channel, beat)

    def __repr__(self) -> str:
        return f"ElasticAgent(role={self._spec.role!r}, group={self._group!r})"

    @property
    def spec(self) -> WorkerSpec:
        """The spec this agent runs."""
        return self._spec

    @property
    def metrics(self) -> AgentMetrics:
        """Counters and durations so far (a snapshot)."""
        return self._events.metrics

    @property
    def restart_count(self) -> int:
        """Restarts spent so far (``TORCHELASTIC_RESTART_COUNT`` of the current workers)."""
        return self._spec.max_restarts - self._restarts_left

    @property
    def job_health(self) -> JobHealth | None:
        """The job's health as this agent last read it from the rendezvous store (its
        root cause, restarts spent, quarantined hosts), or ``None``."""
        return self._heal.health

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The current worker group (torch's accessor; ``role`` is accepted and ignored)."""
        return self._group

    def add_listener(self, callback: Callable[[Event], object]) -> Callable[[], None]:
        """Call ``callback(event)`` on the agent's loop for every event of the agent and of its
        rendezvous handler (one typed model, :mod:`aelastic.core.events`).

        Returns:
            A function that unsubscribes ``callback``.
        """
        return self._handler.hub.add_listener(callback)

    def events(self) -> EventStream:
        """Subscribe now; iterate the events with ``async for`` until the run's ``Finished``."""
        return self._handler.hub.stream(until=EventKind.FINISHED)

    def forward_signal(self, sig: int) -> None:
        """Stop the workers with ``sig`` instead of SIGTERM (then the grace, then SIGKILL),
        as torchrun forwards the signal it got: call it on receiving ``sig``, then cancel
        :meth:`run` (``aelastic run`` and :meth:`run_sync` do)."""
        self._attempts.stop_signal = sig

    # -- entry points ---------------------------------------------------------------------

    async def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers until they succeed, fail for good, or this call is cancelled.

        Returns:
            ``RunResult(SUCCEEDED, return_values)`` or ``RunResult(FAILED, failures)``,
            keyed by global rank; ``result.root_cause`` is the earliest failure.

        Raises:
            RendezvousError: The rendezvous failed (timeout, closed by another node while
                this one had no failure of its own, backend unreachable, ...).
            OSError: A worker command could not be started.
            NumaBindingError: ``spec.numa_binding`` cannot be applied on this machine.
            RuntimeError: This agent already ran (an agent runs once).
        """
        if self._used:
            raise RuntimeError("an ElasticAgent runs once: make a new one")
        self._used = True
        result: RunResult | None = None
        error: BaseException | None = None
        try:
            self._place.open(self._handler.get_run_id())  # a callable's fork server too
            async with agent_services(self):  # events of the store, NUMA check, health check
                result = await self._invoke_run()
            return result
        except BaseException as exc:
            error = exc
            raise
        finally:
            end = shutdown(
                self._attempts, self._place, self._peer, self._handler, self._events, result, error
            )
            await uncancellable(end)

    def run_sync(
        self, role: str = DEFAULT_ROLE, *, signals: tuple[signal.Signals, ...] | None = None
    ) -> RunResult:
        """:meth:`run` on a private event loop, for plain scripts; releases the handler after.

        Works from any thread that is not itself running an event loop (another thread may
        run one). In the main thread, as torch's agent, the signals of
        ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default)
        stop the workers with that same signal, the grace period, then SIGKILL, even if
        inherited ignored; a handler of the program's own is left alone. ``signals``
        replaces that list.

        Raises:
            KeyboardInterrupt: SIGINT stopped the run.
            SignalException: Another handled signal stopped the run (``sigval``).
            RuntimeError: Called from a thread whose event loop is running (use ``await run()``).
        """
        if self._used:
            raise RuntimeError("an ElasticAgent runs once: make a new one")
        return run_blocking(
            lambda: self.run(role),
            prefork=self._place.prefork,
            forward=self.forward_signal,
            release=self._handler.aclose,
            signals=signals,
        )

    # -- the loop -------------------------------------------------------------------------

    async def _invoke_run(self) -> RunResult:
        spec, attempts, place = self._spec, self._attempts, self._place
        log.info(
            "agent for role '%s' starting %d worker(s) of %s, run '%s'",
            spec.role,
            spec.local_world_size,
            spec.get_entrypoint_name(),
            self._handler.get_run_id(),
        )
        failures: dict[int, ProcessFailure] = {}
        interrupted_at: float | None = None  # the earliest sign of what ended an attempt
        await self._peer.channel.start()
        attempts.beat.start()
        attempts.standbys.schedule()  # a spare's workers are warm before it has a rank
        while True:
            try:
                await self._heal.before_rendezvous()
                await self._rendezvous()
            except RendezvousGracefulExitError as exc:
                log.info("rendezvous gracefully exited: %s", exc)
                return RunResult(WorkerState.SUCCEEDED)
            except RendezvousError as exc:
                if failures:  # our own failure is the root cause, the rendezvous the end
                    return self._failed(failures, f"no restart ({typed(exc)})")
                raise
            failures = {}
            if not (self._peer.held and self._resume(interrupted_at)):
                await attempts.stop(WorkerState.STOPPED)  # held ones that cannot resume
                await attempts.start(place, self.restart_count, interrupted_at)
            round_group, workers = place.round, attempts.workers
            assert round_group is not None and workers is not None
            observation, failures = await supervise(
                workers,
                self._group,
                round_group,
                self._events,
                self._restarts_left,
                self._peer.channel,
                self._peer.grace,
                spec.recovery_timeout,
                attempts.beat,
                partial(self._peer.check_departures, round_group),
            )
            interrupted_at = self._peer.interrupted_at(workers)
            if (explained := await self._peer.explain(failures, round_group)) is not None:
                observation, failures = explained, {}  # a peer's loss broke our collective
            if failures:  # the job's health: is this host set aside, the budget spent?
                quarantine, budget = await self._heal.report_failure(failures, self._group)
                observation = replace(observation, quarantine=quarantine, job_budget_spent=budget)
            decision = decide(observation, self._restarts_left)
            action = decision.action
            if action is Action.FINISH:
                return await finish(attempts, place, self._handler, self._group, self._events)
            if action is Action.FAIL:
                await attempts.stop(WorkerState.FAILED)
                await self._heal.tell()  # the job's root cause as it stands now
                return self._failed(failures, decision.reason)
            if action is Action.QUARANTINE:
                await attempts.stop(WorkerState.FAILED)
                raise await self._heal.quarantine(decision.reason)
            if action is Action.RESTART:
                log.warning(
                    "worker group failed, restarting (%d restarts left):\n%s",
                    self._restarts_left - 1,
                    format_failures(RunResult(WorkerState.FAILED, failures=place.kept(failures))),
                )
                await attempts.stop(WorkerState.FAILED)
                self._restarts_left -= 1
                self._events.restart_count = self.restart_count
                self._events.publish(
                    Restart, reason=decision.reason, spent=True, restarts_left=self._restarts_left
                )
                continue
            keep = observation.trigger is Trigger.MEMBERSHIP_CHANGED
            await self._act_on_membership(decision, keep=keep)

    async def _act_on_membership(self, decision: Decision, keep: bool = False) -> None:
        if not (keep and self._peer.hold(decision, self._attempts.workers)):
            self._peer.held = False
            await self._attempts.stop(WorkerState.STOPPED)
        if decision.action is Action.ABORT:
            await self._heal.tell()
            raise RendezvousClosedError(f"stopping the workers: {decision.reason}")
        kept = " (workers kept: in-place recovery)" if self._peer.held else ""
        log.info("re-rendezvous without spending a restart%s: %s", kept, decision.reason)
        self._events.publish(
            Restart, reason=decision.reason, spent=False, restarts_left=self._restarts_left
        )

    def _resume(self, interrupted_at: float | None) -> bool:
        workers = self._attempts.workers
        assert workers is not None
        return self._peer.resume(
            self._group,
            workers,
            self._events,
            self.restart_count,
            interrupted_at,
            before_send=self._attempts.port.release,  # group rank 0's workers bind it now
        )

    def _failed(self, failures: dict[int, ProcessFailure], reason: str) -> RunResult:
        result = RunResult(WorkerState.FAILED, failures=self._place.kept(failures))
        self._events.set_state(WorkerState.FAILED)
        root = result.root_cause  # the report is the caller's (format_failures, a launcher)
        where = "" if root is None else f" (root cause: rank {root.global_rank})"
        log.error("workers of role '%s' failed: %s%s", self._spec.role, reason, where)
        return result

    # -- rendezvous and ranks -------------------------------------------------------------

    async def _rendezvous(self) -> None:
        self._events.set_state(WorkerState.INIT)
        started = time.monotonic()
        port = self._attempts.port
        prepare_join(self._handler, self._spec, port)
        info = await self._handler.next_rendezvous()
        self._place.joined = True
        self._place.round = await form_round(
            self._handler, info, self._group, port, self._events, started
        )
