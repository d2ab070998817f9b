"""``aelastic run``: run one node of a job under the async agent, with signals and a console.

How it works: :func:`launch` builds the rendezvous handler and the :class:`WorkerSpec` from a
:class:`~aelastic.cli.options.LaunchConfig`, subscribes the :class:`Console` to the agent's
events, and awaits ``agent.run()`` in a task. The signals of ``--signals-to-handle`` are handled
from the first line of :func:`launch` (even if the process inherited them ignored) and cancel
that task: the agent then stops its workers as torchrun does (the signal received, to each
process group, the grace period, then SIGKILL) and leaves the rendezvous; the launcher exits
with 1, as torchrun does after a signal.
A failed run exits with 1 too, after a root-cause summary (rank, exit code or signal, the
message of the worker's error file). A job id whose run was closed before this node came
(a finished job's) gets the way out: a new ``--rdzv-id``, or ``aelastic status --reset``.
Endpoints show without their password. Torch is never imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import signal
import time
from collections.abc import Sequence

from ..agent import ElasticAgent, NumaBindingError, RunResult, WorkerSpec
from ..agent._health import health_port
from ..agent.prometheus import AgentCollector, serve_metrics
from ..core.redact import redact_endpoint
from ..rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    create_handler,
)
from .console import Console
from .event_log import EventLog
from .options import LaunchConfig
from .progress import Progress

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "entrypoint_name", "launch"]

EXIT_OK = 0
#: Workers failed, the rendezvous failed, or a signal stopped the job (torchrun's code).
EXIT_FAILED = 1
#: Bad flags or values.
EXIT_USAGE = 2


def entrypoint_name(entrypoint: str, args: Sequence[str]) -> str:
    """The script (or module, or command) a human recognizes (torch's rule)."""
    if os.path.basename(entrypoint).startswith("python"):
        rest = iter(args)
        for arg in rest:
            if arg == "-c":
                return "<code>"
            if arg == "-m":
                return next(rest, "<module>")
            if not arg.startswith("-"):
                return arg
    return entrypoint


def _banner(config: LaunchConfig, name: str) -> str:
    nodes = (
        f"{config.min_nodes} node"
        if config.min_nodes == config.max_nodes == 1
        else f"{config.min_nodes} nodes"
        if config.min_nodes == config.max_nodes
        else f"{config.min_nodes} to {config.max_nodes} nodes"
    )
    workers = config.nproc_per_node
    per_node = f"{workers} worker{'s' if workers != 1 else ''} per node"
    if config.nproc_device:
        per_node += f" (one per {config.nproc_device})"
    where = (
        "standalone (nothing else to start)"
        if config.standalone
        else f"{config.rdzv_backend} rendezvous at {_where(config)}"
    )
    restarts = config.max_restarts
    command = shlex.join([os.path.basename(config.entrypoint), *config.args])
    return (
        f"launching {name}: {per_node}, {nodes}, {where}; job id {config.run_id}; "
        f"{restarts or 'no'} restart{'s' if restarts != 1 else ''} allowed; command: {command}"
    )


def _where(config: LaunchConfig) -> str:
    return redact_endpoint(config.rdzv_endpoint) if config.rdzv_endpoint else "this process"


def _closed_on_arrival(config: LaunchConfig, exc: RendezvousClosedError) -> list[str]:
    """What to say when the job id names a run that was closed before this node came."""
    lines = [
        f"error: the job id '{config.run_id}' was used by a job that has finished: its "
        f"rendezvous at {_where(config)} is closed, so no node can join it for now"
    ]
    if exc.reopens_in is not None:
        lines.append(
            f"the id is free again in {math.ceil(exc.reopens_in)} s (two heartbeat windows "
            "after that job's last node left, so that a late node of it still learns that it "
            "closed)"
        )
    else:
        lines.append("the id is free again two heartbeat windows after that job's nodes leave")
    if config.rdzv_backend in ("redis", "http"):
        reset = shlex.join(
            [
                "aelastic",
                "status",
                "--rdzv-backend",
                config.rdzv_backend,
                "--rdzv-endpoint",
                redact_endpoint(config.rdzv_endpoint),
                "--rdzv-id",
                config.run_id,
                "--reset",
            ]
        )
        lines.append(f"start fresh with a new --rdzv-id, or delete the old run first: {reset}")
    else:
        lines.append("start fresh with a new --rdzv-id")
    return lines


def build_spec(config: LaunchConfig) -> WorkerSpec:
    """The handler and the :class:`WorkerSpec` that ``config`` describes.

    Raises:
        ValueError: Invalid rendezvous settings or worker settings.
        ImportError: The backend's optional dependencies are missing.
    """
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **dict(config.rdzv_configs),
    )
    handler = create_handler(params)
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        rdzv_handler=handler,
        entrypoint=config.entrypoint,
        args=config.args,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_port=config.master_port,
        master_addr=config.master_addr,
        local_addr=config.local_addr,
        env=dict(config.env),
        log_dir=config.log_dir,
        redirects=config.redirects,
        tee=config.tee,
        local_ranks_filter=config.local_ranks_filter,
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        stop_grace_period=config.stop_grace_period,
        exit_barrier_timeout=config.exit_barrier_timeout,
        virtual_local_rank=config.virtual_local_rank,
        warm_standby=config.warm_standby,
        numa_binding=config.numa_binding,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
    )


