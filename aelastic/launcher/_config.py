"""torch's ``LaunchConfig``, and the one function that turns a launch into a ``WorkerSpec``.

How it works: :class:`LaunchConfig` has torch 2.13's fields, order and defaults (and its
``__post_init__`` rules: the legacy ``rdzv_timeout``, ``shutdown_timeout`` from
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), except the rendezvous backend's default, then a few
fields of aelastic's own. :func:`worker_spec` makes the rendezvous handler and the
:class:`~aelastic.agent.WorkerSpec` of a launch; ``aelastic run`` and
:mod:`aelastic.launcher` both call it, so a command line and a ``LaunchConfig`` that say the
same thing run the same way. Nothing here imports torch: torch's ``DefaultLogsSpecs`` and
``NumaOptions`` are read by their attributes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..agent import Std, WorkerSpec
from ..agent.health.hang_rule import DEFAULT_STARTUP, stall_setting, startup_setting
from ..agent.loop.signals import DEFAULT_SIGNALS
from ..backends.registry import BUILTINS, backend_info, external_names
from ..rendezvous import RendezvousParameters, create_handler

__all__ = ["DEFAULT_BACKEND", "DefaultLogsSpecs", "LaunchConfig", "worker_spec"]

#: The rendezvous backend of a ``LaunchConfig`` that names none. torch's is ``etcd``, which
#: needs an etcd server; aelastic's is its in-process rendezvous: such a launch runs on this
#: node alone, with nothing else to start.
DEFAULT_BACKEND = "memory"

#: torch's legacy ``rdzv_timeout`` default (seconds), kept in ``rdzv_configs["timeout"]``.
_DEFAULT_TIMEOUT = 900


class DefaultLogsSpecs:
    """Where workers' logs go (torch's ``DefaultLogsSpecs`` arguments).

    Args:
        log_dir: Root of the per-attempt log directories; ``None``: a temporary one;
            ``os.devnull``: no log files.
        redirects: Streams written to files only (``Std``, ``"3"``, ``{0: Std.OUT}``).
        tee: Streams written to files and to the console.
        local_ranks_filter: Local ranks whose output reaches the console (all if ``None``).
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Any = Std.NONE,
        tee: Any = Std.NONE,
        local_ranks_filter: set[int] | frozenset[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @property
    def root_log_dir(self) -> str | None:
        return self._root_log_dir


@dataclass
class LaunchConfig:
    """What to launch on this node: torch's ``LaunchConfig`` (2.13), same fields and defaults.

    Differences: ``rdzv_backend`` defaults to ``"memory"`` (torch: ``"etcd"``); torch's
    backend names (``static``, ``c10d``) and aelastic's (``memory``, ``redis``, ``http``, or
    ``aelastic-redis``...) are accepted. ``logs_specs`` may be torch's ``DefaultLogsSpecs`` or
    :class:`DefaultLogsSpecs`; ``numa_options`` torch's ``NumaOptions`` or a mode name
    (``"node"``); ``metrics_cfg`` and ``event_log_handler`` are accepted and unused (see
    ``docs/torch-api.md``). aelastic's own fields come last.

    Args:
        master_addr, master_port: Fixed ``MASTER_ADDR``/``MASTER_PORT`` for the workers
            (default: group rank 0's address and a free port).
        exit_barrier_timeout: Seconds a finished node waits for the others (torch: 300).
        warm_standby: Keep a pre-started interpreter per local rank for restarts of commands.
        env: Extra environment variables for the workers.
        stall_timeout, startup_timeout, job_max_restarts, quarantine_after: A job that
            heals itself (hangs: ``"auto"``, the default, learns the bound from the step
            times, a number fixes it, ``0`` or ``None`` is off; the start-up bound, 30
            minutes; a job-wide budget; quarantine; see :class:`~aelastic.agent.WorkerSpec`).
        standby_preload, recovery_timeout: Modules warm standbys import ahead of time (a
            spare's workers), and the time workers kept for in-place recovery have to join
            their new group (:class:`~aelastic.agent.WorkerSpec`).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = DEFAULT_BACKEND
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = DEFAULT_SIGNALS
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | float | None = None
    # aelastic's own
    master_addr: str | None = None
    master_port: int | None = None
    exit_barrier_timeout: float = 300.0
    warm_standby: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    stall_timeout: float | str | None = "auto"
    startup_timeout: float | None = DEFAULT_STARTUP
    job_max_restarts: int | None = None
    quarantine_after: int | None = None
    standby_preload: tuple[str, ...] = ()
    recovery_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = _DEFAULT_TIMEOUT
        if self.logs_specs is None:
            self.logs_specs = DefaultLogsSpecs()
        if self.shutdown_timeout is None:
            self.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")
        self.stall_timeout = stall_setting(self.stall_timeout)
        self.startup_timeout = startup_setting(self.startup_timeout)


def backend_name(name: str) -> str:
    """The backend behind ``name`` (torch's launcher names map to aelastic's)."""
    for info in BUILTINS:
        if name in (info.name, info.torchrun_alias):
            return info.name
    return name


def _numa_mode(options: Any) -> str | None:
    if options is None or isinstance(options, str):
        return options
    mode = getattr(options, "affinity_mode", None)
    return str(getattr(mode, "value", mode)) if mode is not None else None


def _logs(specs: Any) -> tuple[str | None, Any, Any, frozenset[int] | None]:
    """(log_dir, redirects, tee, local_ranks_filter) of aelastic's or torch's logs specs."""
    ranks = getattr(specs, "_local_ranks_filter", None)
    return (
        getattr(specs, "_root_log_dir", None),
        _std(getattr(specs, "_redirects", Std.NONE)),
        _std(getattr(specs, "_tee", Std.NONE)),
        None if ranks is None else frozenset(ranks),
    )


def _std(value: Any) -> Any:
    """torch's ``Std`` values (an ``IntFlag`` of its own, or a mapping of them) as ints."""
    if isinstance(value, Mapping):
        return {int(rank): int(std) for rank, std in value.items()}
    return value if isinstance(value, str) else int(value)


def worker_spec(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: tuple[Any, ...] | list[Any],
    *,
    log_dir: str | None = None,
) -> WorkerSpec:
    """The rendezvous handler and :class:`WorkerSpec` of a launch (the CLI's and the API's).

    Args:
        config: The launch.
        entrypoint: A command or a callable.
        args: Its arguments.
        log_dir: The log root to use when ``config.logs_specs`` names none.

    Raises:
        ValueError: Invalid rendezvous or worker settings (a backend of this process alone
            asked to wait for several nodes, ...).
        ImportError: The backend's optional dependencies are missing.
    """
    backend = backend_name(config.rdzv_backend.strip())
    info = backend_info(backend)
    if info is not None and not info.multi_node and config.min_nodes > 1:
        raise ValueError(
            f"the {config.rdzv_backend} rendezvous lives in this process: it cannot wait for "
            f"{config.min_nodes} nodes (use {external_names(also=('c10d',))})"
        )
    master_addr, master_port = config.master_addr, config.master_port
    if backend == "static" and config.max_nodes == 1:
        backend = "memory"  # one node: nothing to host, nobody else to wait for
    elif backend == "static":
        master_port = None  # the endpoint's port serves the rendezvous: workers get a free one
    params = RendezvousParameters(
        backend=backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **dict(config.rdzv_configs),
    )
    own_dir, redirects, tee, ranks = _logs(config.logs_specs)
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle, **config.env}
    grace = 30.0 if config.shutdown_timeout is None else float(config.shutdown_timeout)
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        rdzv_handler=create_handler(params),
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_port=master_port,
        master_addr=master_addr,
        local_addr=config.local_addr,
        env=env,
        log_dir=own_dir or log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks,
        log_line_prefix_template=config.log_line_prefix_template,
        stop_grace_period=grace,
        exit_barrier_timeout=config.exit_barrier_timeout,
        virtual_local_rank=config.virtual_local_rank,
        warm_standby=config.warm_standby,
        numa_binding=_numa_mode(config.numa_options),
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        start_method=config.start_method,
        stall_timeout=config.stall_timeout,
        startup_timeout=config.startup_timeout,
        job_max_restarts=config.job_max_restarts,
        quarantine_after=config.quarantine_after,
        standby_preload=tuple(config.standby_preload),
        recovery_timeout=config.recovery_timeout,
    )
