"""Agents for the ported agent scenarios: specs running ``_worker.py`` or a function of
``_functions.py``, and the environments the workers wrote.

How it works: an agent here is aelastic's :class:`~aelastic.agent.ElasticAgent` in the test's
event loop (several of them make a multi-node job), over an async handler of this test's run
on the backend under test; its workers are real processes. Each command worker writes its
environment to ``OUT/<RANK>.<restart>.json`` (:func:`worker_envs` reads them back).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from aelastic.agent import WorkerSpec
from aelastic.rendezvous import DynamicRendezvousHandler

WORKER = str(Path(__file__).with_name("_worker.py"))


def command_spec(
    handler: DynamicRendezvousHandler,
    out: Path,
    mode: str = "ok",
    *args: str,
    nproc: int = 2,
    role: str = "default",
    **kwargs: Any,
) -> WorkerSpec:
    """A spec of ``nproc`` workers running ``_worker.py OUT MODE ARGS``."""
    _defaults(kwargs, out)
    return WorkerSpec(
        role=role,
        local_world_size=nproc,
        rdzv_handler=handler,
        entrypoint=sys.executable,
        args=(WORKER, str(out), mode, *args),
        **kwargs,
    )


def function_spec(
    handler: DynamicRendezvousHandler,
    out: Path,
    function: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    **kwargs: Any,
) -> WorkerSpec:
    """A spec of ``nproc`` workers calling ``function(*args)`` (spawned, as torch's)."""
    _defaults(kwargs, out)
    return WorkerSpec(
        role="default",
        local_world_size=nproc,
        rdzv_handler=handler,
        entrypoint=function,
        args=args,
        **kwargs,
    )


def _defaults(kwargs: dict[str, Any], out: Path) -> None:
    kwargs.setdefault("max_restarts", 0)
    kwargs.setdefault("stop_grace_period", 5.0)
    kwargs.setdefault("exit_barrier_timeout", 5.0)
    kwargs.setdefault("warm_standby", False)
    kwargs.setdefault("log_dir", str(out / "logs"))


def worker_envs(out: Path, restart: int | None = None) -> dict[int, dict[str, str]]:
    """The environments the workers wrote, by global rank (of one attempt, or the last)."""
    found: dict[int, tuple[int, dict[str, str]]] = {}
    for path in out.glob("*.json"):
        rank, attempt = (int(part) for part in path.stem.split("."))
        if restart is not None and attempt != restart:
            continue
        if rank not in found or found[rank][0] < attempt:
            found[rank] = (attempt, json.loads(path.read_text()))
    return {rank: env for rank, (_, env) in sorted(found.items())}


def attempts(out: Path) -> set[int]:
    """The restart counts the workers started with."""
    return {int(path.stem.split(".")[1]) for path in out.glob("*.json")}


async def written(out: Path, count: int, within: float = 60.0) -> dict[int, dict[str, str]]:
    """Wait until ``count`` workers wrote their environment in ``out``; their environments."""
    with anyio.fail_after(within):
        for _ in range(int(within / 0.02) + 2):
            envs = worker_envs(out)
            if len(envs) >= count:
                return envs
            await anyio.sleep(0.02)
    raise AssertionError(f"{count} workers never wrote to {out}")
