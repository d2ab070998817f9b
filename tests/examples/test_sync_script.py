"""examples/sync_script.py: the blocking facade from a plain script."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from ._run import ROOT, run


def test_three_nodes_in_one_process() -> None:
    code, out = run(["examples/sync_script.py"], timeout=60)
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith("node-")]
    assert len(lines) == 3
    assert sorted(int(re.search(r"rank (\d) of 3", line)[1]) for line in lines) == [0, 1, 2]  # type: ignore[index]
    assert all(line.count("hello from node-") == 3 for line in lines)
    assert sorted(int(re.search(r"#(\d) to arrive", line)[1]) for line in lines) == [1, 2, 3]  # type: ignore[index]


def test_two_processes_on_redis() -> None:
    pytest.importorskip("redis")
    from tests._redis_server import RedisServer

    run_id = f"sync-{uuid.uuid4().hex[:8]}"
    args = [
        sys.executable,
        "examples/sync_script.py",
        "--rdzv-backend",
        "redis",
        "--rdzv-id",
        run_id,
        "--nnodes",
        "2",
    ]
    with RedisServer() as server:
        procs = [
            subprocess.Popen(
                [*args, "--rdzv-endpoint", server.url],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(re.search(r"rank (\d) of 2", o)[1] for o in outs) == ["0", "1"]  # type: ignore[index]
