"""--numa-binding: the mapping from a topology to CPU sets per local rank, read from fake sysfs
trees, checked against torch 2.13's own rules, and applied to real workers on this machine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aelastic.agent import ElasticAgent, NumaBindingError, WorkerSpec
from aelastic.agent.processes.numa import Topology, bindings, cpus_for, format_cpus, parse_cpus

from .helpers import WorkerHub, make_handler, running, worker_spec

pytestmark = pytest.mark.timeout(120)


@dataclass
class Machine:
    """A machine to write as a sysfs tree: CPUs by NUMA node, and what each CPU shares."""

    nodes: Mapping[int, Sequence[int]]
    #: cpu -> package; default 0.
    package: Mapping[int, int] = field(default_factory=dict)
    #: groups of hyperthread siblings; default one CPU per core.
    cores: Sequence[Sequence[int]] = ()
    #: groups of CPUs sharing the L3 cache; default one cache per node.
    l3: Sequence[Sequence[int]] = ()
    #: NUMA node of each GPU in PCI order (-1: sysfs' "no node").
    gpus: Sequence[int] = ()
    gpu_vendor: str = "0x10de"

    def write(self, root: Path) -> Path:
        node_dir = root / "sys/devices/system/node"
        node_dir.mkdir(parents=True)
        (node_dir / "possible").write_text(format_cpus(self.nodes) + "\n")
        cpus = sorted(c for cpus in self.nodes.values() for c in cpus)
        for node, mine in self.nodes.items():
            (node_dir / f"node{node}").mkdir()
            (node_dir / f"node{node}/cpulist").write_text(format_cpus(mine) + "\n")
        siblings = {c: [c] for c in cpus}
        for group in self.cores:
            siblings.update({c: list(group) for c in group})
        shared = {c: list(self.nodes[n]) for n in self.nodes for c in self.nodes[n]}
        for group in self.l3:
            shared.update({c: list(group) for c in group})
        for cpu in cpus:
            base = root / f"sys/devices/system/cpu/cpu{cpu}"
            (base / "topology").mkdir(parents=True)
            (base / "topology/physical_package_id").write_text(f"{self.package.get(cpu, 0)}\n")
            (base / "topology/thread_siblings_list").write_text(format_cpus(siblings[cpu]))
            caches = [("Data", 1, [cpu]), ("Instruction", 1, [cpu]), ("Unified", 2, [cpu])]
            caches.append(("Unified", 3, shared[cpu]))
            for index, (kind, level, group) in enumerate(caches):
                cache = base / f"cache/index{index}"
                cache.mkdir(parents=True)
                (cache / "type").write_text(kind + "\n")
                (cache / "level").write_text(f"{level}\n")
                (cache / "shared_cpu_list").write_text(format_cpus(group) + "\n")
        pci = root / "sys/bus/pci/devices"
        pci.mkdir(parents=True)
        _pci(pci / "0000:00:1f.0", "0x8086", "0x060100", 0)  # a bridge: not a GPU
        for index, node in enumerate(self.gpus):
            _pci(pci / f"0000:{0x10 + index:02x}:00.0", self.gpu_vendor, "0x030200", node)
        return root


def _pci(path: Path, vendor: str, kind: str, node: int) -> None:
    path.mkdir()
    (path / "vendor").write_text(vendor + "\n")
    (path / "class").write_text(kind + "\n")
    (path / "numa_node").write_text(f"{node}\n")


def read(tmp_path: Path, machine: Machine, **kwargs: Any) -> Topology:
    root = machine.write(tmp_path / "root")
    kwargs.setdefault("allowed", {c for cpus in machine.nodes.values() for c in cpus})
    kwargs.setdefault("visible_devices", None)
    return Topology.read(str(root), **kwargs)


def per_rank(topology: Topology, mode: str, nprocs: int) -> list[str]:
    return [format_cpus(cpus_for(topology, mode, rank, nprocs)) for rank in range(nprocs)]


# Two sockets, each with two NUMA nodes of four cores of two hyperthreads (0-7 and 32-39 are
# siblings in the Linux numbering: core i holds cpus i and i + 32); two L3 caches per node.
def big_machine(gpus: Sequence[int] = (0, 0, 1, 1, 2, 2, 3, 3)) -> Machine:
    nodes = {n: [*range(n * 8, n * 8 + 8), *range(32 + n * 8, 32 + n * 8 + 8)] for n in range(4)}
    return Machine(
        nodes=nodes,
        package={c: (c % 32) // 16 for c in range(64)},
        cores=[[c, c + 32] for c in range(32)],
        l3=[[*range(b, b + 4), *range(b + 32, b + 36)] for b in range(0, 32, 4)],
        gpus=gpus,
    )


def test_cpu_lists_parse_and_format_as_sysfs() -> None:
    assert parse_cpus("0-2,4,6-7\n") == {0, 1, 2, 4, 6, 7}
    assert parse_cpus("") == set()
    assert format_cpus({7, 0, 1, 2, 4, 6}) == "0-2,4,6-7"
    with pytest.raises(ValueError):
        parse_cpus("zero")


def test_node_binds_each_gpu_to_its_numa_node(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine())
    assert topology.gpu_nodes == (0, 0, 1, 1, 2, 2, 3, 3)
    assert per_rank(topology, "node", 8)[1:3] == ["0-7,32-39", "8-15,40-47"]


def test_socket_binds_to_every_node_of_the_gpus_socket(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine())
    assert per_rank(topology, "socket", 8)[0] == "0-15,32-47"
    assert per_rank(topology, "socket", 8)[7] == "16-31,48-63"


def test_exclusive_splits_the_physical_cores_of_a_node(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine())
    # Node 0 has 8 cores for GPUs 0 and 1: 4 cores (8 hyperthreads) each.
    assert per_rank(topology, "exclusive", 8)[:2] == ["0-3,32-35", "4-7,36-39"]
    # Three GPUs on node 0: 8 cores -> 3, 3, 2 (the lowest GPUs get the extra core).
    three = read(tmp_path / "3", big_machine(gpus=(0, 0, 0, 1)))
    assert per_rank(three, "exclusive", 4)[:3] == ["0-2,32-34", "3-5,35-37", "6-7,38-39"]


def test_exclusive_with_fewer_cores_than_gpus_is_an_error(tmp_path: Path) -> None:
    topology = read(tmp_path, Machine(nodes={0: [0, 1]}, gpus=(0, 0, 0)))
    with pytest.raises(NumaBindingError, match=r"2 physical core.* for 3 GPUs"):
        cpus_for(topology, "exclusive", 0, 3)


def test_core_complex_gives_each_gpu_its_own_l3(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine())
    assert per_rank(topology, "core-complex", 8)[:2] == ["0-3,32-35", "4-7,36-39"]
    # More GPUs than caches on a node: they wrap around.
    crowded = read(tmp_path / "c", big_machine(gpus=(0, 0, 0)))
    assert per_rank(crowded, "core-complex", 3) == ["0-3,32-35", "4-7,36-39", "0-3,32-35"]


def test_core_complex_prefers_the_caches_with_most_allowed_cpus(tmp_path: Path) -> None:
    machine = big_machine(gpus=(0,))
    allowed = set(range(64)) - {0, 1}
    topology = read(tmp_path, machine, allowed=allowed)
    assert per_rank(topology, "core-complex", 1) == ["4-7,36-39"]


def test_only_cpus_this_process_may_use_are_given(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine(), allowed=set(range(0, 64, 2)))
    assert per_rank(topology, "node", 8)[0] == "0,2,4,6,32,34,36,38"
    gone = read(tmp_path / "g", big_machine(), allowed={*range(8, 32), *range(40, 64)})
    with pytest.raises(NumaBindingError, match="no CPU left for local rank 0 on NUMA node 0"):
        cpus_for(gone, "node", 0, 8)


def test_cuda_visible_devices_renumbers_the_gpus(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine(), visible_devices="6,1")
    assert topology.gpu_nodes == (3, 0)
    assert per_rank(topology, "node", 2) == ["24-31,56-63", "0-7,32-39"]
    with pytest.raises(NumaBindingError, match="needs device indices"):
        read(tmp_path / "u", big_machine(), visible_devices="GPU-8f0c1a")
    with pytest.raises(NumaBindingError, match="no GPU 9"):
        read(tmp_path / "m", big_machine(), visible_devices="9")


def test_a_local_rank_without_a_gpu_is_an_error(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine(gpus=(0, 1)))
    with pytest.raises(NumaBindingError, match="local rank 2 has no GPU"):
        cpus_for(topology, "node", 2, 3)


def test_amd_gpus_and_gpus_without_a_node(tmp_path: Path) -> None:
    machine = Machine(nodes={0: [0, 1], 1: [2, 3]}, gpus=(-1, 1), gpu_vendor="0x1002")
    topology = read(tmp_path, machine)
    assert topology.gpu_nodes == (0, 1)  # sysfs' -1 is node 0, as torch reads it


def test_without_gpus_local_ranks_are_spread_over_the_nodes_in_blocks(tmp_path: Path) -> None:
    topology = read(tmp_path, big_machine(gpus=()))
    assert per_rank(topology, "node", 4) == [
        "0-7,32-39",
        "8-15,40-47",
        "16-23,48-55",
        "24-31,56-63",
    ]
    # 8 workers on 4 nodes: two per node, each with half of the node's cores.
    assert per_rank(topology, "exclusive", 8)[:2] == ["0-3,32-35", "4-7,36-39"]
    # Fewer workers than nodes: the first nodes of each block.
    assert per_rank(topology, "node", 2) == ["0-7,32-39", "16-23,48-55"]


def test_a_memory_only_node_is_skipped(tmp_path: Path) -> None:
    machine = Machine(nodes={0: [0, 1], 1: [2, 3], 2: []}, package={2: 0, 3: 0})
    topology = read(tmp_path, machine)
    assert per_rank(topology, "socket", 2) == ["0-3", "0-3"]
    assert per_rank(topology, "node", 3) == ["0-1", "0-1", "2-3"]


def test_a_missing_topology_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NumaBindingError, match=r"cannot read the NUMA topology: .*possible"):
        Topology.read(str(tmp_path), allowed={0}, visible_devices=None)


def test_numactl_wraps_the_command_else_the_child_binds_itself(tmp_path: Path) -> None:
    topology = read(tmp_path, Machine(nodes={0: [0, 1, 2, 3]}))
    wrapped = bindings("exclusive", 2, topology, numactl="/usr/bin/numactl")[1]
    assert wrapped.command(["python", "x.py"]) == [
        "/usr/bin/numactl",
        "--physcpubind=2-3",
        "python",
        "x.py",
    ]
    assert wrapped.affinity is None
    direct = bindings("exclusive", 2, topology, numactl=None)[1]
    assert direct.command(["python"]) == ["python"] and direct.affinity == {2, 3}


def test_no_numactl_and_no_affinity_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology = read(tmp_path, Machine(nodes={0: [0, 1]}))
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(NumaBindingError, match="needs numactl or CPU affinity"):
        bindings("node", 1, topology, numactl=None)


def test_the_spec_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="numa_binding must be one of"):
        WorkerSpec("r", 1, make_handler("numa-spec"), "x", numa_binding="nodes")


# -- parity with torch 2.13 -------------------------------------------------------------------


@st.composite
def machines(draw: st.DrawFn) -> Topology:
    """Random topologies: nodes on sockets, cores of 1-2 threads, L3 groups, GPUs, and an
    affinity leaving each node at least one CPU (a node with none makes torch fail)."""
    nodes = draw(st.integers(1, 4))
    sockets = draw(st.integers(1, nodes))
    cores = draw(st.integers(1, 6))
    threads = draw(st.integers(1, 2))
    caches = draw(st.integers(1, 3))
    total = nodes * cores
    node_cpus: dict[int, set[int]] = {n: set() for n in range(nodes)}
    package, core, cache = {}, {}, {}
    for g in range(total):
        node = g // cores
        group = (g % cores) * caches // cores
        for t in range(threads):
            cpu = t * total + g
            node_cpus[node].add(cpu)
            package[cpu] = node * sockets // nodes
            core[cpu] = g
            cache[cpu] = node * cores + min(c for c in range(cores) if c * caches // cores == group)
    every = sorted(package)
    allowed = set(draw(st.sets(st.sampled_from(every))))
    for cpus in node_cpus.values():
        if not cpus & allowed:
            allowed.add(draw(st.sampled_from(sorted(cpus))))
    gpus = tuple(draw(st.lists(st.integers(0, nodes - 1), min_size=1, max_size=8)))
    frozen = {n: frozenset(c) for n, c in node_cpus.items()}
    return Topology(frozen, package, core, cache, frozenset(allowed), gpus)


def _same(mapping: Mapping[int, int], cpu: int) -> set[int]:
    return {c for c, key in mapping.items() if key == mapping[cpu]}


@pytest.fixture
def torch_rules(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """torch 2.13's ``_get_logical_cpus_to_bind_to``, its sysfs and CUDA reads answered from
    the :class:`Topology` put in ``torch_rules.topology``."""
    binding = pytest.importorskip("torch.numa.binding")

    class Rules:
        topology: Topology

        def __call__(self, mode: str, gpu: int) -> set[int]:
            options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
            result: set[int] = binding._get_logical_cpus_to_bind_to(
                gpu_index=gpu, numa_options=options
            )
            return result

    rules = Rules()
    answers = {
        "_get_numa_node_index_for_gpu_index": lambda gpu_index: rules.topology.gpu_nodes[gpu_index],
        "_get_gpu_count": lambda: len(rules.topology.gpu_nodes),
        "_get_cpu_indices_for_numa_node_MAYBE_NOT_ALLOWED": lambda numa_node_index: set(
            rules.topology.node_cpus[numa_node_index]
        ),
        "_get_allowed_cpu_indices_for_current_thread": lambda: set(rules.topology.allowed),
        "_get_logical_cpu_indices_sharing_same_physical_core_as": lambda logical_cpu_index: _same(
            rules.topology.core, logical_cpu_index
        ),
        "_get_logical_cpus_sharing_same_max_level_cache_as": lambda logical_cpu_index: _same(
            rules.topology.cache, logical_cpu_index
        ),
        "_get_systemwide_numa_node_indices": lambda: set(rules.topology.node_cpus),
        "_get_socket_index_for_cpu": lambda cpu_index: rules.topology.package[cpu_index],
    }
    for name, answer in answers.items():
        assert hasattr(binding, name), name  # torch's helper is still there
        monkeypatch.setattr(binding, name, answer)
    yield rules


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(topology=machines())
def test_every_mode_binds_as_torch_does(torch_rules: Any, topology: Topology) -> None:
    torch_rules.topology = topology
    gpus = len(topology.gpu_nodes)
    for mode in ("node", "socket", "exclusive", "core-complex"):
        for gpu in range(gpus):
            try:
                expected: set[int] | None = torch_rules(mode, gpu)
            except RuntimeError:
                expected = None
            if expected is None:
                with pytest.raises(NumaBindingError):
                    cpus_for(topology, mode, gpu, gpus)
            else:
                assert cpus_for(topology, mode, gpu, gpus) == expected, (mode, gpu)


# -- real workers on this machine -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["node", "exclusive"])
@pytest.mark.parametrize("tool", ["affinity", "numactl"])
async def test_workers_run_on_the_cpus_the_mapping_gives(
    run_id: str, mode: str, tool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if tool == "numactl" and shutil.which("numactl") is None:
        pytest.skip("numactl is not installed")
    if tool == "affinity":  # numactl out of reach: the child binds itself
        monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    planned = bindings(mode, 2)
    assert (planned[0].numactl is not None) == (tool == "numactl")
    expected = {rank: sorted(b.cpus) for rank, b in planned.items()}
    async with WorkerHub() as hub:
        spec = worker_spec(make_handler(run_id), hub, "affinity", 2, numa_binding=mode)
        async with running(ElasticAgent(spec)) as task:
            hellos = await hub.gather(2)
            for hello in hellos:
                hub.release(hello["pid"])
            result = await task
    assert not result.is_failed()
    assert {h["local_rank"]: h["cpus"] for h in hellos} == expected


@pytest.mark.anyio
async def test_a_binding_that_cannot_be_applied_fails_before_the_rendezvous(
    run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aelastic.agent.processes import numa

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    numa._this_machine.cache_clear()
    try:
        async with WorkerHub() as hub:
            spec = worker_spec(make_handler(run_id), hub, "report", 2, numa_binding="exclusive")
            agent = ElasticAgent(spec)
            with pytest.raises(NumaBindingError, match="1 physical core"):
                await agent.run()
        assert agent.metrics.rendezvous_count == 0
    finally:
        numa._this_machine.cache_clear()
