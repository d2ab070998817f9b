"""``aelastic run``: run one node of a job under the async agent, with signals and a console.

How it works: :func:`launch` builds the rendezvous handler and the :class:`WorkerSpec` from a
:class:`~aelastic.cli.options.LaunchConfig`, subscribes the :class:`Console` to the agent's
events, and awaits ``agent.run()`` in a task. The signals of ``--signals-to-handle`` are handled
from the first line of :func:`launch` (even if the process inherited them ignored) and cancel
that task: the agent then stops its workers as torchrun does (the signal received, to each
process group, the grace period, then SIGKILL) and leaves the rendezvous; the launcher exits
with 1, as torchrun does after a signal.
A failed run exits with 1 too, after this node's report in torch's shape (the entrypoint's
name, the failures, the root cause: rank, exit code or signal, what the worker's error file
said unless its output showed that traceback already) and the job's own root cause, once
(from every node's reports in the rendezvous store). A node whose host was quarantined exits
with 3, one whose workers outlived SIGKILL with 4. A SIGHUP ignored at start (``nohup``)
stays ignored. A job id whose run was closed before this node came (a finished job's) gets
the way out: a new ``--rdzv-id``, or ``aelastic status --reset``. Endpoints show without
their password. Torch is never imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass

from .. import launcher
from ..agent import ElasticAgent, NodeQuarantined, NumaBindingError, RunResult, WorkerSpec
from ..agent.health.check import health_port
from ..agent.loop.signals import kept_ignored
from ..agent.output.logs import stderr_on_console
from ..agent.processes.unkillable import WorkersUnkillable
from ..agent.prometheus import AgentCollector, serve_metrics
from ..core.race import fail_after
from ..launcher._config import worker_spec
from ..launcher._failures import write_root_cause
from ..rendezvous import RendezvousError, RendezvousGracefulExitError
from ._launch_text import EXIT_FAILED, banner, entrypoint_name, failed_to_run
from .console import Console
from .event_log import EventLog
from .options import LaunchConfig
from .progress import Progress

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_QUARANTINED",
    "EXIT_UNKILLABLE",
    "EXIT_USAGE",
    "Outcome",
    "build_spec",
    "entrypoint_name",
    "launch",
    "launch_config",
]

EXIT_OK = 0
# EXIT_FAILED = 1 (workers failed, the rendezvous failed, a signal): from ._launch_text.
#: Bad flags or values.
EXIT_USAGE = 2
#: This node's host was quarantined (``--quarantine-after``): do not restart it here.
EXIT_QUARANTINED = 3
#: Workers outlived SIGKILL (uninterruptible sleep): the host needs attention.
EXIT_UNKILLABLE = 4


def launch_config(config: LaunchConfig) -> tuple[launcher.LaunchConfig, str, tuple[str, ...]]:
    """The command line as the launcher's ``LaunchConfig``, entrypoint and arguments."""
    return (
        launcher.LaunchConfig(
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            nproc_per_node=config.nproc_per_node,
            logs_specs=launcher.DefaultLogsSpecs(
                config.log_dir, config.redirects, config.tee, config.local_ranks_filter
            ),
            run_id=config.run_id,
            role=config.role,
            rdzv_endpoint=config.rdzv_endpoint,
            rdzv_backend=config.rdzv_backend,
            rdzv_configs=dict(config.rdzv_configs),
            max_restarts=config.max_restarts,
            monitor_interval=config.monitor_interval,
            start_method=config.start_method,
            log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
            local_addr=config.local_addr,
            numa_options=config.numa_binding,
            signals_to_handle=",".join(s.name for s in config.signals),
            duplicate_stdout_filters=list(config.duplicate_stdout_filters),
            duplicate_stderr_filters=list(config.duplicate_stderr_filters),
            virtual_local_rank=config.virtual_local_rank,
            shutdown_timeout=config.stop_grace_period,
            master_addr=config.master_addr,
            master_port=config.master_port,
            exit_barrier_timeout=config.exit_barrier_timeout,
            warm_standby=config.warm_standby,
            env=dict(config.env),
            stall_timeout=config.heal.stall_timeout,
            startup_timeout=config.heal.startup_timeout,
            job_max_restarts=config.heal.job_max_restarts,
            quarantine_after=config.heal.quarantine_after,
            standby_preload=config.heal.standby_preload,
            recovery_timeout=config.heal.recovery_timeout,
        ),
        config.entrypoint,
        config.args,
    )


