"""What an agent runs beside its workers, for the whole of ``run()``.

How it works: :func:`agent_services` is entered once per run, before the first rendezvous, and left
after the shutdown. It routes the backend's retries into the agent's events (the handler's
``reporting()``), checks ``numa_binding`` against this machine at once (a job that cannot be bound
fails before it joins anyone, not after its first rendezvous), and serves the health check when
``TORCHELASTIC_HEALTH_CHECK_PORT`` is set (:mod:`aelastic.agent.health.check`). A bad port value or
a port in use is logged and the run goes on without it (torch's agent logs an invalid value and goes
on too); ``aelastic run`` checks the value before starting. The check answers unhealthy from a
worker's stall until the next workers start, and for good once workers outlived SIGKILL
(:class:`_Liveness`, a listener on the agent's events).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from ...core.events import Event, EventKind
from ..health.check import HealthServer, health_port
from ..processes.numa import bindings

if TYPE_CHECKING:
    from ..api import WorkerGroup, WorkerSpec


class Served(Protocol):
    """What the services need of the agent they serve (its public face)."""

    @property
    def spec(self) -> WorkerSpec: ...

    @property
    def restart_count(self) -> int: ...

    def get_worker_group(self, role: str = ...) -> WorkerGroup: ...

    def add_listener(self, callback: Callable[[Event], object]) -> Callable[[], None]: ...


__all__ = ["Served", "agent_services"]

log = logging.getLogger("aelastic.agent")


@contextlib.asynccontextmanager
async def agent_services(agent: Served) -> AsyncIterator[None]:
    """The services of ``agent`` for the duration of the block (see the module docstring).

    Raises:
        NumaBindingError: ``spec.numa_binding`` cannot be applied on this machine.
    """
    spec = agent.spec
    if spec.numa_binding is not None:
        bindings(spec.numa_binding, spec.local_world_size)
    with spec.rdzv_handler.reporting():
        health = await _health(agent)
        try:
            yield
        finally:
            if health is not None:
                await health.aclose()


async def _health(agent: Served) -> HealthServer | None:
    try:
        port = health_port()
    except ValueError as exc:
        log.warning("%s: no health check served", exc)
        return None
    if port is None:
        return None
    handler = agent.spec.rdzv_handler
    liveness = _Liveness()

    def status() -> dict[str, object]:
        return {
            "state": agent.get_worker_group().state.value,
            "restart_count": agent.restart_count,
            "run_id": handler.get_run_id(),
            **liveness.fields(),
        }

    server = HealthServer(port, status)
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot serve the health check on port %d: %s", port, exc.strerror or exc)
        return None
    unsubscribe = agent.add_listener(liveness)
    server.on_close(unsubscribe)
    return server


class _Liveness:
    """Whether the node is alive, as its events tell: not while its workers are stalled
    (until new workers start), never again once workers outlived SIGKILL."""

    def __init__(self) -> None:
        self._reason: str | None = None
        self._final = False

    def __call__(self, event: Event) -> None:
        if self._final:
            return
        if event.kind is EventKind.WORKER_STALLED:
            data = event.data
            self._reason = f"rank {data['global_rank']} stalled at {data.get('where') or '?'}"
        elif event.kind is EventKind.UNKILLABLE:
            self._reason, self._final = "workers outlived SIGKILL", True
        elif event.kind in (EventKind.WORKERS_STARTED, EventKind.WORKERS_RECOVERED):
            self._reason = None

    def fields(self) -> dict[str, object]:
        if self._reason is None:
            return {}
        return {"alive": False, "reason": self._reason}
