"""examples/elastic_demo.py: two nodes on one machine, one is killed, the survivor finishes."""

from __future__ import annotations

import pytest

from ._run import run

pytest.importorskip("torch")
pytest.importorskip("aiohttp")


@pytest.mark.slow
def test_survivor_carries_on() -> None:
    code, out = run(["examples/elastic_demo.py", "--steps=15", "--step-time=0.1"])
    assert code == 0, out
    together = out.index("world size 2")
    crash = out.index("node B loses power")
    alone = out.index("world size 1")
    assert together < crash < alone, out
    assert "[node A] [ddp_train] world size 1 (gloo)" in out
    assert "resuming at step" in out[alone:]
    assert "[node A] [ddp_train] done: 15 steps" in out
    assert "node A exited with code 0" in out
