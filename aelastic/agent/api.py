"""The agent's public types, with torch's names: specs, workers, groups, states, results.

How it works: these are plain values. :class:`WorkerSpec` says what to run and how (torch's
fields first, then aelastic's own knobs); the agent builds a :class:`WorkerGroup` of
:class:`Worker` per rendezvous round and ends with a :class:`RunResult` keyed by global rank.
A failed worker is described by a :class:`ProcessFailure`; the earliest one is the root
cause. Nothing here starts a process or touches the network.
"""

from __future__ import annotations

import enum
import re
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .health.hang_rule import DEFAULT_STARTUP, HangRule, rule_of, stall_setting, startup_setting
from .processes.numa import NUMA_MODES

if TYPE_CHECKING:
    from ..core.store import Store
    from ..rendezvous.handler import DynamicRendezvousHandler

__all__ = [
    "DEFAULT_ROLE",
    "START_METHODS",
    "ProcessFailure",
    "RunResult",
    "Std",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]

#: The role of workers when none is given (torch's).
DEFAULT_ROLE = "default"

#: torch's start methods for callable workers (``WorkerSpec.start_method``).
START_METHODS = ("spawn", "fork", "forkserver")

_STD_VALUE = re.compile(r"^[0123]$")
_STD_MAPPING = re.compile(r"^(\d+:[0123],)*(\d+:[0123])$")


