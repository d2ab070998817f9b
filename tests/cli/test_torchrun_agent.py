"""What torchrun's agent does for its workers, through ``aelastic run``: the received signal
forwarded, torch's file-timer watchdog, the health-check variable, ``--numa-binding`` and
``--duplicate-std*-filters``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ._proc import Cli, cli_env

pytestmark = pytest.mark.timeout(120)

RECORD = """
import os, signal, time
path = os.path.join(os.environ["OUT"], os.environ["LOCAL_RANK"])
def record(sig, frame):
    with open(path, "w") as f:
        f.write(signal.Signals(sig).name)
    os._exit(0)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, record)
os.write(1, f"worker pid={os.getpid()}\\n".encode())
time.sleep(120)
"""

# Under a 1 s watchdog timer it sleeps past the expiry in its first attempt; the second
# attempt succeeds. It prints the timer file it was given.
TIMED = """
import os, time
import torch.distributed.elastic.timer as timer
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} timer file {os.environ['TORCHELASTIC_TIMER_FILE']}", flush=True)
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with timer.expires(after=1, scope="step"):
    if attempt == 0:
        time.sleep(60)
print(f"attempt {attempt} done", flush=True)
"""


def _script(tmp_path: Path, text: str, name: str = "w.py") -> str:
    (tmp_path / name).write_text(textwrap.dedent(text))
    return name


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT], ids=lambda s: s.name
)
def test_workers_get_the_signal_the_launcher_got(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["run", "--nproc-per-node", "2", _script(tmp_path, RECORD)]
    with Cli(args, tmp_path, env={"OUT": str(out)}) as cli:
        cli.wait_for(lambda lines: sum("worker pid=" in line for line in lines) == 2)
        cli.signal(sig)
        code = cli.wait(60)
    assert code == 1, cli.output
    assert f"received {sig.name}: stopping the workers ({sig.name}, then SIGKILL" in cli.output
    assert sorted(p.read_text() for p in out.iterdir()) == [sig.name, sig.name], cli.output


def test_the_file_timer_watchdog_kills_an_expired_worker_and_the_group_restarts(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch.distributed.elastic.timer")
    args = ["run", "--nproc-per-node", "1", "--max-restarts", "1", _script(tmp_path, TIMED)]
    with Cli(args, tmp_path, env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"}) as cli:
        code = cli.wait(90)
    assert code == 0, cli.output
    assert "timer 'step' of worker pid" in cli.output and "sending SIGKILL" in cli.output
    assert "failed (signal SIGKILL)" in cli.output
    assert "attempt 0 done" not in cli.output and "attempt 1 done" in cli.output
    files = re.findall(r"timer file (\S+)", cli.output)
    assert len(files) == 2 and not any(os.path.exists(f) for f in files), cli.output


def test_a_bad_health_check_port_is_a_usage_error(tmp_path: Path) -> None:
    env = {"TORCHELASTIC_HEALTH_CHECK_PORT": "http"}
    with Cli(["run", _script(tmp_path, "pass\n")], tmp_path, env=env) as cli:
        assert cli.wait(60) == 2
    assert "TORCHELASTIC_HEALTH_CHECK_PORT='http' is not a port number" in cli.output


def _run_on_cpu0(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``aelastic run ARGS`` allowed to run on CPU 0 only (whatever this machine has)."""
    return subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "-q", *args],
        cwd=tmp_path,
        env=cli_env(),
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_numa_binding_reaches_the_workers(tmp_path: Path) -> None:
    # One write per worker: the two share the pipe (print's pieces could interleave).
    line = "os.write(1, f'cpus {sorted(os.sched_getaffinity(0))}\\n'.encode())"
    script = _script(tmp_path, f"import os; {line}\n")
    done = _run_on_cpu0(tmp_path, "--nproc-per-node", "2", "--numa-binding", "node", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["cpus [0]", "cpus [0]"]


def test_numa_binding_that_cannot_apply_is_one_line_and_exit_1(tmp_path: Path) -> None:
    script = _script(tmp_path, "pass\n")
    done = _run_on_cpu0(tmp_path, "--nproc-per-node", "2", "--numa-binding", "exclusive", script)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "1 physical core(s) for 2 workers" in errors[0], done.stderr


def test_duplicate_filters_copy_matching_teed_lines(tmp_path: Path) -> None:
    script = _script(tmp_path, "print('loss=1'); print('noise'); print('acc=2, ok')\n")
    args = ["run", "--tee", "3", "--log-dir", str(tmp_path / "logs")]
    args += ["--duplicate-stdout-filters", "loss,acc=2,, ok", script]
    with Cli(args, tmp_path) as cli:
        assert cli.wait(60) == 0, cli.output
    assert "[default0]:noise" in cli.output  # teed to the console as ever
    [filtered] = (tmp_path / "logs").glob("*/attempt_0/filtered_stdout.log")
    assert filtered.read_text().splitlines() == ["[default0]:loss=1", "[default0]:acc=2, ok"]
