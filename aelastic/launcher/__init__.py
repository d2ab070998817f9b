"""torch's programmatic launcher (``torch.distributed.launcher.api``) on aelastic's agent.

``from torch.distributed.launcher.api import LaunchConfig, elastic_launch`` becomes
``from aelastic.launcher import LaunchConfig, elastic_launch``::

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="job")
    outputs = elastic_launch(config, train)(arg)   # {global rank: train's return value}

A failure raises torch's ``ChildFailedError`` (imported only then; aelastic's own class of
that name when torch is not installed) with torch's ``failures`` and message. The agent runs
in this process, as torch's does, on a private event loop; asyncio programs await
:func:`launch_agent_async` (or ``elastic_launch(...).run_async(...)``) instead. The launcher
never imports torch on its way.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from ..agent import ElasticAgent, RunResult
from ..agent.loop.signals import signals_to_handle
from ._config import DEFAULT_BACKEND, DefaultLogsSpecs, LaunchConfig, worker_spec
from ._failures import ChildFailure, child_failed_error, entrypoint_name

__all__ = [
    "DEFAULT_BACKEND",
    "ChildFailure",
    "DefaultLogsSpecs",
    "LaunchConfig",
    "elastic_launch",
    "launch_agent",
    "launch_agent_async",
]

log = logging.getLogger("aelastic.launcher")


class elastic_launch:  # torch's name (a class, lower case)
    """Launch the agent of this node for ``entrypoint`` (torch's ``elastic_launch``).

    Args:
        config: The launch.
        entrypoint: A function (its return values come back by global rank) or a command
            (``sys.executable``, a script path, a program).

    Example::

        outputs = elastic_launch(config, train)(lr)         # {0: ..., 1: ...}
        elastic_launch(config, sys.executable)("-u", "train.py")
    """

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Callable[..., Any] | str | None,
        health_check_server: Any = None,
    ) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        """Run the workers with ``args`` until they succeed; their return values.

        Raises:
            ChildFailedError: Workers failed for good (torch's class when installed).
            RendezvousError: The rendezvous failed.
            KeyboardInterrupt, SignalException: A handled signal stopped the launch.
        """
        return launch_agent(self._config, self._entrypoint, list(args))

    async def run_async(self, *args: Any) -> dict[int, Any]:
        """:meth:`__call__` for asyncio programs (on the running loop)."""
        return await launch_agent_async(self._config, self._entrypoint, list(args))


def _prepare(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any]
) -> tuple[ElasticAgent, str | None]:
    if entrypoint is None or entrypoint == "":
        raise ValueError("elastic_launch needs an entrypoint (a function or a command)")
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    # Like torch's default logs specs, a temporary log root, here removed unless a worker
    # failed (its error file is then where ChildFailedError's failures say it is).
    own = None
    if getattr(config.logs_specs, "_root_log_dir", None) is None:
        own = tempfile.mkdtemp(prefix="aelastic_")
    try:
        return ElasticAgent(worker_spec(config, entrypoint, args, log_dir=own)), own
    except BaseException:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        raise


def _outcome(
    result: RunResult | None, own: str | None, entrypoint: Any, args: list[Any]
) -> dict[int, Any]:
    failed = result is not None and result.is_failed()
    if own is not None and not failed:
        shutil.rmtree(own, ignore_errors=True)
    assert result is not None
    if failed:
        raise child_failed_error(entrypoint_name(entrypoint, args), result.failures)
    return result.return_values


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    health_check_server: Any = None,
) -> dict[int, Any]:
    """Run this node's agent to the end (torch's ``launch_agent``); the return values of a
    function by global rank (empty for a command).

    In the main thread, the signals of ``config.signals_to_handle`` stop the workers (that
    signal, the grace period, SIGKILL) and then raise ``KeyboardInterrupt`` (SIGINT) or
    ``SignalException``. Under ``start_method="fork"`` the workers are forked from this
    process as it is now.

    Raises:
        ChildFailedError: Workers failed for good.
        RendezvousError: The rendezvous failed.
        ValueError: Invalid settings.
    """
    agent, own = _prepare(config, entrypoint, args)
    result: RunResult | None = None
    try:
        handled = signals_to_handle({"TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle})
        result = agent.run_sync(signals=handled)
    finally:
        if result is None and own is not None:
            shutil.rmtree(own, ignore_errors=True)
    return _outcome(result, own, entrypoint, args)


async def launch_agent_async(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any]
) -> dict[int, Any]:
    """:func:`launch_agent` on the running event loop (installs no signal handler;
    cancelling it stops the workers and leaves the rendezvous).

    Raises:
        ChildFailedError: Workers failed for good.
        RendezvousError: The rendezvous failed.
        ValueError: Invalid settings.
    """
    agent, own = _prepare(config, entrypoint, args)
    result: RunResult | None = None
    try:
        result = await agent.run()
    finally:
        await agent.spec.rdzv_handler.aclose()
        if result is None and own is not None:
            shutil.rmtree(own, ignore_errors=True)
    return _outcome(result, own, entrypoint, args)


def __getattr__(name: str) -> Any:
    # ``aelastic.launcher.ChildFailedError`` is the class a failure raises: torch's when
    # torch can be imported (looked up only when asked for), else aelastic's.
    if name == "ChildFailedError":
        from ._failures import child_failed_error_class

        return child_failed_error_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
