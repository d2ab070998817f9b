"""Shared fixtures: async tests run on asyncio (anyio's pytest plugin)."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from aelastic.backends import memory

_run_ids = itertools.count()


# tests/run.sh (what CI runs) installs every real part the tests use (redis-server,
# redis-sentinel, numactl, chromium, playwright, torch): there, a test skipped because a part
# is missing is a failure, never a silent pass. (A skip for a limit of the machine, such as a
# low hard open-file limit, stays a skip.)
_NO_SKIPS = os.environ.get("AELASTIC_TESTS_NO_SKIP") == "1"
_MISSING_PART = ("not on PATH", "not installed", "could not import", "No module named")
_skipped: list[str] = []


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (_NO_SKIPS and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if any(marker in reason for marker in _MISSING_PART):
        _skipped.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _skipped:
        terminalreporter.section("skipped for a missing part (AELASTIC_TESTS_NO_SKIP=1)")
        for nodeid in _skipped:
            terminalreporter.line(nodeid)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def _session_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the tests and every process they start depend on is set here, not inherited:

    * temporary files go under pytest's own base temp (pruned by pytest), not /tmp: agents
      and servers killed with SIGKILL on purpose cannot clean up after themselves;
    * the umask is 022 (files made without a mode are readable as the tests expect);
    * the locale of the processes started is C.UTF-8 (their output is read as UTF-8).

    (The stop signals' dispositions are set per child: ``tests/cli/_proc.py``.)
    """
    saved = {name: os.environ.get(name) for name in ("TMPDIR", "LC_ALL", "LANG", "LANGUAGE")}
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    os.environ["LC_ALL"] = "C.UTF-8"
    for name in ("LANG", "LANGUAGE"):
        os.environ.pop(name, None)
    tempfile.tempdir = None  # forget the cached default
    umask = os.umask(0o022)
    yield
    os.umask(umask)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None


@pytest.fixture(autouse=True)
def _fresh_memory_backend() -> Iterator[None]:
    """Every test starts with no in-memory runs."""
    memory.reset()
    yield
    memory.reset()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id unique to the test (so tests sharing a server never collide)."""
    return f"{request.node.name[:40]}-{next(_run_ids)}"
