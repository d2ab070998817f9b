"""Logs are never deleted: each agent writes in a directory of its own under ``--log-dir``
(torch's ``<log-dir>/<job id>_<random>/attempt_<n>/<local rank>/``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests._ports import free_port

from ._proc import Cli, run_cli

# Says who it is on stdout, writes an error file as torch's @record does, and fails.
FAIL = """
import json, os, sys
print(f"run={sys.argv[1]} rank={os.environ['RANK']}", flush=True)
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
    json.dump({"message": {"message": f"ValueError: run {sys.argv[1]}"}}, fp)
sys.exit(3)
"""

HELLO = """
import os, sys
print(f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']}", flush=True)
"""


def _script(tmp_path: Path, name: str, code: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(code))
    return name


def test_a_job_run_again_with_its_id_keeps_the_first_runs_logs(tmp_path: Path) -> None:
    script = _script(tmp_path, "fail.py", FAIL)
    args = ["run", "--rdzv-backend", "memory", "--rdzv-id", "fixed", "--log-dir", "logs"]
    for run in ("first", "second"):
        code, out = run_cli([*args, "--redirects", "3", script, run], tmp_path)
        assert code == 1, out
    dirs = sorted((tmp_path / "logs").iterdir())
    assert [d.name.startswith("fixed_") for d in dirs] == [True, True], dirs
    runs = set()
    for run_dir in dirs:
        worker = run_dir / "attempt_0" / "0"
        said = (worker / "stdout.log").read_text()
        error = json.loads((worker / "error.json").read_text())["message"]["message"]
        run = said.split()[0].removeprefix("run=")
        assert error == f"ValueError: run {run}"
        runs.add(run)
    assert runs == {"first", "second"}


def test_two_agents_sharing_a_log_dir_both_keep_their_logs(tmp_path: Path) -> None:
    script = _script(tmp_path, "hello.py", HELLO)
    args = [
        "run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "shared",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--log-dir", "logs", "--redirects", "3",
        script,
    ]  # fmt: skip
    with Cli(args, tmp_path) as a, Cli(args, tmp_path) as b:
        assert a.wait(120) == 0, a.output
        assert b.wait(120) == 0, b.output
    dirs = sorted((tmp_path / "logs").iterdir())
    assert len(dirs) == 2 and all(d.name.startswith("shared_") for d in dirs), dirs
    said = sorted((d / "attempt_0" / "0" / "stdout.log").read_text() for d in dirs)
    assert said == ["rank=0 world=2\n", "rank=1 world=2\n"]