class Std(enum.IntFlag):
    """Which standard streams of a worker to redirect or tee (torch's values 0-3)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, value: str) -> Std | dict[int, Std]:
        """Parse torch's syntax: ``"3"`` for every local rank, ``"0:1,1:2"`` per local rank.

        Raises:
            ValueError: ``value`` is neither form.
        """
        text = value.strip()
        if _STD_VALUE.match(text):
            return cls(int(text))
        if _STD_MAPPING.match(text):
            pairs = (item.split(":") for item in text.split(","))
            return {int(rank): cls(int(std)) for rank, std in pairs}
        raise ValueError(
            f"{value!r} does not match <{_STD_VALUE.pattern}> or <{_STD_MAPPING.pattern}>"
        )


#: What ``WorkerSpec.redirects`` and ``WorkerSpec.tee`` accept.
StdSetting = Std | int | str | Mapping[int, Std | int]


def std_map(setting: StdSetting, local_world_size: int) -> dict[int, Std]:
    """The :class:`Std` of every local rank (ranks missing from a mapping get ``NONE``).

    Raises:
        ValueError: An unparsable string or a value outside 0-3.
    """
    if isinstance(setting, str):
        setting = Std.from_str(setting)
    if isinstance(setting, Mapping):
        return {rank: Std(int(setting.get(rank, Std.NONE))) for rank in range(local_world_size)}
    return dict.fromkeys(range(local_world_size), Std(int(setting)))


@dataclass
class WorkerSpec:
    """What the agent runs on this node, and how (torch's ``WorkerSpec`` plus aelastic knobs).

    Args:
        role: Name of the workers' role (``ROLE_NAME``).
        local_world_size: Number of workers on this node.
        rdzv_handler: The async rendezvous handler (``aelastic.rendezvous.create_handler``).
        entrypoint: A command (``str``, e.g. ``sys.executable``) run with ``args``, or a
            Python callable run with ``args`` under ``start_method``; a callable's return
            value lands in ``RunResult.return_values``.
        args: Arguments; in commands, ``${local_rank}`` is replaced by the local rank.
        max_restarts: Restarts after worker failures before the run fails.
        monitor_interval: Accepted for torch compatibility; unused (exits are awaited).
        master_port: Fixed MASTER_PORT; by default group rank 0 reserves a free port.
        master_addr: Fixed MASTER_ADDR; by default group rank 0's address.
        local_addr: This node's address (default: the rendezvous node's address).
        env: Extra environment variables for the workers (torch's variables win).
        log_dir: Root of the per-attempt log directories
            (``<log_dir>/<run_id>/attempt_<n>/<local_rank>/``); a temporary directory
            when ``None``; ``os.devnull`` disables log files and error files.
        redirects: Streams written to files only (``Std``, ``"3"`` or ``"0:1,1:2"``).
        tee: Streams written to files and to the console, each line prefixed.
        local_ranks_filter: Local ranks whose output reaches the console (all if ``None``).
        log_line_prefix_template: Console prefix of teed lines; ``${role_name}``,
            ``${rank}`` and ``${local_rank}`` are substituted (default ``[role0]:``).
        stop_grace_period: Seconds between SIGTERM and SIGKILL when stopping workers.
        exit_barrier_timeout: Seconds a node that succeeded waits for the others.
        virtual_local_rank: Give each worker one GPU: ``CUDA_VISIBLE_DEVICES`` is the
            local rank's entry of the agent's list (or the local rank) and ``LOCAL_RANK`` 0.
        close_on_failure: Close the rendezvous for every node when this node fails for good
            (torch's behaviour); otherwise just leave it so the others may go on.
        warm_standby: Keep one idle interpreter per local rank, started ahead of time, so
            a restart skips Python's startup (only for ``sys.executable`` running a script
            or ``-m module``; the worker sees the same environment, argv and ``__main__``).
        numa_binding: Bind each worker to the CPUs near its device (torch's ``AffinityMode``
            values ``node``, ``socket``, ``exclusive``, ``core-complex``; see
            :mod:`aelastic.agent.processes.numa`); ``None``: no binding.
        duplicate_stdout_filters: Lines of teed stdout containing any of these strings are
            also written, prefixed, to ``filtered_stdout.log`` in the attempt's log directory
            (torch's).
        duplicate_stderr_filters: The same for stderr (``filtered_stderr.log``).
        stall_timeout: How a hung worker is found: its stacks are taken, its rank, host and
            stuck line named, and its group restarted (a restart spent). ``"auto"`` (the
            default): the bound is learned from the job's step times (5x the slowest
            recent gap between optimizer steps, 10 s to 1 h), and a worker past it is hung
            only if its processes were idle (no CPU, no I/O) for the second half of it; a
            wait inside ``torch.distributed`` is left to the rank at fault. A number:
            seconds without progress (an optimizer step, or ``aelastic.worker.progress()``)
            after a worker's first progress. ``0`` or ``None``: no hang detection.
        startup_timeout: Seconds from a torch worker's start to its first step (process
            group set-up, the first collective, a data loader's first batch): a worker
            idle that long without a step is hung, a wait in ``torch.distributed``
            included (30 minutes; ``0`` or ``None``: not watched before the first step).
        job_max_restarts: Restarts the whole job may spend, however nodes come and go
            (kept in the rendezvous store); ``None``: only ``max_restarts`` per agent.
        quarantine_after: A host that was the job's root cause this many times in a row,
            or was lost this many times, leaves the job (:class:`NodeQuarantined`);
            ``None``: never.
        recovery_timeout: Seconds workers kept for in-place recovery
            (:class:`aelastic.worker.InPlace`) have to join their new group once its ranks
            are known; then they are stopped and started again the old way.
        standby_preload: Modules each warm standby imports ahead of time (``("torch",)``):
            a spare node's workers, or a restart's, then skip that import too.
        start_method: How a callable's workers start (torch's ``start_method``): ``spawn``
            (a fresh interpreter; what multiprocessing passes to a spawned process passes,
            ``mp.Queue`` included), ``forkserver`` (the same), or ``fork`` (forked from the
            caller's state as it was when the agent started: lambdas, closures and
            ``__main__`` functions work). Commands ignore it.
    """

    role: str
    local_world_size: int
    rdzv_handler: DynamicRendezvousHandler
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    redirects: StdSetting = Std.NONE
    tee: StdSetting = Std.NONE
    local_ranks_filter: frozenset[int] | set[int] | None = None
    log_line_prefix_template: str | None = None
    stop_grace_period: float = 30.0
    exit_barrier_timeout: float = 300.0
    virtual_local_rank: bool = False
    close_on_failure: bool = True
    warm_standby: bool = True
    numa_binding: str | None = None
    duplicate_stdout_filters: Sequence[str] | None = ()
    duplicate_stderr_filters: Sequence[str] | None = ()
    stall_timeout: float | str | None = "auto"
    startup_timeout: float | None = DEFAULT_STARTUP
    job_max_restarts: int | None = None
    quarantine_after: int | None = None
    start_method: str = "spawn"
    recovery_timeout: float = 60.0
    standby_preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.local_world_size <= 0:
            raise ValueError(f"local_world_size must be positive, got {self.local_world_size}")
        if self.monitor_interval <= 0:
            raise ValueError(f"monitor_interval must be positive, got {self.monitor_interval}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.entrypoint:
            raise ValueError("WorkerSpec needs an entrypoint (a command or a callable)")
        if self.stop_grace_period < 0 or self.exit_barrier_timeout < 0:
            raise ValueError("stop_grace_period and exit_barrier_timeout must be >= 0")
        if self.numa_binding is not None and self.numa_binding not in NUMA_MODES:
            raise ValueError(
                f"numa_binding must be one of {', '.join(NUMA_MODES)}, not {self.numa_binding!r}"
            )
        self.stall_timeout = stall_setting(self.stall_timeout)
        self.startup_timeout = startup_setting(self.startup_timeout)
        for name in ("job_max_restarts", "quarantine_after"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "job_max_restarts" else 1):
                raise ValueError(
                    f"{name} must be >= {int(name != 'job_max_restarts')}, got {value}"
                )
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, not {self.start_method!r}"
            )
        if not self.recovery_timeout > 0:
            raise ValueError(f"recovery_timeout must be positive, got {self.recovery_timeout}")
        self.standby_preload = tuple(self.standby_preload)
        for name in self.standby_preload:
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"standby_preload names modules, not {name!r}")
        self.args = tuple(self.args)
        self.duplicate_stdout_filters = tuple(self.duplicate_stdout_filters or ())
        self.duplicate_stderr_filters = tuple(self.duplicate_stderr_filters or ())
        # Validate the stream settings now rather than at the first start.
        std_map(self.redirects, self.local_world_size)
        std_map(self.tee, self.local_world_size)

    def hang_rule(self) -> HangRule | None:
        """How this spec's workers are watched for hangs (``None``: they are not)."""
        return rule_of(self.stall_timeout, self.startup_timeout)

    def get_entrypoint_name(self) -> str:
        """The command's base name, or the callable's qualified name (torch's)."""
        if isinstance(self.entrypoint, str):
            return self.entrypoint.rsplit("/", 1)[-1]
        return str(getattr(self.entrypoint, "__qualname__", repr(self.entrypoint)))


