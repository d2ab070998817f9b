"""Shared fixtures: async tests run on asyncio (anyio's pytest plugin)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from aelastic.backends import memory

_run_ids = itertools.count()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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
