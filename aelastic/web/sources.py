"""Where the pages read runs: the HTTP server's own engine, or any backend by name.

How it works: a :class:`RunSource` lists runs, reads one run's snapshot, and waits until
its status's token moves (a round transition, a member lost, the run closed: never a
heartbeat) or a timeout passes. :class:`EngineSource` reads the runs an ``aelastic serve``
keeps in its event loop (:class:`~aelastic.backends._engine.Engine`): waiting is a waiter
on the run, woken by the same notification long-polling nodes get. :class:`BackendSource`
opens backends through the registry (Redis, a remote HTTP server, a third party's), one per
watched run, and waits with their ``wait_for_change`` (Redis: the pub/sub listener of the
process; HTTP: one long-poll); listing needs a backend that is a
:class:`~aelastic.core.protocol.RunLister`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from ..backends._engine import Engine, now_ms
from ..backends.registry import create_backend
from ..core.errors import RendezvousConnectionError
from ..core.health import JobHealth
from ..core.params import RendezvousParameters
from ..core.protocol import RendezvousBackend, RunLister
from ..core.state import Snapshot, Status

__all__ = ["BackendSource", "EngineSource", "RunSource"]

#: The run id of the backend a :class:`BackendSource` lists runs with (it never reads it).
_LISTER_RUN = "aelastic-dashboard"


class RunSource(Protocol):
    """What the pages read (see the module docstring)."""

    #: Where the runs are, for the page's header (never with credentials).
    where: str

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        """Runs with a rendezvous state, sorted by id, at most ``limit``."""

    async def snapshot(self, run_id: str) -> Snapshot | None:
        """The run's whole membership, ``None`` when it has no rendezvous state."""

    async def wait_for_change(self, run_id: str, token: str, timeout: float) -> None:
        """Return when the run's status token differs from ``token``, or after ``timeout``."""

    async def health(self, run_id: str) -> JobHealth | None:
        """The job's health of the run (``None``: no such run); never waits."""

    async def release(self, run_id: str) -> None:
        """Nobody watches ``run_id`` any more: free what reading it holds."""

    async def aclose(self) -> None:
        """Free everything."""


class EngineSource:
    """The runs of an HTTP rendezvous server, read in its own event loop.

    Args:
        engine: The server's runs.
        where: How the page names the server.
    """

    def __init__(self, engine: Engine, where: str = "this rendezvous server") -> None:
        self._engine = engine
        self.where = where

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        return self._engine.list_runs(now_ms(), limit)

    async def snapshot(self, run_id: str) -> Snapshot | None:
        return self._engine.snapshot(run_id, now_ms())

    async def wait_for_change(self, run_id: str, token: str, timeout: float) -> None:
        if run_id in self._engine.runs:
            await self._engine.wait_status(run_id, token, timeout)
        else:  # waiting would make the run: it is gone, look again later
            await asyncio.sleep(timeout)

    async def health(self, run_id: str) -> JobHealth | None:
        return self._engine.health(run_id)

    async def release(self, run_id: str) -> None:
        """Nothing is held per run."""

    async def aclose(self) -> None:
        """Nothing to free: the server owns the engine."""


class BackendSource:
    """Runs read through a backend of the registry (one backend object per watched run).

    Args:
        backend: The backend's name (``redis``, ``http``, a third party's).
        endpoint: Where it is.
        config: Its ``--rdzv-conf`` keys (credentials, ``read_timeout``...).
        where: How the page names it (no credentials).

    Raises:
        ValueError: The backend is unknown or its parameters are invalid.
        ImportError: Its extra is not installed.
    """

    def __init__(self, backend: str, endpoint: str, config: dict[str, Any], where: str) -> None:
        self._name = backend
        self._endpoint = endpoint
        self._config = dict(config)
        self.where = where
        self._lister = self._create(_LISTER_RUN)
        self._backends: dict[str, RendezvousBackend] = {}

    def _create(self, run_id: str) -> RendezvousBackend:
        params = RendezvousParameters(self._name, self._endpoint, run_id, 1, 1, **self._config)
        return create_backend(params)

    @property
    def lists(self) -> bool:
        """Whether the backend can name its runs (a :class:`RunLister`)."""
        return isinstance(self._lister, RunLister)

    def _backend(self, run_id: str) -> RendezvousBackend:
        backend = self._backends.get(run_id)
        if backend is None:
            backend = self._backends[run_id] = self._create(run_id)
        return backend

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        lister = self._lister
        if not isinstance(lister, RunLister):  # the pages say so
            raise RendezvousConnectionError(
                f"the {self._name} backend cannot list its runs: open a run's page by its id "
                "(/runs/<run id>)"
            )
        return await lister.list_runs(limit)

    async def snapshot(self, run_id: str) -> Snapshot | None:
        return await self._backend(run_id).snapshot()

    async def wait_for_change(self, run_id: str, token: str, timeout: float) -> None:
        await self._backend(run_id).wait_for_change(token, timeout)

    async def health(self, run_id: str) -> JobHealth | None:
        return await self._backend(run_id).health()

    async def release(self, run_id: str) -> None:
        backend = self._backends.pop(run_id, None)
        if backend is not None:
            await backend.aclose()

    async def aclose(self) -> None:
        for run_id in list(self._backends):
            await self.release(run_id)
        await self._lister.aclose()
