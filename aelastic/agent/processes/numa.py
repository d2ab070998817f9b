"""NUMA binding of workers (torchrun's ``--numa-binding``): which CPUs each local rank gets.

How it works: :meth:`Topology.read` reads the machine from sysfs once (every path is under
``root``, so tests build fake trees): the CPUs of each NUMA node, each CPU's package (socket),
physical core (its lowest hyperthread sibling) and largest cache (the lowest CPU sharing its
highest-level data or unified cache), the CPUs this process may use, and the NUMA node of every
visible GPU (PCI display devices of NVIDIA or AMD, in PCI bus order, then the entries of
``CUDA_VISIBLE_DEVICES``). :func:`cpus_for` is pure and follows torch 2.13's
``torch/numa/binding.py`` for the device of a local rank (GPU ``i`` for local rank ``i``):

* ``node``: the allowed CPUs of the device's NUMA node;
* ``socket``: those of every NUMA node of the device's socket;
* ``exclusive``: the node's physical cores split evenly among the node's devices, in device
  order, the lowest devices getting one core more when it does not divide;
* ``core-complex``: one group of cores sharing the largest cache, the largest groups first,
  a different one per device of the node when there are enough.

On a host without GPUs (torch fails there) the local ranks are the devices: they are spread
over the NUMA nodes in consecutive blocks, and the same rules apply. :func:`bindings` gives a
:class:`Binding` per local rank: ``numactl --physcpubind`` wraps the command when ``numactl``
is installed (as torch does), otherwise the child sets its CPU affinity before ``exec``.
Anything that prevents binding is a :class:`NumaBindingError` with one line saying why.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "NUMA_MODES",
    "Binding",
    "NumaBindingError",
    "Topology",
    "bindings",
    "cpus_for",
    "format_cpus",
    "parse_cpus",
    "worker_binding",
]

#: The modes of ``--numa-binding`` (torch's ``AffinityMode`` values).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")

_GPU_VENDORS = {"0x10de": ("0x0300", "0x0302"), "0x1002": ("0x0300", "0x0302", "0x0380")}


class NumaBindingError(RuntimeError):
    """Workers cannot be bound as asked (topology unreadable, no CPU left, no way to bind)."""


def parse_cpus(text: str) -> frozenset[int]:
    """``"0-2,4"`` -> ``{0, 1, 2, 4}`` (sysfs' list format).

    Raises:
        ValueError: Not a list of numbers and ranges.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 4}`` -> ``"0-2,4"`` (numactl's and sysfs' list format)."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


@dataclass(frozen=True)
class Topology:
    """What binding needs to know of a machine (see :meth:`read`)."""

    #: NUMA node -> its CPUs (allowed or not).
    node_cpus: Mapping[int, frozenset[int]]
    #: CPU -> physical package (socket).
    package: Mapping[int, int]
    #: CPU -> its physical core (the lowest of its hyperthread siblings).
    core: Mapping[int, int]
    #: CPU -> its largest cache (the lowest CPU sharing it).
    cache: Mapping[int, int]
    #: The CPUs this process may run on.
    allowed: frozenset[int]
    #: Visible GPU index -> its NUMA node (empty on a host without GPUs).
    gpu_nodes: tuple[int, ...] = ()

    @classmethod
    def read(
        cls,
        root: str = "/",
        *,
        allowed: Iterable[int] | None = None,
        visible_devices: str | None = None,
    ) -> Topology:
        """Read the topology under ``root`` (``/`` is the machine itself).

        Args:
            root: Where ``sys/`` is.
            allowed: The CPUs this process may use (default: its affinity).
            visible_devices: ``CUDA_VISIBLE_DEVICES`` (default: the environment's).

        Raises:
            NumaBindingError: A file it needs is missing or unreadable.
        """
        if allowed is None:
            allowed = os.sched_getaffinity(0)
        if visible_devices is None:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        sysfs = _Sysfs(root)
        nodes = sorted(sysfs.cpus("sys/devices/system/node/possible"))
        node_cpus = {n: sysfs.cpus(f"sys/devices/system/node/node{n}/cpulist") for n in nodes}
        cpus = sorted(set().union(*node_cpus.values()))
        base = "sys/devices/system/cpu/cpu{}/"
        package = {
            c: int(sysfs.text(base.format(c) + "topology/physical_package_id")) for c in cpus
        }
        siblings = "topology/thread_siblings_list"
        core = {c: min(sysfs.cpus(base.format(c) + siblings) | {c}) for c in cpus}
        cache = {c: min(sysfs.largest_cache(base.format(c) + "cache") | {c}) for c in cpus}
        gpus = _visible(sysfs.gpu_nodes(), visible_devices)
        return cls(node_cpus, package, core, cache, frozenset(allowed), gpus)


