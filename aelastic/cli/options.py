"""``aelastic run``'s command line: torchrun's flags, meanings, defaults and ``PET_*`` fallbacks.

How it works: :func:`build_parser` (:mod:`.run_flags`) declares torchrun's flags, with their
``PET_<DEST>`` fallbacks, checked like command-line values. :func:`config_from_args`
then validates everything and returns a :class:`LaunchConfig`, a plain value the launcher runs.
Every mistake becomes :class:`UsageError` (one line, exit code 2); nothing here starts anything.

Which rendezvous a command line means (torchrun's defaulting of ``static``, ``c10d``...) and
the value parsers live in :mod:`.rules`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from ..agent.api import START_METHODS
from ..backends.registry import secret_variables
from ..core.redact import exposed_secrets, redact
from .conf_keys import unknown_key_warnings
from .devices import determine_local_world_size
from .heal_flags import HealOptions, heal_options
from .progress import default_endpoint_note
from .rules import (
    BACKEND_ALIASES,
    UsageError,
    parse_local_ranks,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
    rendezvous_of,
)
from .run_flags import build_parser
from .torch_flags import torchrun_only_flags

__all__ = [
    "BACKEND_ALIASES",
    "LaunchConfig",
    "UsageError",
    "build_parser",
    "config_from_args",
    "parse_config",
    "parse_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
]


@dataclass(frozen=True, repr=False)
class LaunchConfig:
    """Everything ``aelastic run`` needs to launch, validated (its repr hides secrets)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str
    rdzv_backend: str
    rdzv_endpoint: str
    entrypoint: str
    args: tuple[str, ...]
    rdzv_configs: Mapping[str, str] = field(default_factory=dict)
    standalone: bool = False
    role: str = "default"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    local_addr: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    stop_grace_period: float = 30.0
    exit_barrier_timeout: float = 300.0
    virtual_local_rank: bool = False
    warm_standby: bool = True
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
    env: Mapping[str, str] = field(default_factory=dict)
    quiet: bool = False
    verbose: bool = False
    event_log: str | None = None
    metrics_port: int = 0
    nproc_device: str = ""
    numa_binding: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    start_method: str = "spawn"
    rdzv_asked: str = ""
    #: Said with the first progress line and a connection error when the endpoint was
    #: taken by default (a static rendezvous without --master-addr or --master-port).
    endpoint_note: str | None = None
    warnings: tuple[str, ...] = ()
    heal: HealOptions = field(default_factory=HealOptions)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return redact(f"LaunchConfig({shown})")


def _entrypoint(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    script: str = args.training_script
    rest = tuple(args.training_script_args)
    if args.run_path:
        if not os.path.isabs(script):
            raise UsageError(f"--run-path needs an absolute script path, got {script!r}")
        code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], "
        code += "run_name='__main__')"
        return _python(), ("-u", "-c", code, script, *rest)
    if args.no_python:
        if args.module:
            raise UsageError("Don't use both the '--no-python' flag and the '--module' flag")
        return script, rest
    if args.module:
        return _python(), ("-u", "-m", script, *rest)
    return _python(), ("-u", script, *rest)


def _python() -> str:
    return os.environ.get("PYTHON_EXEC", sys.executable)


