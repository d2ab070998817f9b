"""What an operator sees of ``aelastic run``: the JSON event log, ``/metrics``, progress lines.

Real launcher processes, a real ``aelastic serve`` and real worker processes; metrics are
scraped over HTTP and parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest

from tests._http_server import HttpServer, free_port

from ._proc import Cli, run_cli

prometheus_parser = pytest.importorskip("prometheus_client.parser")

COMMON = ("time", "kind", "run_id", "node", "round")

# Fails on its first attempt; on the next one, waits until the file named as argument exists.
WORKER = """
import os, pathlib, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
sys.stdout.write("second attempt running\\n")  # one write: two workers share the pipe
sys.stdout.flush()
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.05)
"""


def _records(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_event_log_writes_one_json_line_per_event(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    log = tmp_path / "events.jsonl"
    code, out = run_cli(["run", "--standalone", f"--event-log={log}", "ok.py"], tmp_path)
    assert code == 0, out
    records = _records(log.read_text())
    kinds = [r["kind"] for r in records]
    assert {"transition", "rendezvous", "workers_started", "worker_exited"} <= set(kinds)
    assert kinds[-1] == "finished"
    for record in records:
        assert all(key in record for key in COMMON), record
        assert record["run_id"] == records[0]["run_id"] and record["node"]
    rendezvous = next(r for r in records if r["kind"] == "rendezvous")
    assert rendezvous["round"] == 0 and rendezvous["world_size"] == 1
    assert rendezvous["group_rank"] == 0 and rendezvous["duration"] >= 0
    exited = next(r for r in records if r["kind"] == "worker_exited")
    assert exited["exitcode"] == 0 and exited["state"] == "HEALTHY"


@pytest.mark.parametrize("flag", ["--event-log=-", "--event-log-handler=console"])
def test_event_log_to_stderr(tmp_path: Path, flag: str) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    code, out = run_cli(["run", "--standalone", flag, "ok.py"], tmp_path)
    assert code == 0, out
    records = _records(out)
    assert [r["kind"] for r in records][-1] == "finished"
    assert all(all(key in r for key in COMMON) for r in records)


def test_event_log_handler_null_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    code, out = run_cli(["run", "--standalone", "--event-log-handler=null", "ok.py"], tmp_path)
    assert code == 0, out
    assert not _records(out)


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--event-log-handler=syslog", "--event-log-handler must be console or null"),
        ("--metrics-port=70000", "--metrics-port must be 0 (off) to 65535"),
        ("--event-log=/nonexistent-dir/events.jsonl", "cannot write the event log"),
    ],
)
def test_bad_observability_flags_fail_in_one_line(tmp_path: Path, flag: str, says: str) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    code, out = run_cli(["run", "--standalone", flag, "ok.py"], tmp_path)
    assert code == 2, out
    errors = [line for line in out.splitlines() if "error" in line]
    assert len(errors) == 1 and says in errors[0], out


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def test_metrics_are_served_while_the_job_runs(tmp_path: Path) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    release = tmp_path / "release"
    port = free_port()
    args = ["run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    args += ["--no-warm-standby", "worker.py", str(release)]
    with Cli(args, tmp_path, {"PET_METRICS_PORT": str(port)}) as cli:
        cli.wait_for(lambda lines: sum("second attempt running" in x for x in lines) == 2)
        metrics = _scrape(port)
        release.touch()
        assert cli.wait() == 0, cli.output
    assert metrics["aelastic_rendezvous_duration_seconds_count"][()] == 2
    assert metrics["aelastic_rendezvous_round"][()] == 1
    assert metrics["aelastic_restarts_total"][(("reason", "worker_failed"),)] == 1
    assert metrics["aelastic_restarts_total"][(("reason", "member_lost"),)] == 0
    assert metrics["aelastic_worker_exits_total"][(("outcome", "failed"),)] >= 1
    assert metrics["aelastic_worker_group_state"][(("state", "HEALTHY"),)] == 1
    assert metrics["aelastic_worker_group_state"][(("state", "FAILED"),)] == 0
    assert metrics["aelastic_world_size"][()] == 2
    assert metrics["aelastic_local_workers"][()] == 2
    assert metrics["aelastic_worker_start_seconds_count"][()] == 2
    assert metrics["aelastic_recovery_seconds_count"][()] == 1
    assert metrics["aelastic_backend_retries_total"][(("backend", "memory"),)] == 0
    info = next(iter(metrics["aelastic_agent_info"]))
    assert ("backend", "memory") in info and ("role", "default") in info


def test_a_metrics_port_in_use_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = run_cli(["run", "--standalone", f"--metrics-port={port}", "ok.py"], tmp_path)
    assert code == 2, out
    errors = [line for line in out.splitlines() if "error" in line]
    assert len(errors) == 1 and f"metrics port {port} is in use" in errors[0], out
    assert "hello" not in out  # no worker was started


def test_progress_while_waiting_for_nodes(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    with HttpServer() as server:
        args = ["run", "--nnodes=2:4", "--rdzv-backend=http", f"--rdzv-endpoint={server.endpoint}"]
        args += ["--rdzv-id=progress", "--local-addr=127.0.0.1", "ok.py"]
        with Cli(args, tmp_path) as cli:
            cli.wait_for(lambda lines: sum("waiting for nodes:" in x for x in lines) == 2)
            first, second = [x for x in cli.lines if "waiting for nodes:" in x]
            assert cli.proc.poll() is None
    said = r"waiting for nodes: 1 joined of min 2 \(max 4\); join timeout in (9m\d\ds|10m00s)$"
    assert re.search(said, first) and re.search(said, second), (first, second)
    apart = _seconds(second) - _seconds(first)
    assert 9.0 <= apart < 30.0, (first, second)  # one line every ~10 s, not one per request


def _seconds(line: str) -> float:
    match = re.match(r"\[aelastic \+(\d+\.\d+)s\]", line)
    assert match, line
    return float(match.group(1))


def test_progress_while_the_store_is_unreachable(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('hello')\n")
    pytest.importorskip("redis")
    port = free_port()  # nothing listens there
    endpoint = f"redis://:topsecret@127.0.0.1:{port}/0"
    args = ["run", "--nnodes=1", "--rdzv-backend=redis", f"--rdzv-endpoint={endpoint}"]
    args += ["--rdzv-id=gone", "--rdzv-conf=read_timeout=60", "ok.py"]
    with Cli(args, tmp_path) as cli:
        want = f"redis at 127.0.0.1:{port} unreachable (connection refused); retrying for"
        cli.wait_for(lambda lines: any(want in x for x in lines))
        line = next(x for x in cli.lines if want in x)
        assert line.endswith(" s more"), line
        assert "topsecret" not in cli.output


def test_an_endpoint_taken_by_default_is_named_in_the_first_line_and_the_error(
    tmp_path: Path,
) -> None:
    # A static job's node rank 1 given --master-port but no --master-addr: the rendezvous
    # is at 127.0.0.1 (torchrun's default), where nothing listens.
    (tmp_path / "ok.py").write_text("print('hello')\n")
    port = free_port()
    args = ["run", "--nnodes=2", "--node-rank=1", f"--master-port={port}"]
    args += ["--rdzv-conf=join_timeout=3", "ok.py"]
    code, out = run_cli(args, tmp_path)
    assert code == 1, out
    note = (
        f"the endpoint 127.0.0.1:{port} is taken by default: no --rdzv-endpoint or "
        "--master-addr was given"
    )
    waits = [line for line in out.splitlines() if f"static at 127.0.0.1:{port} unreachable" in line]
    assert waits and waits[0].endswith(f" s more; {note}"), out
    assert all(note not in line for line in waits[1:]), out  # said once
    errors = [line for line in out.splitlines() if "error: rendezvous failed" in line]
    assert len(errors) == 1 and errors[0].endswith(f"({note})"), out
    assert "hello" not in out
