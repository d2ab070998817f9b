"""A real 2-process gloo all-reduce launched by the agent (CPU)."""

from __future__ import annotations

import pytest

from aelastic.agent import ElasticAgent, WorkerSpec, WorkerState

from ._gloo import all_reduce
from .helpers import make_handler

pytestmark = pytest.mark.anyio


async def test_gloo_all_reduce(run_id: str) -> None:
    pytest.importorskip("torch.distributed")
    spec = WorkerSpec("trainer", 2, make_handler(run_id), all_reduce, stop_grace_period=5)
    result = await ElasticAgent(spec).run()
    assert result.state is WorkerState.SUCCEEDED, result.failures
    assert result.return_values == {
        0: {"sum": 3.0, "rank": 0, "world": 2, "local_rank": 0},
        1: {"sum": 3.0, "rank": 1, "world": 2, "local_rank": 1},
    }
