"""How many workers ``--nproc-per-node auto|gpu|xpu|cpu`` means, found without importing torch.

How it works: torchrun asks ``torch.cuda.device_count()`` (or ``torch.xpu``,
``torch.accelerator``), which costs an import of torch (about 2 s and 200 MiB). The launcher
instead counts devices the way their drivers expose them, with the visibility variables
torch's count honours:

* NVIDIA: one directory per GPU under ``/proc/driver/nvidia/gpus``, else the lines of
  ``nvidia-smi -L``; ``CUDA_VISIBLE_DEVICES`` (only the listed devices, up to the first
  invalid entry).
* AMD (ROCm; torch's ``cuda`` on ROCm builds): ``/dev/kfd`` and the KFD topology in sysfs
  (``/sys/class/kfd/kfd/topology/nodes/*/properties``: a node with SIMDs is a GPU);
  ``ROCR_VISIBLE_DEVICES``, then ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``), as
  torch's ``_parse_visible_devices`` reads them on ROCm.
* Intel (``xpu``): DRM cards of vendor ``0x8086`` driven by ``i915`` or ``xe``;
  ``ZE_AFFINITY_MASK`` (its root devices).

``cpu`` is the number of CPUs this process may run on (torch's ``torch._utils.cpu_count``),
and ``auto`` is the GPU count when there are GPUs, else the XPU count, else ``cpu``
(``torch.accelerator``'s order).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping

__all__ = ["count_cpus", "count_gpus", "count_xpus", "determine_local_world_size"]

_PROC_GPUS = "/proc/driver/nvidia/gpus"
_KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
_DRM = "sys/class/drm"


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


def _amd_gpus(root: str = "/") -> int:
    """AMD GPUs of the machine: KFD topology nodes that have SIMDs (CPUs have none)."""
    if not os.path.exists(os.path.join(root, "dev/kfd")):
        return 0
    nodes = os.path.join(root, _KFD_NODES)
    try:
        names = os.listdir(nodes)
    except OSError:
        return 0
    count = 0
    for name in names:
        try:
            with open(os.path.join(nodes, name, "properties")) as f:
                fields = dict(line.split(None, 1) for line in f if line.strip())
        except (OSError, ValueError):
            continue
        if int(fields.get("simd_count", "0").strip() or 0) > 0:
            count += 1
    return count


def _intel_gpus(root: str = "/") -> int:
    """Intel GPUs of the machine: DRM cards of vendor 0x8086 driven by i915 or xe."""
    drm = os.path.join(root, _DRM)
    try:
        names = os.listdir(drm)
    except OSError:
        return 0
    count = 0
    for name in names:
        if not (name.startswith("card") and name[4:].isdigit()):
            continue  # connectors (card0-DP-1) and render nodes
        device = os.path.join(drm, name, "device")
        try:
            with open(os.path.join(device, "vendor")) as f:
                vendor = f.read().strip()
            driver = os.path.basename(os.path.realpath(os.path.join(device, "driver")))
        except OSError:
            continue
        if vendor == "0x8086" and driver in ("i915", "xe"):
            count += 1
    return count


def _rocm_visible(physical: int, env: Mapping[str, str]) -> int:
    """How many of ``physical`` AMD GPUs torch's ROCm build sees under ``env``."""
    rocr, hip = env.get("ROCR_VISIBLE_DEVICES"), env.get("HIP_VISIBLE_DEVICES")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if rocr is not None:
        rocr_count = len(rocr.split(","))
        if hip is None:
            return min(rocr_count, physical)
        if len(hip.split(",")) > rocr_count:
            raise ValueError("HIP_VISIBLE_DEVICES contains more devices than ROCR_VISIBLE_DEVICES")
        visible = hip
    elif hip is not None:
        visible = hip
    return physical if visible is None else _visible(physical, visible)


def count_gpus(
    env: Mapping[str, str] | None = None,
    physical: Callable[[], int] = _physical_gpus,
    amd: Callable[[], int] = _amd_gpus,
) -> int:
    """GPUs this process may use, NVIDIA's or else AMD's, with their visibility variables.

    Args:
        env: Environment to read the visibility variables from (default ``os.environ``).
        physical: Counts the NVIDIA GPUs of the machine (injectable for tests).
        amd: Counts the AMD GPUs of the machine (injectable for tests).

    Raises:
        ValueError: ``HIP_VISIBLE_DEVICES`` lists more devices than ``ROCR_VISIBLE_DEVICES``.
    """
    env = os.environ if env is None else env
    count = physical()
    if count:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        return count if visible is None else _visible(count, visible)
    count = amd()
    return _rocm_visible(count, env) if count else 0


def count_xpus(env: Mapping[str, str] | None = None, intel: Callable[[], int] = _intel_gpus) -> int:
    """Intel GPUs this process may use (``ZE_AFFINITY_MASK``'s root devices applied)."""
    env = os.environ if env is None else env
    count = intel()
    mask = env.get("ZE_AFFINITY_MASK")
    if count == 0 or mask is None:
        return count
    roots = {item.strip().split(".", 1)[0] for item in mask.split(",") if item.strip()}
    return sum(1 for root in roots if root.isdigit() and int(root) < count)


def determine_local_world_size(
    nproc_per_node: str,
    *,
    gpus: Callable[[], int] = count_gpus,
    cpus: Callable[[], int] = count_cpus,
    xpus: Callable[[], int] = count_xpus,
) -> tuple[int, str]:
    """Resolve ``--nproc-per-node`` to a number of workers (torchrun's rules).

    Args:
        nproc_per_node: A positive integer, ``gpu``, ``xpu``, ``cpu`` or ``auto``.
        gpus: Counts usable GPUs (injectable for tests).
        cpus: Counts usable CPUs (injectable for tests).
        xpus: Counts usable Intel GPUs (injectable for tests).

    Returns:
        The number of workers and the device it was derived from (``""`` for a number).

    Raises:
        ValueError: Not a positive integer nor a known device, or ``gpu``/``xpu`` without
            such devices.
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
            raise ValueError(
                "--nproc-per-node gpu: Cuda is not available (no NVIDIA or AMD GPU found)"
            )
        return count, "gpu"
    if text == "xpu":
        count = xpus()
        if count == 0:
            raise ValueError("--nproc-per-node xpu: Xpu is not available (no Intel GPU found)")
        return count, "xpu"
    if text == "auto":
        count = gpus()
        if count:
            return count, "gpu"
        count = xpus()
        return (count, "xpu") if count else (cpus(), "cpu")
    raise ValueError(
        f"Unsupported nproc_per_node value: {nproc_per_node!r} "
        "(use a number, auto, cpu, gpu or xpu)"
    )