class _Sysfs:
    def __init__(self, root: str) -> None:
        self.root = root

    def text(self, path: str) -> str:
        full = os.path.join(self.root, path)
        try:
            with open(full) as f:
                return f.read().strip()
        except OSError as exc:
            raise NumaBindingError(
                f"cannot read the NUMA topology: {full}: {exc.strerror or exc}"
            ) from None

    def cpus(self, path: str) -> frozenset[int]:
        text = self.text(path)
        try:
            return parse_cpus(text)
        except ValueError:
            full = os.path.join(self.root, path)
            raise NumaBindingError(f"{full}: not a CPU list: {text!r}") from None

    def largest_cache(self, path: str) -> frozenset[int]:
        """The CPUs sharing the highest-level data or unified cache (torch's rule)."""
        full = os.path.join(self.root, path)
        entries = sorted(e for e in _listdir(full) if e.startswith("index") and e[5:].isdecimal())
        level, shared = -1, frozenset[int]()
        for entry in entries:
            if self.text(f"{path}/{entry}/type") not in ("Unified", "Data"):
                continue
            this = int(self.text(f"{path}/{entry}/level"))
            if this > level:
                level, shared = this, self.cpus(f"{path}/{entry}/shared_cpu_list")
        return shared

    def gpu_nodes(self) -> list[int]:
        """NUMA nodes of the machine's GPUs, in PCI bus order (one vendor: NVIDIA first)."""
        devices = os.path.join(self.root, "sys/bus/pci/devices")
        found: dict[str, list[int]] = {vendor: [] for vendor in _GPU_VENDORS}
        for address in sorted(_listdir(devices)):
            path = f"sys/bus/pci/devices/{address}"
            vendor = self.text(f"{path}/vendor").lower()
            kinds = _GPU_VENDORS.get(vendor)
            if kinds and self.text(f"{path}/class").lower().startswith(kinds):
                found[vendor].append(max(int(self.text(f"{path}/numa_node")), 0))
        return next((nodes for nodes in found.values() if nodes), [])


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NumaBindingError(f"cannot read {path}: {exc.strerror or exc}") from None


def _visible(nodes: Sequence[int], visible: str | None) -> tuple[int, ...]:
    """The NUMA nodes of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves, in its order."""
    if visible is None:
        return tuple(nodes)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not all(e.isdecimal() for e in entries):
        raise NumaBindingError(
            f"CUDA_VISIBLE_DEVICES={visible} names devices by id: --numa-binding needs "
            "device indices to find their NUMA nodes"
        )
    indices = [int(e) for e in entries]
    missing = [i for i in indices if i >= len(nodes)]
    if missing:
        raise NumaBindingError(
            f"CUDA_VISIBLE_DEVICES={visible}: no GPU {missing[0]} ({len(nodes)} found)"
        )
    return tuple(nodes[i] for i in indices)


def cpus_for(topology: Topology, mode: str, local_rank: int, nprocs: int) -> frozenset[int]:
    """The CPUs local rank ``local_rank`` of ``nprocs`` is bound to in ``mode``.

    Raises:
        NumaBindingError: The mode is unknown, the local rank has no GPU, or no allowed CPU
            is left for it.
    """
    if mode not in _RULES:
        raise NumaBindingError(f"unknown NUMA binding mode {mode!r} ({', '.join(NUMA_MODES)})")
    node, devices = _placement(topology, local_rank, nprocs)
    cpus = _RULES[mode](topology, node, devices.index(local_rank), len(devices))
    if not cpus:
        raise NumaBindingError(
            f"--numa-binding {mode}: no CPU left for local rank {local_rank} on NUMA node "
            f"{node} (this process may use CPUs {format_cpus(topology.allowed)})"
        )
    return cpus


