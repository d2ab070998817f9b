"""Shared fixtures: async tests run on asyncio (anyio's pytest plugin)."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator

import pytest

from aelastic.backends import memory

_run_ids = itertools.count()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def _session_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temporary files of the tests and of every process they start go under pytest's own
    base temp (pruned by pytest), not /tmp: agents and servers killed with SIGKILL on
    purpose cannot clean up after themselves."""
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # forget the cached default
    yield
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
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
