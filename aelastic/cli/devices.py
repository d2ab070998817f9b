"""How many workers ``--nproc-per-node auto|gpu|cpu`` means, found without importing torch.

How it works: torchrun asks ``torch.cuda.device_count()``, which costs an import of torch (about
2 s and 200 MiB). The launcher instead counts NVIDIA GPUs the way the driver exposes them: one
directory per GPU under ``/proc/driver/nvidia/gpus``, else the lines of ``nvidia-smi -L``; and,
like CUDA, it honours ``CUDA_VISIBLE_DEVICES`` (only the listed devices, up to the first
invalid entry). ``cpu`` is the number of CPUs this process may run on (torch's
``torch._utils.cpu_count``), and ``auto`` is the GPU count when there are GPUs, else ``cpu``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping

__all__ = ["count_cpus", "count_gpus", "determine_local_world_size"]

_PROC_GPUS = "/proc/driver/nvidia/gpus"


def count_cpus() -> int:
    """CPUs available to this process (affinity and cgroup cpusets respected)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _physical_gpus(proc_dir: str = _PROC_GPUS) -> int:
    try:
        return len(os.listdir(proc_dir))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _visible(physical: int, visible: str) -> int:
    """How many of ``physical`` GPUs ``CUDA_VISIBLE_DEVICES=visible`` leaves visible."""
    seen: list[str] = []
    for raw in visible.split(","):
        item = raw.strip()
        if not item:
            break
        if item.isdigit() or (item.startswith("-") and item[1:].isdigit()):
            if int(item) < 0 or int(item) >= physical:
                break  # CUDA stops at the first invalid index
        elif not item.startswith(("GPU-", "MIG-")):
            break
        if item in seen:
            break
        seen.append(item)
    return min(len(seen), physical)


def count_gpus(
    env: Mapping[str, str] | None = None, physical: Callable[[], int] = _physical_gpus
) -> int:
    """NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied).

    Args:
        env: Environment to read ``CUDA_VISIBLE_DEVICES`` from (default ``os.environ``).
        physical: Counts the GPUs of the machine (injectable for tests).
    """
    env = os.environ if env is None else env
    count = physical()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if count == 0 or visible is None:
        return count
    return _visible(count, visible)


def determine_local_world_size(
    nproc_per_node: str,
    *,
    gpus: Callable[[], int] = count_gpus,
    cpus: Callable[[], int] = count_cpus,
) -> tuple[int, str]:
    """Resolve ``--nproc-per-node`` to a number of workers (torchrun's rules).

    Args:
        nproc_per_node: A positive integer, ``gpu``, ``cpu`` or ``auto``.
        gpus: Counts usable GPUs (injectable for tests).
        cpus: Counts usable CPUs (injectable for tests).

    Returns:
        The number of workers and the device it was derived from (``""`` for a number).

    Raises:
        ValueError: Not a positive integer nor a known device, or ``gpu`` without GPUs.
    """
    text = nproc_per_node.strip()
    try:
        number = int(text)
    except ValueError:
        pass
    else:
        if number <= 0:
            raise ValueError(f"--nproc-per-node must be positive, got {number}")
        return number, ""
    if text == "cpu":
        return cpus(), "cpu"
    if text == "gpu":
        count = gpus()
        if count == 0:
            raise ValueError("--nproc-per-node gpu: Cuda is not available (no NVIDIA GPU found)")
        return count, "gpu"
    if text == "auto":
        count = gpus()
        return (count, "gpu") if count else (cpus(), "cpu")
    raise ValueError(
        f"Unsupported nproc_per_node value: {nproc_per_node!r} (use a number, auto, cpu or gpu)"
    )
