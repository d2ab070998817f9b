"""examples/inplace_recovery.py: three nodes, one a hot spare; a member is killed, the spare
takes its place and the survivor's worker goes on in the same process."""

from __future__ import annotations

import re

import pytest

from ._run import run

pytest.importorskip("torch")
pytest.importorskip("aiohttp")


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_the_spare_takes_over_and_the_survivor_goes_on_in_place() -> None:
    code, out = run(["examples/inplace_recovery.py", "--steps=12", "--kill-at=5"], timeout=140)
    assert code == 0, out
    kill = out.index("loses power")
    assert re.search(r"rank \d: in a new group of 2 \(round 1\), state from rank \d", out[kill:])
    same = re.search(r"pid (\d+) before the kill, (\d+) after \(the same process\)", out)
    assert same is not None and same.group(1) == same.group(2), out
    assert "step 12/12" in out and "no restarts allowed" in out
    assert "log scale (| marks the kill)" in out
