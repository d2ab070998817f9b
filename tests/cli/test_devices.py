"""--nproc-per-node auto|gpu|xpu|cpu without torch: device counting (NVIDIA, AMD ROCm, Intel
XPU, on fake sysfs trees and environments) and torchrun's resolution rules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aelastic.cli import devices
from aelastic.cli.devices import count_gpus, count_xpus, determine_local_world_size


def _gpus(n: int) -> int:
    return n


@pytest.mark.parametrize(
    ("physical", "visible", "expected"),
    [
        (0, None, 0),
        (4, None, 4),
        (4, "", 0),
        (4, "0,1", 2),
        (4, "3", 1),
        (4, "1,7,2", 1),  # CUDA stops at the first invalid index
        (4, "-1", 0),
        (2, "GPU-5a1b,GPU-77c2", 2),
        (2, "0,0", 1),
        (2, "0,1,2,3", 2),
        (0, "0,1", 0),
    ],
)
def test_count_gpus_honours_cuda_visible_devices(
    physical: int, visible: str | None, expected: int
) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert count_gpus(env, physical=lambda: physical) == expected


def test_physical_gpus_counts_driver_directories(tmp_path: os.PathLike[str]) -> None:
    for name in ("0000:00:04.0", "0000:00:05.0"):
        os.mkdir(os.path.join(tmp_path, name))
    assert devices._physical_gpus(str(tmp_path)) == 2


def test_physical_gpus_without_driver_is_zero_or_smi(tmp_path: os.PathLike[str]) -> None:
    missing = os.path.join(tmp_path, "nope")
    # No /proc entry: nvidia-smi decides, and this machine has none.
    assert devices._physical_gpus(missing) >= 0


@pytest.mark.parametrize(
    ("value", "gpus", "cpus", "expected"),
    [
        ("1", 0, 8, (1, "")),
        (" 4 ", 0, 8, (4, "")),
        ("cpu", 2, 8, (8, "cpu")),
        ("gpu", 2, 8, (2, "gpu")),
        ("auto", 2, 8, (2, "gpu")),
        ("auto", 0, 8, (8, "cpu")),
    ],
)
def test_determine_local_world_size(
    value: str, gpus: int, cpus: int, expected: tuple[int, str]
) -> None:
    got = determine_local_world_size(value, gpus=lambda: gpus, cpus=lambda: cpus)
    assert got == expected


@pytest.mark.parametrize("value", ["0", "-2", "tpu", "many", ""])
def test_determine_local_world_size_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        determine_local_world_size(value, gpus=lambda: 1, cpus=lambda: 1, xpus=lambda: 1)


@pytest.mark.parametrize(
    ("value", "gpus", "xpus", "expected"),
    [
        ("xpu", 0, 2, (2, "xpu")),
        ("auto", 0, 2, (2, "xpu")),
        ("auto", 4, 2, (4, "gpu")),
        ("auto", 0, 0, (8, "cpu")),
    ],
)
def test_xpu_and_auto_follow_torch_accelerator_order(
    value: str, gpus: int, xpus: int, expected: tuple[int, str]
) -> None:
    got = determine_local_world_size(value, gpus=lambda: gpus, cpus=lambda: 8, xpus=lambda: xpus)
    assert got == expected


def test_xpu_without_intel_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="Xpu is not available"):
        determine_local_world_size("xpu", gpus=lambda: 2, cpus=lambda: 4, xpus=lambda: 0)


def _kfd_node(root: Path, index: int, simds: int) -> None:
    node = root / "sys/class/kfd/kfd/topology/nodes" / str(index)
    node.mkdir(parents=True)
    (node / "properties").write_text(f"cpu_cores_count 0\nsimd_count {simds}\nmax_waves 10\n")


def test_amd_gpus_are_the_kfd_nodes_with_simds(tmp_path: Path) -> None:
    _kfd_node(tmp_path, 0, 0)  # the CPU
    _kfd_node(tmp_path, 1, 304)
    _kfd_node(tmp_path, 2, 304)
    assert devices._amd_gpus(str(tmp_path)) == 0  # no /dev/kfd: no ROCm driver
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/kfd").write_text("")
    assert devices._amd_gpus(str(tmp_path)) == 2


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 4),
        ({"ROCR_VISIBLE_DEVICES": "0,1"}, 2),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5"}, 4),
        ({"ROCR_VISIBLE_DEVICES": "1,2", "HIP_VISIBLE_DEVICES": "0"}, 1),
        ({"HIP_VISIBLE_DEVICES": "1,3"}, 2),
        ({"HIP_VISIBLE_DEVICES": "0,9,1"}, 1),  # HIP stops at the first invalid index
        ({"HIP_VISIBLE_DEVICES": "GPU-4a,GPU-5b"}, 2),
        ({"CUDA_VISIBLE_DEVICES": "2"}, 1),  # ROCm builds read it when HIP's is unset
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0,1,2"}, 1),
    ],
)
def test_amd_gpus_honour_rocm_visibility(env: dict[str, str], expected: int) -> None:
    assert count_gpus(env, physical=lambda: 0, amd=lambda: 4) == expected


def test_hip_listing_more_devices_than_rocr_is_an_error() -> None:
    env = {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(ValueError, match="more devices than ROCR_VISIBLE_DEVICES"):
        count_gpus(env, physical=lambda: 0, amd=lambda: 4)


def test_nvidia_gpus_are_counted_first() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "0,1,2"}
    assert count_gpus(env, physical=lambda: 2, amd=lambda: 8) == 1


def _drm_card(root: Path, name: str, vendor: str, driver: str) -> None:
    device = root / "sys/class/drm" / name / "device"
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    target = root / "sys/bus/pci/drivers" / driver
    target.mkdir(parents=True, exist_ok=True)
    (device / "driver").symlink_to(target)


def test_intel_gpus_are_drm_cards_of_intel_drivers(tmp_path: Path) -> None:
    _drm_card(tmp_path, "card0", "0x8086", "i915")
    _drm_card(tmp_path, "card1", "0x8086", "xe")
    _drm_card(tmp_path, "card2", "0x10de", "nvidia")
    _drm_card(tmp_path, "card3", "0x8086", "simpledrm")
    (tmp_path / "sys/class/drm/card0-DP-1").mkdir()
    (tmp_path / "sys/class/drm/renderD128").mkdir()
    assert devices._intel_gpus(str(tmp_path)) == 2
    assert devices._intel_gpus(str(tmp_path / "missing")) == 0


@pytest.mark.parametrize(
    ("mask", "expected"),
    [(None, 2), ("0", 1), ("0.0,0.1", 1), ("0,1", 2), ("1.0,5", 1), ("", 0)],
)
def test_xpus_honour_ze_affinity_mask(mask: str | None, expected: int) -> None:
    env = {} if mask is None else {"ZE_AFFINITY_MASK": mask}
    assert count_xpus(env, intel=lambda: 2) == expected


def test_gpu_without_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="Cuda is not available"):
        determine_local_world_size("gpu", gpus=lambda: 0, cpus=lambda: 4)


def test_count_cpus_matches_affinity() -> None:
    assert devices.count_cpus() == len(os.sched_getaffinity(0))
