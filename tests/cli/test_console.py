"""The launcher's console: one readable line per agent event, and the failure summary."""

from __future__ import annotations

import io
import logging
import re
from typing import Any

import pytest

from aelastic.agent import events as agent_events
from aelastic.agent.api import ProcessFailure, RunResult, WorkerState
from aelastic.agent.events import AgentEvent, EventKind
from aelastic.cli.console import Console, describe_exit, summarize_failure

_CLASSES = {
    cls.kind: cls
    for cls in vars(agent_events).values()
    if isinstance(cls, type) and issubclass(cls, AgentEvent) and cls is not AgentEvent
}


def _event(kind: EventKind, **data: Any) -> AgentEvent:
    if "lost" in data:
        data["lost"] = tuple(data["lost"])
    return _CLASSES[kind](run_id="job", role="default", state=WorkerState.HEALTHY, **data)


@pytest.mark.parametrize(
    ("kind", "data", "expected"),
    [
        (
            EventKind.RENDEZVOUS,
            {
                "round": 3,
                "group_rank": 1,
                "group_world_size": 2,
                "world_size": 16,
                "duration": 0.0123,
            },
            "rendezvous round 3 complete in 12 ms: 2 nodes, this one is node 1; 16 workers in all",
        ),
        (
            EventKind.WORKERS_STARTED,
            {"pids": {1: 11, 0: 10}, "duration": 0.004, "recovery": 1.5},
            "started 2 workers (pid 10, 11) in 4 ms; back to work 1.50 s after the interruption",
        ),
        (
            EventKind.WORKER_EXITED,
            {"local_rank": 0, "global_rank": 4, "pid": 99, "exitcode": -9},
            "worker rank 4 (local 0, pid 99) failed (signal SIGKILL)",
        ),
        (
            EventKind.WORKER_EXITED,
            {"local_rank": 0, "global_rank": 4, "pid": 99, "exitcode": 0},
            "worker rank 4 (local 0, pid 99) finished",
        ),
        (
            EventKind.RESTART,
            {"reason": "a worker failed (3 restarts left)", "spent": True, "restarts_left": 1},
            "restarting the workers (a worker failed); 1 restart left",
        ),
        (
            EventKind.RESTART,
            {"reason": "1 node(s) waiting", "spent": False, "restarts_left": 3},
            "rescaling: re-forming the group (1 node(s) waiting); no restart spent",
        ),
        (
            EventKind.MEMBERSHIP_CHANGED,
            {"lost": ["h_1_0"], "waiting": 2, "removed": False, "closed": False},
            "the group changed: 1 node(s) lost (h_1_0), 2 node(s) waiting to join",
        ),
        (EventKind.MEMBERSHIP_CHANGED, {"waiting": 1, "ignored": True}, None),
        (
            EventKind.EXIT_BARRIER,
            {"duration": 2.5, "complete": False},
            "gave up waiting for the other nodes after 2.50 s",
        ),
        (EventKind.STATE_CHANGED, {"previous": "INIT"}, None),
        (EventKind.FINISHED, {"reason": "done"}, None),
    ],
)
def test_describe(kind: EventKind, data: dict[str, Any], expected: str | None) -> None:
    assert Console.describe(_event(kind, **data)) == expected


def test_lines_have_a_prefix_with_seconds() -> None:
    out = io.StringIO()
    console = Console(out)
    console(_event(EventKind.EXIT_BARRIER, duration=0.001, complete=True))
    assert re.fullmatch(r"\[aelastic \+\d+\.\d\ds\] every node finished .*\n", out.getvalue())


def test_quiet_console_still_reports_failures() -> None:
    out = io.StringIO()
    console = Console(out, enabled=False)
    console(_event(EventKind.WORKERS_STARTED, pids={0: 1}))
    assert out.getvalue() == ""
    failure = ProcessFailure(1, 5, 1234, -15, "Signal 15 (SIGTERM) received by PID 1234", 1.0)
    other = ProcessFailure(0, 4, 1233, 1, "boom", 2.0)
    console.result(RunResult(WorkerState.FAILED, failures={5: failure, 4: other}), "train.py")
    text = out.getvalue()
    assert "\ntrain.py FAILED\n" in text and text.count("FAILED") == 1
    failures, root = text.split("Root Cause (first observed failure):")
    assert "rank      : 4 (local_rank: 0)\n  exitcode  : 1 (pid: 1233)" in failures
    assert "rank      : 5 (local_rank: 1)\n  exitcode  : -15 (pid: 1234) (SIGTERM)" in root


def test_summaries() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-11) == "signal SIGSEGV"
    assert describe_exit(-200) == "signal 200"
    failure = ProcessFailure(0, 0, 1, 2, "Traceback...\nValueError: x", 0.0)
    assert summarize_failure(failure).endswith("failed with exit code 2: ValueError: x")


def test_log_records_become_lines() -> None:
    out = io.StringIO()
    console = Console(out)
    handler = console.capture_logs()
    try:
        logging.getLogger("aelastic.rendezvous").warning("heartbeat failed: %s", "timeout")
        logging.getLogger("aelastic.agent").warning("hidden by default")
        logging.getLogger("aelastic.agent").error("shown")
    finally:
        root = logging.getLogger("aelastic")
        root.removeHandler(handler)
        root.propagate = True
        root.setLevel(logging.NOTSET)
        logging.getLogger("aelastic.agent").setLevel(logging.NOTSET)
    text = out.getvalue()
    assert "warning: heartbeat failed: timeout" in text
    assert "hidden" not in text
    assert "error: shown" in text


def _root(rank: int) -> dict[str, Any]:
    record = {"time": 1.0, "host": "h", "node": "h_1_0", "node_rank": 0, "rank": rank}
    record.update(local_rank=0, exitcode=1, message="ValueError: x", round=0)
    return {"root": record, "failed_nodes": 1, "incidents": 1}


def test_the_jobs_root_cause_is_said_once_before_the_next_step_or_last() -> None:
    out = io.StringIO()
    console = Console(out)
    console(_event(EventKind.JOB_FAILURE, **_root(3)))
    console(_event(EventKind.JOB_FAILURE, **_root(3)))  # read again: held once
    assert out.getvalue() == ""
    console.line("warning: a log record", news=False)  # not a step of the run: still held
    console(_event(EventKind.RESTART, reason="a worker failed", spent=True, restarts_left=1))
    lines = out.getvalue().splitlines()
    assert ["root cause of the job's failure 1: rank 3" in x for x in lines] == [False, True, False]
    assert "restarting the workers" in lines[2]
    # A failed end: this node's report, then the root cause (a new one), once, last.
    out.seek(0)
    out.truncate()
    console(_event(EventKind.JOB_FAILURE, **_root(4)))
    failure = ProcessFailure(0, 4, 1234, 1, "boom", 1.0)
    console.result(RunResult(WorkerState.FAILED, failures={4: failure}), "train.py")
    console.job_failure()  # the launcher's last word: said already
    text = out.getvalue()
    assert text.count("root cause of the job's failure") == 1
    assert text.index("train.py FAILED") < text.index("root cause of the job's failure 1: rank 4")
    assert text.rstrip().splitlines()[-1].endswith("(1 node failed)")
