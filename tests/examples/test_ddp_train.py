"""examples/ddp_train.py under `aelastic run`: the README's command, a crash, a smaller world."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ._run import run

pytest.importorskip("torch")


def test_readme_quick_start_command() -> None:
    # aelastic run --standalone --nproc-per-node 2 examples/ddp_train.py
    code, out = run(
        ["-m", "aelastic", "run", "--standalone", "--nproc-per-node", "2", "examples/ddp_train.py"]
    )
    assert code == 0, out
    assert "[ddp_train] world size 2 (gloo), attempt 0, starting from scratch" in out
    assert "[ddp_train] done: 40 steps" in out
    learned = re.search(r"learned y = ([-\d.]+)\*x0 ([-+\d.]+)\*x1 ([-+\d.]+)", out)
    assert learned, out
    assert [round(float(v), 1) for v in learned.groups()] == [3.0, -2.0, 0.5]
    assert "all workers of this node succeeded" in out


@pytest.mark.slow
def test_crash_restart_resume_then_a_smaller_world(tmp_path: Path) -> None:
    checkpoints = str(tmp_path / "ckpt")
    common = ["examples/ddp_train.py", f"--checkpoint-dir={checkpoints}", "--checkpoint-every=5"]
    # Rank 1 crashes at step 12 (first attempt only): restart, resume from step 10.
    code, out = run(
        [
            "-m",
            "aelastic",
            "run",
            "--nproc-per-node=2",
            "--max-restarts=1",
            *common,
            "--steps=15",
            "--crash-at-step=12",
            "--crash-rank=1",
        ]
    )
    assert code == 0, out
    assert "simulated crash of rank 1 at step 12" in out
    assert "restarting the workers" in out
    assert "world size 2 (gloo), attempt 1, resuming at step 10" in out
    assert "done: 15 steps" in out
    # The same job goes on with one worker: it resumes where two left off.
    code, out = run(["-m", "aelastic", "run", "--nproc-per-node=1", *common, "--steps=20"])
    assert code == 0, out
    assert "world size 1 (gloo), attempt 0, resuming at step 15" in out
    assert "done: 20 steps" in out
