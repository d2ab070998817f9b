"""Worker output: redirect/tee plans, prefixed console lines, per-attempt directories."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from aelastic.agent import ElasticAgent, Std, WorkerSpec, WorkerState
from aelastic.agent.output.logs import Target, line_prefix, plan_streams

from .helpers import make_handler, own_dir

pytestmark = pytest.mark.anyio

N, D, F, T = Target.INHERIT, Target.DEVNULL, Target.FILE, Target.TEE

PRINT = (
    "-c",
    "import os, sys\n"
    "r = os.environ['LOCAL_RANK']\n"
    "print(f'out {r}'); print(f'err {r}', file=sys.stderr)\n"
    "sys.stdout.write('no newline'); sys.stdout.flush()\n"
    "sys.exit(int(os.environ['TORCHELASTIC_RESTART_COUNT']) == 0 and r == '1')",
)


def spec(nproc: int = 4, **kwargs: object) -> WorkerSpec:
    handler = make_handler("logs")
    return WorkerSpec("trainer", nproc, handler, sys.executable, PRINT, **kwargs)  # type: ignore[arg-type]


def test_plans_follow_torch() -> None:
    assert plan_streams(spec(2), files=True) == {0: (N, N), 1: (N, N)}
    plans = plan_streams(spec(redirects="0:1,1:3", tee="1:1,2:2"), files=True)
    assert plans == {0: (F, N), 1: (T, F), 2: (N, T), 3: (N, N)}
    filtered = plan_streams(spec(redirects=Std.ERR, tee="0:1,1:1", local_ranks_filter={0}), True)
    assert filtered == {0: (T, F), 1: (F, F), 2: (D, F), 3: (D, F)}
    assert plan_streams(spec(2, redirects=3, tee=3), files=False) == {0: (N, N), 1: (N, N)}


def test_prefixes() -> None:
    assert line_prefix(spec(), 2, 7) == "[trainer2]:"
    templated = spec(log_line_prefix_template="[${role_name}-${rank}/${local_rank}]")
    assert line_prefix(templated, 2, 7) == "[trainer-7/2]"


async def test_redirect_and_tee_per_attempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = spec(2, redirects="0:1", tee="1:3", log_dir=str(tmp_path), max_restarts=1)
    result = await ElasticAgent(s).run()
    assert result.state is WorkerState.SUCCEEDED
    run_dir = own_dir(tmp_path, s.rdzv_handler.get_run_id())
    for attempt in (0, 1):
        rank0 = run_dir / f"attempt_{attempt}" / "0"
        rank1 = run_dir / f"attempt_{attempt}" / "1"
        if attempt == 1:  # in attempt 0, rank 0 may be stopped before it printed
            assert (rank0 / "stdout.log").read_text() == "out 0\nno newline"
        assert not (rank0 / "stderr.log").exists()
        assert (rank1 / "stdout.log").read_text() == "out 1\nno newline"
        assert (rank1 / "stderr.log").read_text() == "err 1\n"
    console = capsys.readouterr()
    # Teed lines reach the console prefixed, one per line, the unfinished line included.
    assert console.out.count("[trainer1]:out 1\n") == 2
    assert console.out.count("[trainer1]:no newline\n") == 2
    assert console.err.count("[trainer1]:err 1\n") == 2
    assert "out 0" not in console.out  # redirected only


async def test_devnull_log_dir_disables_files() -> None:
    s = spec(1, log_dir=os.devnull)
    s.args = ("-c", "import os; assert os.environ['TORCHELASTIC_ERROR_FILE'] == ''")
    assert (await ElasticAgent(s).run()).state is WorkerState.SUCCEEDED


async def test_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(NotADirectoryError):
        await ElasticAgent(spec(1, log_dir=str(target))).run()


async def test_teed_lines_matching_the_filters_are_duplicated_to_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = (
        "import os, sys\n"
        "r = os.environ['LOCAL_RANK']\n"
        "print(f'loss {r}'); print(f'noise {r}'); print(f'acc, {r}')\n"
        "print(f'warn {r}', file=sys.stderr); print(f'debug {r}', file=sys.stderr)\n"
    )
    s = spec(
        3,
        tee="0:3,1:3,2:1",
        local_ranks_filter={0, 1},  # rank 2's teed lines are not shown: not duplicated either
        log_dir=str(tmp_path),
        duplicate_stdout_filters=["loss", "acc,"],
        duplicate_stderr_filters=("warn",),
    )
    s.args = ("-c", code)
    assert (await ElasticAgent(s).run()).state is WorkerState.SUCCEEDED
    attempt = own_dir(tmp_path, s.rdzv_handler.get_run_id()) / "attempt_0"
    out = (attempt / "filtered_stdout.log").read_text().splitlines()
    assert sorted(out) == [
        "[trainer0]:acc, 0",
        "[trainer0]:loss 0",
        "[trainer1]:acc, 1",
        "[trainer1]:loss 1",
    ]
    err = (attempt / "filtered_stderr.log").read_text().splitlines()
    assert sorted(err) == ["[trainer0]:warn 0", "[trainer1]:warn 1"]
    console = capsys.readouterr()
    assert "[trainer0]:noise 0" in console.out  # the console still gets every teed line


async def test_filters_without_tee_leave_an_empty_file_as_torchs(tmp_path: Path) -> None:
    s = spec(1, log_dir=str(tmp_path), duplicate_stdout_filters=["out"])
    assert (await ElasticAgent(s).run()).state is WorkerState.SUCCEEDED
    attempt = own_dir(tmp_path, s.rdzv_handler.get_run_id()) / "attempt_0"
    assert (attempt / "filtered_stdout.log").read_text() == ""
    assert not (attempt / "filtered_stderr.log").exists()
