"""Hang detection with no number to choose: real ``aelastic run`` processes (gloo, CPU, torch)
with no hang flag (``--stall-timeout auto`` and the 30-minute start-up bound are the
defaults; the start-up bound is set small where a test waits for it).

* A rank asleep inside step 5 (steps of about 50 ms) is named with its host, rank and stuck
  line within 30 s of falling asleep, and the job finishes on its next attempt.
* A rank waiting in ``init_process_group`` for a peer that never starts its group (busy
  preparing data) is named within the start-up bound (and the minute at most it gives the
  rank at fault), with its stuck line; the job finishes on its next attempt.
* An evaluation 3x as long as the slowest training step every 10 steps, and phases far
  longer than the learned bound that work without steps (a 20 s evaluation, a 15 s
  checkpoint with the peer in a barrier, a 15 s read of a slowly written file), run to the
  end with no hang reported.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ._proc import Cli

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).with_name("_hang_train.py")
LINES = SCRIPT.read_text().splitlines()
STUCK_LINE = next(n for n, line in enumerate(LINES, 1) if "the stuck line" in line)
INIT_LINE = next(n for n, line in enumerate(LINES, 1) if "the init line" in line)


def _run(tmp_path: Path, mode: str, *flags: str) -> Cli:
    args = ["run", "--standalone", "--nproc-per-node=2", "--max-restarts=1", *flags]
    return Cli([*args, str(SCRIPT), mode], tmp_path, env={"HANG_DIR": str(tmp_path)})


def _no_hang(cli: Cli) -> None:
    assert not [x for x in cli.lines if "hung" in x or "stalled" in x], cli.output
    assert "restarting the workers" not in cli.output, cli.output


def test_a_rank_asleep_at_step_5_is_named_within_30_s_and_the_job_finishes(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch.distributed")
    with _run(tmp_path, "sleep") as cli:
        cli.wait_for(lambda lines: any("is hung" in x for x in lines), 200)
        seen = time.time()
        assert cli.wait(150) == 0, cli.output
    hung_at = float((tmp_path / "hang").read_text())
    [line] = [x for x in cli.lines if "is hung" in x]
    assert seen - hung_at < 30, (seen - hung_at, cli.output)
    assert "rank 1 (local 1, pid " in line and " on host " in line, line
    assert "no progress for " in line and "after 4 step(s)" in line, line
    assert "learned from the step times" in line, line
    assert f"stuck at {SCRIPT}:{STUCK_LINE} in train_step" in line, line
    assert "hangs: the bound is learned from the step times" in cli.output  # said at start
    assert "rank 0 finished on attempt 1" in cli.output
    assert "rank 1 finished on attempt 1" in cli.output
    root = [x for x in cli.lines if "root cause of the job's failure" in x]
    assert root and all("rank 1 (local rank 1)" in x for x in root), cli.output


def test_a_rank_waiting_in_init_process_group_is_named_within_the_startup_bound(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch.distributed")
    bound = 8.0
    with _run(tmp_path, "init", f"--startup-timeout={bound:g}") as cli:
        cli.wait_for(lambda lines: any("started 2 workers" in x for x in lines), 120)
        started = time.monotonic()
        cli.wait_for(lambda lines: any("is hung" in x for x in lines), 200)
        took = time.monotonic() - started
        assert cli.wait(150) == 0, cli.output
    [waiting] = [x for x in cli.lines if "waiting in torch.distributed" in x]
    [hung] = [x for x in cli.lines if "is hung" in x]
    for line in (waiting, hung):
        assert "rank 0 (local 0, pid " in line and " on host " in line, line
        assert "no first step" in line and f"(start-up bound {bound:g} s)" in line, line
    assert "waiting a minute at most for the rank at fault" in waiting, waiting
    assert f"stuck at {SCRIPT}:{INIT_LINE} in main (innermost: " in hung, hung
    assert "torch/distributed" in hung  # the innermost frame: inside the group's set-up
    # The bound and the wait for the rank at fault (the bound again here), plus the import
    # of torch on a loaded machine (the bound counts from the workers' start; a worker is
    # watched once its bootstrap saw torch) and the looks from outside.
    assert 2 * bound <= took + 1.0 and took < 2 * bound + 60, (took, cli.output)
    assert "start-up bound 8 s (--startup-timeout)" in cli.output
    assert "rank 0 finished on attempt 1" in cli.output
    assert "rank 1 finished on attempt 1" in cli.output


def test_an_evaluation_3x_the_slowest_step_every_10_steps_is_no_hang(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    with _run(tmp_path, "evals") as cli:
        assert cli.wait(200) == 0, cli.output
    _no_hang(cli)
    assert "rank 0 finished on attempt 0" in cli.output
    assert "rank 1 finished on attempt 0" in cli.output


def test_long_phases_that_work_without_steps_are_no_hang(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    with _run(tmp_path, "long") as cli:
        assert cli.wait(250) == 0, cli.output
    _no_hang(cli)
    assert "rank 0 finished on attempt 0" in cli.output
    assert "rank 1 finished on attempt 0" in cli.output
