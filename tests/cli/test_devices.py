"""--nproc-per-node auto|gpu|cpu without torch: GPU counting and torchrun's resolution rules."""

from __future__ import annotations

import os

import pytest

from aelastic.cli import devices
from aelastic.cli.devices import count_gpus, determine_local_world_size


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


@pytest.mark.parametrize("value", ["0", "-2", "xpu", "many", ""])
def test_determine_local_world_size_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        determine_local_world_size(value, gpus=lambda: 1, cpus=lambda: 1)


def test_gpu_without_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="Cuda is not available"):
        determine_local_world_size("gpu", gpus=lambda: 0, cpus=lambda: 4)


def test_count_cpus_matches_affinity() -> None:
    assert devices.count_cpus() == len(os.sched_getaffinity(0))