def _placement(topology: Topology, local_rank: int, nprocs: int) -> tuple[int, list[int]]:
    """The NUMA node of the local rank's device, and the devices of that node in order."""
    gpus = topology.gpu_nodes
    if gpus:
        if local_rank >= len(gpus):
            raise NumaBindingError(
                f"--numa-binding: local rank {local_rank} has no GPU ({len(gpus)} visible)"
            )
        node = gpus[local_rank]
        return node, [i for i, n in enumerate(gpus) if n == node]
    nodes = [n for n in sorted(topology.node_cpus) if topology.node_cpus[n] & topology.allowed]
    if not nodes:
        raise NumaBindingError("--numa-binding: no NUMA node has a CPU this process may use")
    home = [nodes[rank * len(nodes) // nprocs] for rank in range(nprocs)]
    node = home[local_rank]
    return node, [rank for rank in range(nprocs) if home[rank] == node]


def _allowed_of(topology: Topology, node: int) -> frozenset[int]:
    return topology.node_cpus.get(node, frozenset()) & topology.allowed


def _node(topology: Topology, node: int, index: int, count: int) -> frozenset[int]:
    return _allowed_of(topology, node)


def _socket(topology: Topology, node: int, index: int, count: int) -> frozenset[int]:
    mine = _allowed_of(topology, node)
    if not mine:
        return mine
    package = topology.package[min(mine)]
    found: set[int] = set()
    for other in topology.node_cpus:
        cpus = _allowed_of(topology, other)
        if cpus and topology.package[min(cpus)] == package:
            found |= cpus
    return frozenset(found)


def _exclusive(topology: Topology, node: int, index: int, count: int) -> frozenset[int]:
    cores = _group(_allowed_of(topology, node), topology.core)
    ordered = [cores[key] for key in sorted(cores)]
    share, extra = divmod(len(ordered), count)
    if share < 1:
        raise NumaBindingError(
            f"--numa-binding exclusive: NUMA node {node} has {len(ordered)} physical core(s) "
            f"for {count} {'GPUs' if topology.gpu_nodes else 'workers'}"
        )
    start = index * share + min(index, extra)
    end = start + share + (1 if index < extra else 0)
    return frozenset(cpu for core in ordered[start:end] for cpu in core)


def _core_complex(topology: Topology, node: int, index: int, count: int) -> frozenset[int]:
    caches = _group(_allowed_of(topology, node), topology.cache)
    if not caches:
        return frozenset()
    ordered = sorted(caches.items(), key=lambda item: (-len(item[1]), item[0]))
    return frozenset(ordered[index % len(ordered)][1])


def _group(cpus: Iterable[int], key: Mapping[int, int]) -> dict[int, set[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key.get(cpu, cpu), set()).add(cpu)
    return groups


_Rule = Callable[[Topology, int, int, int], frozenset[int]]
_RULES: dict[str, _Rule] = {
    "node": _node,
    "socket": _socket,
    "exclusive": _exclusive,
    "core-complex": _core_complex,
}


@dataclass(frozen=True)
class Binding:
    """The CPUs of one worker and how they are applied.

    ``numactl`` set: the command is wrapped (``numactl --physcpubind=CPUS cmd...``);
    otherwise the child sets its own affinity to ``cpus`` before ``exec``.
    """

    cpus: frozenset[int]
    numactl: str | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as the worker is started (wrapped by ``numactl`` when it is used)."""
        if self.numactl is None:
            return list(argv)
        return [self.numactl, f"--physcpubind={format_cpus(self.cpus)}", *argv]

    @property
    def affinity(self) -> frozenset[int] | None:
        """The CPU set the child applies itself before ``exec`` (``None``: numactl does)."""
        return None if self.numactl is not None else self.cpus


def bindings(
    mode: str, nprocs: int, topology: Topology | None = None, numactl: str | None = ""
) -> dict[int, Binding]:
    """The :class:`Binding` of every local rank (the topology is read once per process).

    Args:
        mode: A mode of :data:`NUMA_MODES`.
        nprocs: The number of local workers.
        topology: The machine (default: this one, read on first use).
        numactl: The ``numactl`` to use; ``""``: look it up on ``PATH``; ``None``: CPU
            affinity even when ``numactl`` is installed.

    Raises:
        NumaBindingError: The workers cannot be bound (see :func:`cpus_for`), or neither
            ``numactl`` nor ``os.sched_setaffinity`` is available.
    """
    if topology is None:
        topology = _this_machine(os.environ.get("CUDA_VISIBLE_DEVICES"))
    tool = shutil.which("numactl") if numactl == "" else numactl
    if tool is None and not hasattr(os, "sched_setaffinity"):
        raise NumaBindingError(
            "--numa-binding needs numactl or CPU affinity (os.sched_setaffinity): "
            "neither is available here"
        )
    return {rank: Binding(cpus_for(topology, mode, rank, nprocs), tool) for rank in range(nprocs)}


@functools.lru_cache(maxsize=4)
def _this_machine(visible: str | None) -> Topology:
    if not hasattr(os, "sched_getaffinity"):
        raise NumaBindingError("--numa-binding needs Linux (sysfs and CPU affinity)")
    return Topology.read("/", visible_devices=visible)


def worker_binding(mode: str | None, local_world_size: int, local_rank: int) -> Binding | None:
    """The binding of local rank ``local_rank`` of ``local_world_size`` workers under
    ``mode`` (a spec's ``numa_binding``; ``None``: none).

    Raises:
        NumaBindingError: See :func:`bindings`.
    """
    if mode is None:
        return None
    return bindings(mode, local_world_size)[local_rank]
