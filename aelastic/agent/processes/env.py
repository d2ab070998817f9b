"""The environment contract of a worker: exactly the variables torch's agent sets.

How it works: pure functions of the spec, the group and the worker. The agent's own
environment comes first, then ``WorkerSpec.env``, then torch's variables (which win), so an
existing torch script finds RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... as under
torchrun. The agent's credentials are not inherited: workers need no rendezvous secret, and
their environment often ends up in logs. Left out: :data:`aelastic.core.redact.SECRET_ENV`
and every ``AELASTIC_*`` variable named like a credential (``..._PASSWORD``, ``..._TOKEN``,
``..._USERNAME``, ``..._SECRET``: Redis', the HTTP server's, etcd's); ``PET_RDZV_ENDPOINT`` and
``PET_RDZV_CONF`` are passed on with their passwords masked (``redis://user:***@host``).
``${local_rank}`` in string arguments becomes the worker's local rank. aelastic's worker
bootstrap goes first on ``PYTHONPATH`` (:func:`aelastic.agent.health.progress.with_bootstrap`; it
takes itself off again at start).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...core.redact import SECRET_ENV, redact, redact_endpoint
from ..api import Worker, WorkerGroup
from ..health.progress import with_bootstrap

__all__ = [
    "ATTEMPT_KEYS",
    "LOCAL_RANK_MACRO",
    "cuda_visible_device",
    "inherited_env",
    "is_credential",
    "substitute_args",
    "worker_env",
]

#: Replaced by the worker's local rank in string arguments (torch's ``macros.local_rank``).
LOCAL_RANK_MACRO = "${local_rank}"


#: The variables the agent sets per worker and attempt (everything else is inherited).
ATTEMPT_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_TIMER_FILE",
        "AELASTIC_PROGRESS_FILE",
        "AELASTIC_INPLACE_SOCKET",
        "AELASTIC_AGENT_BEAT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
    }
)


#: The endings of the names of aelastic's credential variables (any backend's).
_CREDENTIAL_ENDINGS = ("_PASSWORD", "_PASSWD", "_TOKEN", "_SECRET", "_USERNAME", "_USER")
#: torchrun's variables that may hold a password: passed on masked.
_MASKED: dict[str, Callable[[str], str]] = {
    "PET_RDZV_ENDPOINT": redact_endpoint,
    "PET_RDZV_CONF": redact,
}


def is_credential(name: str) -> bool:
    """Whether the variable ``name`` holds one of aelastic's credentials (never inherited)."""
    return name in SECRET_ENV or (
        name.startswith("AELASTIC_") and name.upper().endswith(_CREDENTIAL_ENDINGS)
    )


def inherited_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a worker inherits of ``base`` (default ``os.environ``): all but the credentials,
    and the rendezvous endpoint and settings with their passwords masked."""
    parent = os.environ if base is None else base
    env = {k: v for k, v in parent.items() if not is_credential(k)}
    for name, mask in _MASKED.items():
        if name in env:
            env[name] = mask(env[name])
    return env


def substitute_args(args: Sequence[Any], local_rank: int) -> tuple[Any, ...]:
    """``args`` with ``${local_rank}`` replaced in every string argument."""
    rank = str(local_rank)
    return tuple(a.replace(LOCAL_RANK_MACRO, rank) if isinstance(a, str) else a for a in args)


def cuda_visible_device(local_rank: int, parent_visible: str | None) -> str:
    """The one device a worker sees when each local rank gets its own GPU.

    Args:
        local_rank: The worker's local rank.
        parent_visible: The agent's ``CUDA_VISIBLE_DEVICES`` (``None``: all devices).

    Returns:
        The ``local_rank``-th entry of ``parent_visible``, or the local rank itself.

    Raises:
        ValueError: ``parent_visible`` lists fewer devices than ``local_rank + 1``.
    """
    if parent_visible is None:
        return str(local_rank)
    devices = [d.strip() for d in parent_visible.split(",") if d.strip()]
    if local_rank >= len(devices):
        raise ValueError(
            f"local_rank {local_rank} exceeds available GPUs in "
            f"CUDA_VISIBLE_DEVICES={parent_visible}"
        )
    return devices[local_rank]


def worker_env(
    group: WorkerGroup,
    worker: Worker,
    *,
    restart_count: int,
    run_id: str,
    error_file: str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of ``worker`` (torch's ``LocalElasticAgent._start_workers``).

    Args:
        group: The group after rank assignment (group rank, world size, master address).
        worker: The worker, with its ranks assigned.
        restart_count: Restarts spent so far.
        run_id: The rendezvous run id.
        error_file: Where the worker's ``@record`` writes its error (``""``: nowhere).
        base: The environment to start from (default: the agent's ``os.environ``), minus
            the credentials of :data:`aelastic.core.redact.SECRET_ENV`.

    Raises:
        ValueError: The group has no ranks or master address yet, or the GPU assignment
            asks for more devices than ``CUDA_VISIBLE_DEVICES`` lists.
    """
    spec = group.spec
    if group.group_rank is None or group.group_world_size is None or group.master_addr is None:
        raise ValueError("the worker group has not been through a rendezvous yet")
    parent = inherited_env(base)
    env = dict(parent)
    env.update(spec.env)
    env.update(
        {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": group.master_addr,
            "MASTER_PORT": str(group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": parent.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
    )
    if "OMP_NUM_THREADS" not in env and spec.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    if spec.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_device(
            worker.local_rank, parent.get("CUDA_VISIBLE_DEVICES")
        )
    else:
        env["LOCAL_RANK"] = str(worker.local_rank)
    with_bootstrap(env)
    return env
