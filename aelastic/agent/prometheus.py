"""Prometheus metrics of an agent: a listener on the event model and a ``GET /metrics`` server.

How it works: :class:`AgentCollector` subscribes to the agent's events (one typed model,
:mod:`aelastic.core.events`) and keeps prometheus_client metrics in a registry of its own
(no global state: several agents in one process never clash): rendezvous rounds and their
duration, restarts and membership changes by reason, the worker group's state, the world
size and local workers, worker start latency, backend retries and errors, exit-barrier
time. :func:`serve_metrics` serves the registry's text format (``generate_latest``) with
aiohttp on the agent's own event loop, so scraping never blocks the loop nor needs a thread.
prometheus_client and aiohttp are the optional extra ``metrics``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.events import BackendError, BackendRetry, Event
from .api import WorkerState
from .events import (
    ExitBarrier,
    MembershipChanged,
    RendezvousCompleted,
    Restart,
    StateChanged,
    WorkerExited,
    WorkersStarted,
)

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["AgentCollector", "MetricsPortInUse", "serve_metrics"]

_MISSING = "the agent's metrics need prometheus_client and aiohttp: pip install 'aelastic[metrics]'"

#: Buckets of durations in seconds (rendezvous, starts, recovery): 1 ms to 10 min.
_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class MetricsPortInUse(OSError):
    """The metrics port is taken by another process."""


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(_MISSING) from None
    return prometheus_client


class AgentCollector:
    """The Prometheus metrics of one agent, updated by its events.

    Args:
        run_id, node, role, backend: Shown by ``aelastic_agent_info``.

    Raises:
        ImportError: prometheus_client is missing (names the extra).
    """

    def __init__(self, run_id: str, node: str, role: str, backend: str) -> None:
        pc = _prometheus()
        self.registry = registry = pc.CollectorRegistry(auto_describe=True)
        info = pc.Info("aelastic_agent", "The agent's job", registry=registry)
        info.info({"run_id": run_id, "node": node, "role": role, "backend": backend})
        self._round = pc.Gauge(
            "aelastic_rendezvous_round", "Round of the last completed rendezvous", registry=registry
        )
        self._rendezvous = pc.Histogram(
            "aelastic_rendezvous_duration_seconds",
            "Rendezvous rounds (count) and the seconds each took, rank assignment included",
            buckets=_BUCKETS,
            registry=registry,
        )
        self._restarts = pc.Counter(
            "aelastic_restarts", "Restarts of the workers", ["reason"], registry=registry
        )
        self._membership = pc.Counter(
            "aelastic_membership_changes",
            "Changes of the rendezvous group (node_waiting, member_lost, member_left, ...)",
            ["reason"],
            registry=registry,
        )
        self._state = pc.Gauge(
            "aelastic_worker_group_state",
            "1 for the worker group's current state, 0 for the others",
            ["state"],
            registry=registry,
        )
        self._world = pc.Gauge("aelastic_world_size", "Workers in the job", registry=registry)
        self._nodes = pc.Gauge("aelastic_nodes", "Nodes in the current round", registry=registry)
        self._local = pc.Gauge(
            "aelastic_local_workers", "Workers running on this node", registry=registry
        )
        self._start = pc.Histogram(
            "aelastic_worker_start_seconds",
            "Seconds to start the workers of an attempt",
            buckets=_BUCKETS,
            registry=registry,
        )
        self._recovery = pc.Histogram(
            "aelastic_recovery_seconds",
            "Seconds from the earliest sign of what ended an attempt to the next attempt's start",
            buckets=_BUCKETS,
            registry=registry,
        )
        self._exits = pc.Counter(
            "aelastic_worker_exits", "Workers that exited", ["outcome"], registry=registry
        )
        self._retries = pc.Counter(
            "aelastic_backend_retries",
            "Backend calls that failed and were retried",
            ["backend"],
            registry=registry,
        )
        self._errors = pc.Counter(
            "aelastic_backend_errors",
            "Backend calls that failed for good",
            ["backend"],
            registry=registry,
        )
        self._barrier = pc.Gauge(
            "aelastic_exit_barrier_seconds", "Seconds spent at the exit barrier", registry=registry
        )
        self._generate: Callable[[Any], bytes] = pc.generate_latest
        self.content_type: str = pc.CONTENT_TYPE_LATEST
        self._last_change = "membership_changed"
        self._set_state(WorkerState.INIT)
        for reason in ("node_waiting", "member_lost", "member_left"):  # shown from the start
            self._membership.labels(reason)
            self._restarts.labels(reason)
        self._restarts.labels("worker_failed")
        self._retries.labels(backend)
        self._errors.labels(backend)

    def _set_state(self, state: WorkerState) -> None:
        for each in WorkerState:
            self._state.labels(each.value).set(1 if each is state else 0)

    def __call__(self, event: Event) -> None:
        """Update the metrics with ``event`` (the listener)."""
        if isinstance(event, RendezvousCompleted):
            self._rendezvous.observe(event.duration)
            self._round.set(event.round or 0)
            self._world.set(event.world_size)
            self._nodes.set(event.group_world_size)
        elif isinstance(event, WorkersStarted):
            self._start.observe(event.duration)
            self._local.set(len(event.pids))
            if event.recovery is not None:
                self._recovery.observe(event.recovery)
        elif isinstance(event, StateChanged):
            self._set_state(event.state)
        elif isinstance(event, MembershipChanged):
            self._membership.labels(event.reason).inc()
            self._last_change = event.reason
        elif isinstance(event, Restart):
            self._restarts.labels("worker_failed" if event.spent else self._last_change).inc()
        elif isinstance(event, WorkerExited):
            self._exits.labels("succeeded" if event.exitcode == 0 else "failed").inc()
        elif isinstance(event, ExitBarrier):
            self._barrier.set(event.duration)
        elif isinstance(event, BackendRetry):
            self._retries.labels(event.backend).inc()
        elif isinstance(event, BackendError):
            self._errors.labels(event.backend).inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return self._generate(self.registry)


async def serve_metrics(collector: AgentCollector, port: int, host: str = "") -> web.AppRunner:
    """Serve ``GET /metrics`` on ``host:port`` on the running loop; clean up with
    ``await runner.cleanup()``.

    Raises:
        ImportError: aiohttp is missing (names the extra).
        MetricsPortInUse: The port is taken.
        OSError: The port cannot be bound otherwise.
    """
    try:
        from aiohttp import web
    except ImportError:
        raise ImportError(_MISSING) from None

    async def metrics(request: web.Request) -> web.Response:
        body = collector.exposition()
        return web.Response(body=body, headers={"Content-Type": collector.content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host or None, port).start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:
            raise MetricsPortInUse(
                exc.errno, f"the metrics port {port} is in use (another process has it)"
            ) from None
        raise
    return runner
