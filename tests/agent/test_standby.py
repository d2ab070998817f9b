"""Warm standbys: which commands qualify, when one may serve, and that it runs like Python."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aelastic.agent import WorkerSpec
from aelastic.agent.health.progress import BOOTSTRAP_DIR
from aelastic.agent.processes import standby as standby_module
from aelastic.agent.processes.standby import Standby, launch_of, standby_env

from .helpers import make_handler, reaped

pytestmark = pytest.mark.anyio

#: The warm standby's program.
STANDBY = str(Path(standby_module.__file__).with_name("_standby.py"))


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
    assert env == {"PATH": "/b", "A": "1", "PYTHONPATH": BOOTSTRAP_DIR}


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


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fp:
        return [arg.decode() for arg in fp.read().split(b"\0")[:-1]]


async def test_standby_shows_in_ps_as_a_short_command() -> None:
    launch = launch_of(spec(sys.executable, "-u", "x.py"))
    assert launch is not None
    standby = Standby(launch, dict(os.environ), 0)
    try:
        argv = _cmdline(standby.process.pid)
    finally:
        standby.close()
        await asyncio.wait_for(standby.process.wait(), 30)
        standby.process.close()
    assert argv[:-1] == [sys.executable, "-u", STANDBY]  # names the standby's module
    assert argv[-1].isdigit()  # the control socket


# What a worker can see of how it was started; a warm one must see what a cold one does.
PROBE = """\
import json, os, sys
json.dump({
    "name": __name__, "file": __file__, "package": __package__,
    "spec": None if __spec__ is None else __spec__.name,
    "argv": sys.argv, "path": sys.path, "rank": os.environ.get("RANK"),
    "aelastic": sorted(m for m in sys.modules if m.split(".")[0] == "aelastic"),
}, open(os.environ["PROBE_OUT"], "w"))
"""


@pytest.mark.parametrize("how", ["script", "module"])
async def test_warm_start_is_indistinguishable_from_a_cold_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)  # a standby starts in the agent's working directory
    target = ["probe.py"] if how == "script" else ["-m", "probe"]
    cold_out, warm_out = tmp_path / "cold.json", tmp_path / "warm.json"
    env = {**os.environ, "RANK": "3"}
    cold = subprocess.run(  # noqa: ASYNC221 - a short run, the reference
        [sys.executable, "-u", *target, "a"], env={**env, "PROBE_OUT": str(cold_out)}, timeout=60
    )
    assert cold.returncode == 0
    launch = launch_of(spec(sys.executable, "-u", *target, "a"))
    assert launch is not None
    base = {k: v for k, v in env.items() if k != "RANK"}
    standby = Standby(launch, {**base, "PROBE_OUT": str(warm_out)}, 0)
    proc = standby.release({**env, "PROBE_OUT": str(warm_out)}, ["a"], [None, None])
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    proc.close()
    assert json.loads(warm_out.read_text()) == json.loads(cold_out.read_text())