class Worker:
    """One worker process of a group (torch's ``Worker``); ``id`` is its pid once started."""

    __slots__ = ("global_rank", "id", "local_rank", "role_rank", "role_world_size", "world_size")

    def __init__(
        self,
        local_rank: int,
        global_rank: int = -1,
        role_rank: int = -1,
        world_size: int = -1,
        role_world_size: int = -1,
    ) -> None:
        self.id: Any = None
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.role_rank = role_rank
        self.world_size = world_size
        self.role_world_size = role_world_size

    def __repr__(self) -> str:
        return (
            f"Worker(local_rank={self.local_rank}, global_rank={self.global_rank}, "
            f"role_rank={self.role_rank}, world_size={self.world_size}, "
            f"role_world_size={self.role_world_size}, id={self.id})"
        )


class WorkerState(str, enum.Enum):
    """State of a worker group (torch's values; the group changes state as a unit)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """Whether workers in ``state`` are processes still alive."""
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


class WorkerGroup:
    """The workers of this node for one rendezvous round (torch's ``WorkerGroup``)."""

    __slots__ = (
        "group_rank",
        "group_world_size",
        "master_addr",
        "master_port",
        "round",
        "spec",
        "state",
        "store",
        "workers",
    )

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Store | None = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT
        #: The rendezvous round the group was formed in (aelastic).
        self.round: int | None = None

    def __repr__(self) -> str:
        return (
            f"WorkerGroup(role={self.spec.role!r}, state={self.state.value}, "
            f"group_rank={self.group_rank}, group_world_size={self.group_world_size}, "
            f"master={self.master_addr}:{self.master_port})"
        )


@dataclass(frozen=True)
class ProcessFailure:
    """A worker that failed: who, how, and what its error file said.

    ``exitcode`` follows torch: negative for a signal (``-9`` for SIGKILL). ``timestamp`` is
    when the agent saw the exit (wall-clock seconds); the earliest failure is the root cause.
    ``message`` comes from the error file written by torch's ``@record`` when there is one.
    aelastic's own: ``stalled``, the worker made no progress for the stall timeout and was
    stopped (``message`` says where it was stuck); ``secondary``, it broke inside
    ``torch.distributed`` (most likely because a peer failed), so it is a root cause only
    when nothing else failed.
    """

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    message: str
    timestamp: float
    error_file: str = "<N/A>"
    error_file_data: Mapping[str, Any] = field(default_factory=dict)
    role: str = DEFAULT_ROLE
    hostname: str = field(default_factory=socket.getfqdn)
    stalled: bool = False
    secondary: bool = False

    def signal_name(self) -> str:
        """The signal that ended the worker (``"SIGKILL"``), or ``"<N/A>"``."""
        if self.exitcode >= 0:
            return "<N/A>"
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return "<N/A>"

    def timestamp_isoformat(self) -> str:
        """The failure time as ``YYYY-MM-DD_HH:MM:SS`` (torch's format)."""
        return datetime.fromtimestamp(int(self.timestamp)).isoformat(sep="_")

    def __str__(self) -> str:
        how = f"exitcode {self.exitcode}"
        if self.exitcode < 0:
            how += f" ({self.signal_name()})"
        return (
            f"rank {self.global_rank} (local_rank {self.local_rank}, pid {self.pid}) on "
            f"{self.hostname} failed with {how} at {self.timestamp_isoformat()}: {self.message}"
        )


@dataclass
class RunResult:
    """The outcome of a run, all-or-nothing for the workers of this node.

    ``return_values`` (callable entrypoints) and ``failures`` are keyed by global rank.
    Workers the agent stopped on purpose appear in neither.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """Whether the run failed."""
        return self.state == WorkerState.FAILED

    @property
    def root_cause(self) -> ProcessFailure | None:
        """The earliest failure (one that broke in a collective only when all did), or
        ``None`` when nothing failed."""
        if not self.failures:
            return None
        return min(self.failures.values(), key=lambda f: (f.secondary, f.timestamp, f.global_rank))
