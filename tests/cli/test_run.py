"""`aelastic run` end to end: real launcher subprocesses, real workers, real signals."""

from __future__ import annotations

import json
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from ._proc import Cli, alive, run_cli

HELLO = """
import os
print(f"hello rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"local={os.environ['LOCAL_RANK']} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}",
      flush=True)
"""

# Fails on rank 1 like torch's @record would: the error file says why (no torch needed).
FAIL = """
import json, os, sys, time
if os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
        extra = {"py_callstack": "Traceback...", "timestamp": "0"}
        message = {"message": "ValueError: bad batch at step 3", "extraInfo": extra}
        json.dump({"message": message}, fp)
    sys.exit(3)
time.sleep(60)
"""

SLEEP = """
import os, signal, sys, time
if len(sys.argv) > 1 and sys.argv[1] == "--ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(1, f"worker pid={os.getpid()}\\n".encode())  # one atomic write
time.sleep(120)
"""


def _script(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return name  # the tests run the launcher in tmp_path


def test_standalone_two_workers(tmp_path: Path) -> None:
    script = _script(tmp_path, "hello.py", HELLO)
    code, out = run_cli(["run", "--standalone", "--nproc-per-node", "2", script], tmp_path)
    assert code == 0, out
    assert "hello rank=0 world=2 local=0 restart=0" in out
    assert "hello rank=1 world=2 local=1 restart=0" in out
    # The console says what happens, one line each, with timings.
    assert re.search(r"\[aelastic \+\d+\.\d+s\] launching hello\.py: 2 workers per node", out)
    assert re.search(r"rendezvous round \d+ complete in \d+ ms", out)
    assert re.search(r"started 2 workers \(pid \d+, \d+\) in \d+ ms", out)
    assert "all workers of this node succeeded" in out


def test_default_is_standalone_like_torchrun(tmp_path: Path) -> None:
    script = _script(tmp_path, "hello.py", HELLO)
    code, out = run_cli(["run", "-q", script], tmp_path)
    assert code == 0, out
    assert "hello rank=0 world=1" in out
    assert "[aelastic" not in out  # --quiet


def test_module_and_script_args(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text(
        "import os, sys\nos.write(1, f'args {sys.argv[1:]}\\n'.encode())\n"
    )
    code, out = run_cli(["run", "-q", "-m", "mymod", "--lr", "0.1", "-m"], tmp_path)
    assert code == 0, out
    assert "args ['--lr', '0.1', '-m']" in out


def test_no_python(tmp_path: Path) -> None:
    code, out = run_cli(["run", "-q", "--no-python", "/bin/echo", "plain", "command"], tmp_path)
    assert code == 0, out
    assert "plain command" in out


def test_failing_worker_reports_the_root_cause(tmp_path: Path) -> None:
    script = _script(tmp_path, "fail.py", FAIL)
    code, out = run_cli(
        ["run", "--nproc-per-node", "2", "--shutdown-timeout", "5", script], tmp_path
    )
    assert code == 1, out  # torchrun's exit code for failed workers
    [root] = [line for line in out.splitlines() if "root cause of the job's failure" in line]
    assert "rank 1 (local rank 1)" in root and "failed with exit code 3" in root, out
    report = out[out.index("fail.py FAILED") : out.index(root)]
    assert "Root Cause (first observed failure):\n[0]:" in report, out
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: " in report
    # No --log-dir: the temporary logs go with the run, so the report says what the error
    # file said (its traceback: the worker did not print it), never a path that is gone.
    assert "error_file: <not kept: no log_dir>\n  traceback : Traceback..." in report, out
    assert "error.json" not in out, out


def test_log_dir_keeps_the_error_files_of_a_failed_run(tmp_path: Path) -> None:
    script = _script(tmp_path, "fail.py", FAIL)
    args = ["run", "--nproc-per-node", "2", "--shutdown-timeout", "5", "--log-dir", "logs"]
    code, out = run_cli([*args, script], tmp_path)
    assert code == 1, out
    shown = re.findall(r"error_file: (.*error\.json)", out)
    assert shown, out
    path = tmp_path / shown[-1]
    assert path.is_file(), out  # still there after the launcher exited
    message = json.loads(path.read_text())["message"]
    assert message["message"] == "ValueError: bad batch at step 3"


RAISE = """
import time

def load(shard):
    raise ValueError(f"the data shard {shard} is corrupt")

time.sleep(0.2)
load(7)
"""


def test_a_failure_is_reported_once_the_workers_traceback_then_torchs_report(
    tmp_path: Path,
) -> None:
    """A real failing script: its traceback once (the worker's own output), then this
    node's report in torch's shape under the entrypoint's name, then the job's root cause,
    each once."""
    script = _script(tmp_path, "fail.py", RAISE)
    code, out = run_cli(["run", "--standalone", script], tmp_path)
    assert code == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count('raise ValueError(f"the data shard {shard} is corrupt")') == 1, out
    assert out.count("FAILED") == 1 and "default FAILED" not in out, out
    assert out.count("root cause of the job's failure") == 1, out
    lines = out.splitlines()
    traceback_at = lines.index("Traceback (most recent call last):")
    title_at = lines.index("fail.py FAILED")  # the entrypoint's name, as torch says it
    assert traceback_at < title_at
    rule = "=" * len(lines[title_at - 1])
    assert lines[title_at - 1] == rule and lines[title_at + 1] == "-" * len(rule)
    end = lines.index(rule, title_at)
    assert lines[title_at + 2 : title_at + 6] == [
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "-" * len(rule),
        "Root Cause (first observed failure):",
    ]
    report = "\n".join(lines[title_at:end])
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: " in report
    assert "  traceback : ValueError: the data shard 7 is corrupt (the traceback is above" in report
    [root] = lines[end + 1 :]  # the last line
    assert "root cause of the job's failure 1: rank 0 (local rank 0)" in root
    assert root.endswith("exit code 1: ValueError: the data shard 7 is corrupt (1 node failed)")


def test_worker_killed_by_a_signal(tmp_path: Path) -> None:
    script = _script(
        tmp_path, "die.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    code, out = run_cli(["run", script], tmp_path)
    assert code == 1
    assert "failed with signal SIGKILL" in out


def test_restart_then_success(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "flaky.py",
        """
        import os, sys
        os.write(1, f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n".encode())
        sys.exit(1 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
        """,
    )
    code, out = run_cli(["run", "--max-restarts", "2", script], tmp_path)
    assert code == 0, out
    assert "restart 0" in out and "restart 1" in out
    assert "restarting the workers" in out and "1 restart left" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_workers(tmp_path: Path, sig: signal.Signals) -> None:
    script = _script(tmp_path, "sleep.py", SLEEP)
    with Cli(["run", "--nproc-per-node", "2", script], tmp_path) as cli:
        cli.wait_for(lambda lines: len(re.findall(r"worker pid=\d+", "\n".join(lines))) == 2)
        pids = [int(m) for m in re.findall(r"worker pid=(\d+)", cli.output)]
        assert all(alive(pid) for pid in pids)
        cli.signal(sig)
        code = cli.wait(60)
    assert code == 1, cli.output  # torchrun exits with 1 after a signal
    assert f"received {sig.name}" in cli.output
    assert not [pid for pid in pids if alive(pid)]


def test_sigterm_grace_then_sigkill(tmp_path: Path) -> None:
    script = _script(tmp_path, "stubborn.py", SLEEP)
    args = ["run", "--shutdown-timeout", "1", script, "--ignore-term"]
    with Cli(args, tmp_path) as cli:
        cli.wait_for(lambda lines: any("worker pid=" in line for line in lines))
        pid = int(re.findall(r"worker pid=(\d+)", cli.output)[0])
        cli.signal(signal.SIGTERM)
        code = cli.wait(60)
    assert code == 1
    assert not alive(pid)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--nnodes", "0", "x.py"],
        ["run", "--bogus", "x.py"],
        ["run", "--nproc-per-node", "many", "x.py"],
        ["run", "--rdzv-backend", "etcd", "--nnodes", "2", "x.py"],
        ["run", "--nnodes", "2", "--node-rank", "5", "x.py"],
        ["run"],
        ["frobnicate"],
        ["status", "--rdzv-backend", "http"],
        ["serve", "--port", "-5"],
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, argv: list[str]) -> None:
    code, out = run_cli(argv, tmp_path)
    assert code == 2
    assert len(out.strip().splitlines()) == 1, out
    assert "error:" in out


def test_bad_pet_variable(tmp_path: Path) -> None:
    code, out = run_cli(["run", "x.py"], tmp_path, env={"PET_NNODES": "two"})
    assert code == 2 and "--nnodes 'two'" in out


def test_bad_rendezvous_settings_exit_2(tmp_path: Path) -> None:
    code, out = run_cli(["run", "--rdzv-conf", "join_timeout=soon", "x.py"], tmp_path)
    assert code == 2, out
    assert "join_timeout" in out


def test_launcher_never_imports_torch(tmp_path: Path) -> None:
    script = _script(tmp_path, "noop.py", "pass\n")
    probe = (
        "import sys\n"
        "from aelastic.cli import main\n"
        f"code = main(['run', '-q', '--standalone', '--nproc-per-node', '1', {script!r}])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('TORCH', loaded, flush=True)\n"
        "sys.exit(code)\n"
    )
    code, out = _python(probe, tmp_path)
    assert code == 0, out
    assert "TORCH []" in out


def _python(code: str, cwd: Path) -> tuple[int, str]:
    import subprocess

    from ._proc import cli_env

    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_help_and_version(tmp_path: Path) -> None:
    code, out = run_cli(["--version"], tmp_path)
    assert code == 0 and out.startswith("aelastic ")
    code, out = run_cli(["run", "--help"], tmp_path)
    assert code == 0 and "--nproc-per-node" in out and "--rdzv-backend" in out
