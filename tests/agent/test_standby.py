"""Warm standbys: which commands qualify, when one may serve, and that it runs like Python."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from aelastic.agent import WorkerSpec
from aelastic.agent.standby import Standby, launch_of, standby_env

from .helpers import make_handler, reaped

pytestmark = pytest.mark.anyio


def spec(entry: str, *args: str, **kwargs: object) -> WorkerSpec:
    return WorkerSpec("t", 1, make_handler("standby"), entry, args, **kwargs)  # type: ignore[arg-type]


def test_launches() -> None:
    py = sys.executable
    script = launch_of(spec(py, "-u", "train.py", "--lr", "${local_rank}"))
    assert script is not None
    assert (script.flags, script.script, script.module, script.consumed) == (
        ("-u",),
        "train.py",
        None,
        2,
    )
    module = launch_of(spec(py, "-u", "-m", "pkg.train", "x"))
    assert module is not None and module.module == "pkg.train" and module.consumed == 3
    for unfit in (
        spec(py, "-c", "print(1)"),
        spec(py, "-X", "dev", "train.py"),
        spec(py, "train_${local_rank}.py"),
        spec(py, "-m"),
        spec(py),
        spec("/bin/echo", "train.py"),
        spec(py, "train.py", warm_standby=False),
    ):
        assert launch_of(unfit) is None


def test_standby_env_drops_the_per_attempt_keys() -> None:
    env = standby_env(spec(sys.executable, "x.py", env={"A": "1"}), {"RANK": "3", "PATH": "/b"})
    assert env == {"PATH": "/b", "A": "1"}


async def test_release_runs_the_script_as_python_would(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    out = tmp_path / "out.txt"
    script.write_text(
        "import os, sys\n"
        "print(__name__, __file__, sys.argv, sys.path[0], os.environ['RANK'],"
        " 'GONE' in os.environ)\n"
    )
    launch = launch_of(spec(sys.executable, str(script)))
    assert launch is not None
    base = {**os.environ, "GONE": "1"}
    standby = Standby(launch, base, 0)
    assert standby.usable_for({**base, "RANK": "0"})
    assert not standby.usable_for({**base, "OTHER": "x"})
    assert not standby.usable_for({k: v for k, v in base.items() if k != "GONE"} | {"X": "1"})
    env = {k: v for k, v in base.items() if k != "GONE"} | {"RANK": "7"}
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    try:
        proc = standby.release(env, ["a", "b"], [fd, None])
    finally:
        os.close(fd)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    expected = f"__main__ {script} ['{script}', 'a', 'b'] {tmp_path} 7 False\n"
    assert out.read_text() == expected
    assert reaped(proc.pid)
    proc.close()


async def test_idle_standby_exits_when_closed(tmp_path: Path) -> None:
    launch = launch_of(spec(sys.executable, "x.py"))
    assert launch is not None
    standby = Standby(launch, dict(os.environ), 0)
    standby.close()
    assert await asyncio.wait_for(standby.process.wait(), 30) == 0
    assert not standby.usable_for(dict(os.environ))
    standby.process.close()