def build_spec(config: LaunchConfig) -> WorkerSpec:
    """The handler and the :class:`WorkerSpec` that ``config`` describes (made by
    :func:`aelastic.launcher.worker_spec`, as for the Python API).

    Raises:
        ValueError: Invalid rendezvous settings or worker settings.
        ImportError: The backend's optional dependencies are missing.
    """
    return worker_spec(*launch_config(config))


@dataclass
class Outcome:
    """How a launch ended, for a caller that raises rather than exits (:mod:`aelastic.run`)."""

    #: The run's result, when the agent returned one.
    result: RunResult | None = None
    #: What ended the launch otherwise (bad settings, the rendezvous, a worker's start).
    error: BaseException | None = None
    #: The handled signal that stopped it.
    signal: signal.Signals | None = None


async def launch(
    config: LaunchConfig, console: Console | None = None, outcome: Outcome | None = None
) -> int:
    """Run this node of the job until it ends; the process exit code.

    The signals of ``config.signals`` are handled from the start, whatever the process
    inherited (ignored included): each cancels the agent, which stops the workers it
    started, if any, and leaves the rendezvous. ``outcome``, if given, is filled with how
    the launch ended. When a worker failed and ``TORCHELASTIC_ERROR_FILE`` is set for this
    process, the root cause's error file is copied there (torchrun's ``@record``).

    Returns:
        0 on success, 1 when workers failed, the rendezvous failed or a signal stopped the
        job, 2 when the rendezvous settings are invalid.
    """
    console = console or Console(enabled=not config.quiet)
    outcome = Outcome() if outcome is None else outcome
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
        if kept_ignored(sig):
            continue  # nohup: the job goes on when the terminal goes away
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    try:
        code = await _launch(config, console, received, running, outcome)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    if received:
        outcome.signal = received[0]
    root = None if outcome.result is None else outcome.result.root_cause
    if root is not None:
        written = write_root_cause(root)
        if written:
            console.line(f"root cause written to {written} (TORCHELASTIC_ERROR_FILE)")
    return code


async def _launch(
    config: LaunchConfig,
    console: Console,
    received: list[signal.Signals],
    running: list[tuple[ElasticAgent, asyncio.Task[RunResult]]],
    outcome: Outcome,
) -> int:
    name = entrypoint_name(config.entrypoint, config.args)
    for warning in config.warnings:
        console.line(f"warning: {warning}", always=True)
    try:
        health_port()  # the agent would only log a bad value: a launcher says it at once
        spec = build_spec(config)
    except ValueError as exc:
        outcome.error = exc
        console.line(f"error: {exc}", always=True)
        return EXIT_USAGE
    except ImportError as exc:
        outcome.error = exc
        console.line(f"error: {exc}", always=True)
        return EXIT_FAILED
    try:
        async with contextlib.AsyncExitStack() as observers:
            console.line(banner(config, name))
            rule = spec.hang_rule()
            console.line(rule.describe() if rule is not None else "hangs: not watched")
            agent = ElasticAgent(spec)
            agent.add_listener(console)
            # No progress line once a stop signal came: nothing is waited for any more.
            agent.add_listener(
                Progress(
                    lambda text: None if received else console.line(text),
                    note=config.endpoint_note,
                )
            )
            failed = await _observe(config, agent, console, observers)
            if failed is not None:
                return failed
            task = asyncio.get_running_loop().create_task(agent.run(), name="aelastic-agent")
            running.append((agent, task))  # a signal from now on (or before) cancels it
            if received:
                agent.forward_signal(received[0])
                task.cancel()
            return await _outcome(task, console, received, name, agent, config, outcome)
    finally:
        # After a stop signal, a hosting node serves the others only within the grace.
        with contextlib.suppress(Exception):
            async with fail_after(config.stop_grace_period if received else math.inf):
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
    outcome: Outcome,
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
    except NodeQuarantined as exc:
        outcome.error = exc
        left = f"{name}: {exc}; this node left the job (exit code 3)"
        console.line(left, always=True, news=False)  # the job's root cause after it
        console.job_failure()
        return EXIT_QUARANTINED
    except WorkersUnkillable as exc:
        outcome.error = exc
        console.line(f"{name}: {exc}; this node left the job (exit code 4)", always=True)
        return EXIT_UNKILLABLE
    except (RendezvousError, OSError, NumaBindingError) as exc:
        outcome.error = exc
        code = failed_to_run(exc, console, agent, config)
        console.job_failure()
        return code
    outcome.result = result
    console.result(result, name, lambda failure: stderr_on_console(agent.spec, failure.local_rank))
    if received:  # the signal came as the run ended by itself
        return EXIT_FAILED
    return EXIT_FAILED if result.is_failed() else EXIT_OK
