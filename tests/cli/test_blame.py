"""A frozen rank is blamed, never the peer that waits for it: two ``aelastic run`` nodes of one
gloo job (torch, CPU) over Redis; node B's worker is stopped with SIGSTOP (no stacks can be
taken from it) while node A's waits for it in ``all_reduce``. With a stall timeout shorter
than the 5 s a dump may be given, and with a longer one: B's worker is named the job's root
cause (on B's console, on A's when A shows one, in ``aelastic status``) and B's host is
quarantined (``--quarantine-after 1``: exit 3), while A goes on alone and finishes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ._proc import Cli, run_cli

pytestmark = pytest.mark.timeout(300)

GLOO_WORKER = str(Path(__file__).resolve().parents[1] / "agent" / "_gloo_heal.py")


def _wait_for_file(path: Path, cli: Cli, timeout: float = 150) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert cli.proc.poll() is None, cli.output
        assert time.monotonic() < deadline, f"no {path.name}:\n{cli.output}"
        time.sleep(0.1)
    return int(path.read_text())


@pytest.mark.parametrize("stall_timeout", [3, 8])
def test_a_stopped_rank_is_named_never_its_peer_blocked_in_all_reduce(
    tmp_path: Path, run_id: str, stall_timeout: int
) -> None:
    pytest.importorskip("torch.distributed")
    pytest.importorskip("redis")
    from tests._redis_server import RedisServer

    with RedisServer() as server:
        where = ["--rdzv-backend=redis", f"--rdzv-endpoint={server.url}", f"--rdzv-id={run_id}"]

        def node(name: str, addr: str) -> Cli:
            args = ["run", "--nnodes=1:2", *where, f"--local-addr={addr}"]
            args += ["--rdzv-conf=last_call_timeout=3", f"--stall-timeout={stall_timeout}"]
            args += ["--quarantine-after=1", "--max-restarts=1", GLOO_WORKER, "train"]
            return Cli(args, tmp_path, env={"HEAL_DIR": str(tmp_path), "HEAL_NODE": name})

        with node("a", "127.0.0.1") as a, node("b", "127.0.0.2") as b:
            _wait_for_file(tmp_path / "a.pid", a)
            frozen = _wait_for_file(tmp_path / "b.pid", b)
            os.kill(frozen, signal.SIGSTOP)
            stopped_at = time.monotonic()
            assert b.wait(120) == 3, b.output  # quarantined: the root cause, once
            took = time.monotonic() - stopped_at
            (tmp_path / "finish").touch()
            assert a.wait(120) == 0, a.output
        code, status = run_cli(["status", *where], tmp_path)
    assert took < stall_timeout + 30, (took, b.output)  # a loaded machine
    named = "on host 127.0.0.2 (node rank"
    [stall] = [x for x in b.lines if "is hung:" in x]
    assert "the process is stopped" in stall, b.output
    roots = [x for x in b.lines if "root cause of the job's failure" in x]
    assert roots and all(named in x and "the process is stopped" in x for x in roots), b.output
    assert "host 127.0.0.2 is quarantined (the job's root cause 1 times in a row)" in b.output
    # A never claims the root cause: what it shows, if anything, names B.
    assert all(named in x for x in a.lines if "root cause of the job's failure" in x), a.output
    assert "is quarantined" not in a.output, a.output
    assert code == 0 and named in status and "127.0.0.1 (node rank" not in status, status
    assert "quarantined (1):\n  127.0.0.2:" in status, status
