"""``aelastic run`` healing itself, seen from its console: nohup, the flags, a worker's
ValueError on node 1 of 2 (gloo) shown by node 0 and by ``aelastic status``."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest

from aelastic.cli.options import UsageError, parse_config

from ._proc import Cli, run_cli, signals_as

# Waits for the file "go" (the test makes it after the SIGHUP), then finishes.
PATIENT = """
import os, time
while not os.path.exists("go"):
    time.sleep(0.05)
print("trained", flush=True)
"""


def _has(text: str):  # type: ignore[no-untyped-def]
    return lambda lines: any(text in line for line in lines)


@pytest.mark.parametrize("nohup", [True, False])
def test_sighup_ignored_at_start_stays_ignored(tmp_path: Path, nohup: bool) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(PATIENT))
    # SIGHUP ignored as nohup starts its command, or at its default (whatever ours is).
    preexec = signals_as([signal.SIGHUP] if nohup else [])
    with Cli(["run", "--standalone", "train.py"], tmp_path, preexec=preexec) as cli:
        cli.wait_for(_has("started 1 worker"))
        cli.signal(signal.SIGHUP)
        if nohup:
            (tmp_path / "go").touch()
            assert cli.wait(60) == 0, cli.output
        else:
            assert cli.wait(60) == 1, cli.output
    if nohup:
        assert "trained" in cli.output and "SIGHUP" not in cli.output
    else:
        assert "received SIGHUP: stopping the workers" in cli.output


def test_the_self_healing_flags_and_their_pet_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = parse_config(["x.py"]).heal
    assert (plain.stall_timeout, plain.startup_timeout) == ("auto", 1800.0)  # on, no number
    assert (plain.job_max_restarts, plain.quarantine_after) == (None, None)
    heal = parse_config(
        ["--stall-timeout", "30", "--job-max-restarts=5", "--quarantine-after", "2", "x.py"]
    ).heal
    assert (heal.stall_timeout, heal.job_max_restarts, heal.quarantine_after) == (30.0, 5, 2)
    off = parse_config(["--stall-timeout", "0", "--startup-timeout=0", "x.py"]).heal
    assert (off.stall_timeout, off.startup_timeout) == (None, None)
    assert parse_config(["--stall-timeout=auto", "--startup-timeout=60", "x.py"]).heal == (
        type(plain)(startup_timeout=60.0)
    )
    monkeypatch.setenv("PET_STALL_TIMEOUT", "12.5")
    monkeypatch.setenv("PET_STARTUP_TIMEOUT", "90")
    monkeypatch.setenv("PET_JOB_MAX_RESTARTS", "0")
    monkeypatch.setenv("PET_QUARANTINE_AFTER", "3")
    heal = parse_config(["x.py"]).heal
    assert (heal.stall_timeout, heal.startup_timeout) == (12.5, 90.0)
    assert (heal.job_max_restarts, heal.quarantine_after) == (0, 3)
    for bad, message in (
        (["--stall-timeout", "-1"], "--stall-timeout must be auto or a number of seconds >= 0"),
        (["--stall-timeout", "soon"], "--stall-timeout must be auto or a number .* not 'soon'"),
        (["--stall-timeout", "inf"], "--stall-timeout must be auto or a number"),
        (["--startup-timeout", "-5"], "--startup-timeout must be a number of seconds >= 0"),
        (["--job-max-restarts", "-2"], "--job-max-restarts must be >= 0"),
        (["--quarantine-after", "0"], "--quarantine-after must be >= 1"),
    ):
        with pytest.raises(UsageError, match=message):
            parse_config([*bad, "x.py"])
    monkeypatch.setenv("PET_QUARANTINE_AFTER", "often")
    with pytest.raises(UsageError, match="PET_QUARANTINE_AFTER='often'"):
        parse_config(["x.py"])


def test_the_hang_flags_reach_the_spec_and_the_start_line(tmp_path: Path) -> None:
    from aelastic.cli.launch import build_spec

    spec = build_spec(parse_config(["x.py"]))
    assert (spec.stall_timeout, spec.startup_timeout) == ("auto", 1800.0)
    spec = build_spec(parse_config(["--stall-timeout=4", "--startup-timeout=0", "x.py"]))
    assert (spec.stall_timeout, spec.startup_timeout) == (4.0, None)
    (tmp_path / "ok.py").write_text("print('done')\n")
    code, output = run_cli(["run", "--standalone", "ok.py"], tmp_path)
    assert code == 0, output
    assert (
        "hangs: the bound is learned from the step times (5x the slowest recent step, 10 s "
        "to 1 h); start-up bound 30 min (--startup-timeout)" in output
    )
    code, output = run_cli(["run", "--standalone", "--stall-timeout=0", "ok.py"], tmp_path)
    assert code == 0 and "hangs: not watched" in output, output


def test_the_spare_and_in_place_flags_reach_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    from aelastic.cli.launch import build_spec

    plain = parse_config(["x.py"]).heal
    assert (plain.standby_preload, plain.recovery_timeout) == ((), 60.0)
    config = parse_config(["--standby-preload", "torch, numpy", "--recovery-timeout=5", "x.py"])
    assert (config.heal.standby_preload, config.heal.recovery_timeout) == (("torch", "numpy"), 5)
    spec = build_spec(config)
    assert (spec.standby_preload, spec.recovery_timeout) == (("torch", "numpy"), 5.0)
    monkeypatch.setenv("PET_STANDBY_PRELOAD", "torch.distributed")
    assert parse_config(["x.py"]).heal.standby_preload == ("torch.distributed",)
    for bad, message in (
        (["--standby-preload", "torch;rm"], "--standby-preload names modules, not 'torch;rm'"),
        (["--recovery-timeout", "0"], "--recovery-timeout must be > 0"),
    ):
        with pytest.raises(UsageError, match=message):
            parse_config([*bad, "x.py"])


def test_a_bad_flag_value_is_a_usage_error_at_the_command_line(tmp_path: Path) -> None:
    code, output = run_cli(["run", "--quarantine-after", "0", "x.py"], tmp_path)
    assert code == 2 and "--quarantine-after must be >= 1, not 0" in output


GLOO_WORKER = str(Path(__file__).resolve().parents[1] / "agent" / "_gloo_heal.py")


def test_node_0_and_status_show_the_valueerror_of_node_1(tmp_path: Path, run_id: str) -> None:
    """Two nodes of one gloo job (torch, CPU) over Redis: rank 1 (on node 1) raises
    ValueError without @record; rank 0's next all-reduce breaks because of it. Node 0's
    console, at the failure and at its exit, and ``aelastic status`` name rank 1, node 1's
    host and the message, not node 0's broken collective."""
    pytest.importorskip("torch.distributed")
    pytest.importorskip("redis")
    from tests._redis_server import RedisServer

    with RedisServer() as server:
        where = ["--rdzv-backend=redis", f"--rdzv-endpoint={server.url}", f"--rdzv-id={run_id}"]

        def node(addr: str) -> Cli:
            args = ["run", "--nnodes=2", *where, f"--local-addr={addr}"]
            args += ["--rdzv-conf=last_call_timeout=0.5", GLOO_WORKER, "raise"]
            return Cli(args, tmp_path)

        with node("127.0.0.1") as a, node("127.0.0.2") as b:
            assert a.wait(150) == 1, a.output
            assert b.wait(150) == 1, b.output
        code, status = run_cli(["status", *where], tmp_path)
    node1, host1 = (a, "127.0.0.1") if "this one is node 1" in a.output else (b, "127.0.0.2")
    node0 = b if node1 is a else a
    assert "this one is node 0" in node0.output
    expected = (
        f"rank 1 (local rank 0) on host {host1} (node rank 1) failed with exit code 1: "
        "ValueError: the data shard 7 is corrupt"
    )
    [shown] = [line for line in node0.lines if "root cause of the job's failure" in line]
    assert expected in shown, node0.output
    assert node0.lines[-1] == shown  # said once, at the end, after this node's report
    assert "Connection closed by peer" in node0.output  # its own failure: a broken collective
    assert code == 0 and expected in status, status
    assert "raise ValueError" in status  # the traceback follows


