"""The async elastic agent: supervise local workers, restart and rescale them, stop cleanly.

``result = await ElasticAgent(spec).run()`` (or ``ElasticAgent(spec).run_sync()`` in a
plain script) rendezvous with the other nodes through ``spec.rdzv_handler``, starts
``spec.local_world_size`` workers with torch's environment, restarts them on failure while
restarts remain, re-rendezvous when the group changes, and returns a :class:`RunResult`.
"""

from .api import (
    DEFAULT_ROLE,
    ProcessFailure,
    RunResult,
    Std,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from .events import (
    AgentEvent,
    AgentMetrics,
    EventKind,
    EventStream,
    ExitBarrier,
    Finished,
    JobFailure,
    MembershipChanged,
    Quarantined,
    RendezvousCompleted,
    Restart,
    StandbysReady,
    StateChanged,
    UnkillableWorkers,
    WorkerExited,
    WorkersRecovered,
    WorkersStarted,
    WorkerStalled,
)
from .health.heal import NodeQuarantined
from .loop.agent import ElasticAgent
from .loop.signals import SignalException
from .processes.numa import NumaBindingError

__all__ = [
    "DEFAULT_ROLE",
    "AgentEvent",
    "AgentMetrics",
    "ElasticAgent",
    "EventKind",
    "EventStream",
    "ExitBarrier",
    "Finished",
    "JobFailure",
    "MembershipChanged",
    "NodeQuarantined",
    "NumaBindingError",
    "ProcessFailure",
    "Quarantined",
    "RendezvousCompleted",
    "Restart",
    "RunResult",
    "SignalException",
    "StandbysReady",
    "StateChanged",
    "Std",
    "UnkillableWorkers",
    "Worker",
    "WorkerExited",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerStalled",
    "WorkerState",
    "WorkersRecovered",
    "WorkersStarted",
]