async def launch(config: LaunchConfig, console: Console | None = None) -> int:
    """Run this node of the job until it ends; the process exit code.

    The signals of ``config.signals`` are handled from the start, whatever the process
    inherited (ignored included): each cancels the agent, which stops the workers it
    started, if any, and leaves the rendezvous.

    Returns:
        0 on success, 1 when workers failed, the rendezvous failed or a signal stopped the
        job, 2 when the rendezvous settings are invalid.
    """
    console = console or Console(enabled=not config.quiet)
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []
    running: list[tuple[ElasticAgent, asyncio.Task[RunResult]]] = []

    def on_signal(sig: signal.Signals) -> None:
        if received:
            console.line(f"received {sig.name} again: still stopping", always=True)
            return
        received.append(sig)
        console.line(
            f"received {sig.name}: stopping the workers ({sig.name}, then SIGKILL after "
            f"{config.stop_grace_period:g} s) and leaving the rendezvous",
            always=True,
        )
        for agent, task in running:
            agent.forward_signal(sig)
            task.cancel()

    installed = []
    for sig in config.signals:
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    try:
        return await _launch(config, console, received, running)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _launch(
    config: LaunchConfig,
    console: Console,
    received: list[signal.Signals],
    running: list[tuple[ElasticAgent, asyncio.Task[RunResult]]],
) -> int:
    name = entrypoint_name(config.entrypoint, config.args)
    for warning in config.warnings:
        console.line(f"warning: {warning}", always=True)
    try:
        health_port()  # the agent would only log a bad value: a launcher says it at once
        spec = build_spec(config)
    except ValueError as exc:
        console.line(f"error: {exc}", always=True)
        return EXIT_USAGE
    except ImportError as exc:
        console.line(f"error: {exc}", always=True)
        return EXIT_FAILED
    try:
        async with contextlib.AsyncExitStack() as observers:
            console.line(_banner(config, name))
            agent = ElasticAgent(spec)
            agent.add_listener(console)
            agent.add_listener(Progress(console.line))
            failed = await _observe(config, agent, console, observers)
            if failed is not None:
                return failed
            task = asyncio.get_running_loop().create_task(agent.run(), name="aelastic-agent")
            running.append((agent, task))  # a signal from now on (or before) cancels it
            if received:
                agent.forward_signal(received[0])
                task.cancel()
            return await _outcome(task, console, received, name, agent, config)
    finally:
        with contextlib.suppress(Exception):
            await spec.rdzv_handler.aclose()


async def _observe(
    config: LaunchConfig,
    agent: ElasticAgent,
    console: Console,
    stack: contextlib.AsyncExitStack,
) -> int | None:
    """Subscribe the event log and serve the metrics, if asked; an exit code if it failed."""
    if config.event_log:
        try:
            event_log = EventLog(config.event_log, lambda text: console.line(text, always=True))
        except OSError as exc:
            console.line(
                f"error: cannot write the event log {config.event_log}: {exc}", always=True
            )
            return EXIT_USAGE
        stack.callback(event_log.close)
        stack.callback(agent.add_listener(event_log))
    if config.metrics_port:
        handler = agent.spec.rdzv_handler
        try:
            collector = AgentCollector(
                handler.get_run_id(), str(handler.node), config.role, handler.get_backend()
            )
            runner = await serve_metrics(collector, config.metrics_port)
        except ImportError as exc:
            console.line(f"error: {exc}", always=True)
            return EXIT_FAILED
        except OSError as exc:
            console.line(f"error: cannot serve metrics: {exc.strerror or exc}", always=True)
            return EXIT_USAGE
        stack.push_async_callback(runner.cleanup)
        stack.callback(agent.add_listener(collector))
        console.line(f"metrics at http://{_hostname()}:{config.metrics_port}/metrics")
    return None


def _hostname() -> str:
    import socket

    return socket.gethostname()


async def _outcome(
    task: asyncio.Task[RunResult],
    console: Console,
    received: list[signal.Signals],
    name: str,
    agent: ElasticAgent,
    config: LaunchConfig,
) -> int:
    started = time.monotonic()
    try:
        result = await task
    except asyncio.CancelledError:
        if not received:
            raise
        console.line(
            f"stopped by {received[0].name} after {time.monotonic() - started:.2f} s",
            always=True,
        )
        return EXIT_FAILED
    except RendezvousGracefulExitError as exc:
        console.line(f"this node was not needed and the job is over: {exc}")
        return EXIT_OK
    except RendezvousError as exc:
        if isinstance(exc, RendezvousClosedError) and agent.metrics.rendezvous_count == 0:
            for line in _closed_on_arrival(config, exc):
                console.line(line, always=True)
        else:
            console.line(f"error: rendezvous failed: {type(exc).__name__}: {exc}", always=True)
        return EXIT_FAILED
    except OSError as exc:
        console.line(f"error: cannot start the workers: {exc}", always=True)
        return EXIT_FAILED
    except NumaBindingError as exc:
        console.line(f"error: {exc}", always=True)
        return EXIT_FAILED
    console.result(result, name)
    if received:  # the signal came as the run ended by itself
        return EXIT_FAILED
    return EXIT_FAILED if result.is_failed() else EXIT_OK