# Works until the file "finish" exists, then prints the world it ended in.
UNTIL_FINISH = """
import os, time
while not os.path.exists("finish"):
    time.sleep(0.05)
print(f"finished in a world of {os.environ['WORLD_SIZE']}", flush=True)
"""


def test_a_host_lost_twice_is_quarantined_when_it_comes_back(tmp_path: Path, run_id: str) -> None:
    pytest.importorskip("redis")
    import os

    from tests._redis_server import RedisServer

    (tmp_path / "train.py").write_text(textwrap.dedent(UNTIL_FINISH))
    with RedisServer() as server:
        where = ["--rdzv-backend=redis", f"--rdzv-endpoint={server.url}", f"--rdzv-id={run_id}"]
        conf = "--rdzv-conf=last_call_timeout=0.5,keep_alive_interval=0.3,keep_alive_max_attempt=3"

        def node(addr: str) -> Cli:
            args = ["run", "--nnodes=1:2", *where, conf, f"--local-addr={addr}"]
            return Cli([*args, "--quarantine-after=2", "--max-restarts=3", "train.py"], tmp_path)

        with node("127.0.0.1") as stays:
            for loss in (1, 2):
                with node("127.0.0.2") as flaky:
                    flaky.wait_for(_has("started 1 worker"))
                    stays.wait_for(
                        lambda lines, n=loss: sum("2 workers in all" in x for x in lines) >= n
                    )
                    os.kill(flaky.proc.pid, signal.SIGKILL)  # the host goes down
                    flaky.wait(30)
                stays.wait_for(lambda lines, n=loss: sum("node(s) lost" in x for x in lines) >= n)
            with node("127.0.0.2") as back:
                assert back.wait(60) == 3, back.output
            (tmp_path / "finish").touch()
            assert stays.wait(60) == 0, stays.output
        code, status = run_cli(["status", *where], tmp_path)
    assert code == 0, status
    assert "host 127.0.0.2 is quarantined (lost 2 times): this node leaves the job" in back.output
    assert "rendezvous round" not in back.output  # it left before joining
    assert "finished in a world of 1" in stays.output
    assert "lost hosts: 127.0.0.2 (2x)" in status