def config_from_args(
    args: argparse.Namespace,
    *,
    nproc_resolver: Callable[[str], tuple[int, str]] = determine_local_world_size,
) -> LaunchConfig:
    """Validate parsed flags into a :class:`LaunchConfig` (torchrun's ``config_from_args``).

    Raises:
        UsageError: Any invalid value or combination.
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    start_method = str(getattr(args, "start_method", "spawn") or "spawn")
    if start_method not in START_METHODS:
        raise UsageError(
            f"--start-method must be one of {', '.join(START_METHODS)}, not {start_method!r}"
        )
    try:
        nproc, device = nproc_resolver(args.nproc_per_node)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    backend, endpoint, run_id, standalone, warnings = rendezvous_of(args, min_nodes, max_nodes)
    if not run_id.strip():
        raise UsageError("--rdzv-id must not be empty")
    conf = parse_rdzv_conf(args.rdzv_conf)
    master_port = args.master_port
    if backend == "static":
        # torchrun's rule: the node rank is the static rendezvous' rank. The master port
        # serves the rendezvous: the workers' own store gets a free port on node rank 0.
        conf["rank"] = str(args.node_rank)
        master_port = None
    warnings.extend(unknown_key_warnings(conf, backend))
    warnings.extend(exposed_secrets(endpoint, conf, sys.orig_argv, secret_variables(backend)))
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port {args.master_port} is not a port number")
    grace: float = 30.0
    if args.shutdown_timeout is not None:
        grace = float(args.shutdown_timeout)
    elif "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ:
        try:
            grace = float(os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        except ValueError:
            raise UsageError("TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be a number") from None
    if grace < 0 or args.exit_barrier_timeout < 0:
        raise UsageError("--shutdown-timeout and --exit-barrier-timeout must be >= 0")
    # torchrun tells the workers which signals the launcher handles.
    env: dict[str, str] = {"TORCHELASTIC_SIGNALS_TO_HANDLE": str(args.signals_to_handle)}
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    entrypoint, script_args = _entrypoint(args)
    event_log, metrics_port = _observability(args)
    torchrun_options, more = torchrun_only_flags(args)
    warnings.extend(more)
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        nproc_device=device,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=conf,
        standalone=standalone,
        role=args.role,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        local_addr=args.local_addr,
        master_addr=args.master_addr,
        master_port=master_port,
        log_dir=args.log_dir,
        redirects=parse_std(args.redirects, "--redirects"),
        tee=parse_std(args.tee, "--tee"),
        local_ranks_filter=parse_local_ranks(args.local_ranks_filter),
        stop_grace_period=grace,
        exit_barrier_timeout=args.exit_barrier_timeout,
        virtual_local_rank=bool(args.virtual_local_rank),
        warm_standby=not args.no_warm_standby,
        signals=parse_signals(args.signals_to_handle),
        env=env,
        quiet=bool(args.quiet),
        verbose=bool(args.verbose),
        event_log=event_log,
        metrics_port=metrics_port,
        entrypoint=entrypoint,
        args=script_args,
        numa_binding=torchrun_options.numa_binding,
        duplicate_stdout_filters=torchrun_options.duplicate_stdout_filters,
        duplicate_stderr_filters=torchrun_options.duplicate_stderr_filters,
        start_method=start_method,
        rdzv_asked="standalone" if args.standalone else str(args.rdzv_backend).strip(),
        endpoint_note=_endpoint_note(args, backend, endpoint),
        warnings=tuple(warnings),
        heal=heal_options(args),
    )


def _endpoint_note(args: argparse.Namespace, backend: str, endpoint: str) -> str | None:
    """What the progress lines and errors say when the endpoint was taken by default: a
    static rendezvous's is ``--master-addr:--master-port`` (127.0.0.1:29500 by default)."""
    if backend != "static" or args.rdzv_endpoint:
        return None
    given = (("--master-addr", args.master_addr), ("--master-port", args.master_port))
    missing = [flag for flag, value in given if value is None]
    return default_endpoint_note(endpoint, ["--rdzv-endpoint", *missing]) if missing else None


def _observability(args: argparse.Namespace) -> tuple[str | None, int]:
    """``--event-log`` (torch's ``--event-log-handler console`` means stderr) and
    ``--metrics-port``, checked."""
    handler = str(args.event_log_handler).strip()
    if handler not in ("console", "null"):
        raise UsageError(f"--event-log-handler must be console or null, not {handler!r}")
    event_log = args.event_log or ("-" if handler == "console" else None)
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be 0 (off) to 65535, not {args.metrics_port}")
    return event_log, int(args.metrics_port)


def parse_config(argv: Sequence[str], prog: str = "aelastic run") -> LaunchConfig:
    """Parse and validate ``aelastic run``'s arguments.

    Raises:
        UsageError: Any bad flag or value.
    """
    return config_from_args(build_parser(prog).parse_args(list(argv)))
