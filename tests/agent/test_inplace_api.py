"""``aelastic.worker.InPlace`` without an agent, and what it takes for a broken group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aelastic.worker import GroupChanged, InPlace
from aelastic.worker._inplace import recoverable

ROOT = Path(__file__).resolve().parents[2]


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_what_counts_as_a_broken_group() -> None:
    assert recoverable(_raised(GroupChanged("changing")))
    peer = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    assert recoverable(_raised(RuntimeError(peer)))
    assert recoverable(_raised(type("DistNetworkError", (RuntimeError,), {})("broken pipe")))
    assert not recoverable(_raised(RuntimeError("CUDA out of memory")))
    assert not recoverable(_raised(ValueError("Connection closed by peer")))  # not torch's kind
    assert not recoverable(_raised(KeyboardInterrupt()))


def test_outside_an_agent_it_is_a_plain_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AELASTIC_INPLACE_SOCKET", raising=False)
    recovery = InPlace({"step": 0})
    assert not recovery.available
    recovery.check()  # nothing to leave for


def test_an_agent_socket_that_is_gone_leaves_it_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AELASTIC_INPLACE_SOCKET", "/nonexistent/aelastic-inplace/s")
    assert not InPlace().available


def test_under_plain_python_run_makes_the_group_once_and_errors_propagate() -> None:
    pytest.importorskip("torch.distributed")
    script = textwrap.dedent(
        """
        import os, aelastic.worker
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        calls = []
        def train(round):
            calls.append(round)
            raise RuntimeError("Connection closed by peer")
        try:
            aelastic.worker.InPlace({"step": 1}, backend="gloo").run(train)
        except RuntimeError as exc:
            import torch.distributed as dist
            print("raised:", exc, len(calls), calls[0].world_size, calls[0].source)
            print("group left:", not dist.is_initialized(), flush=True)
        """
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sys.path[0]}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert "raised: Connection closed by peer 1 1 None" in out.stdout, out.stderr
    # The broken group is destroyed (nobody recovers it; gloo's threads left alive may abort
    # the interpreter's exit, the script's output lost with it).
    assert "group left: True" in out.stdout and out.returncode == 0, out.stderr


# Two ranks over gloo, where numpy cannot be imported (a stand-in package that refuses, as on
# a machine whose torch came without it): torch's object collectives fail there, the
# hand-over's own do not.
_NO_NUMPY_RANK = """
import os, sys, torch.distributed as dist
from aelastic.worker._collectives import broadcast_object, first_flagged
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
assert first_flagged(dist, rank == 1) == 1 and first_flagged(dist, False) is None
state = {"step": 7, "weights": __import__("torch").arange(4.0)} if rank == 1 else None
got = broadcast_object(dist, state, 1)
print(f"rank {rank}: step {got['step']} weights {got['weights'].tolist()}", flush=True)
try:
    dist.broadcast_object_list([state], src=1)
except RuntimeError as exc:
    print(f"rank {rank}: torch's own: {exc}", flush=True)
dist.destroy_process_group()
"""


def test_the_hand_over_needs_no_numpy(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    from tests._ports import free_port

    (tmp_path / "numpy").mkdir()
    refuse = "raise ModuleNotFoundError('no numpy here', name='numpy')\n"
    (tmp_path / "numpy" / "__init__.py").write_text(refuse)
    (tmp_path / "rank.py").write_text(_NO_NUMPY_RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    ranks = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "rank.py")],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [rank.communicate(timeout=120)[0] for rank in ranks]
    for rank, (proc, out) in enumerate(zip(ranks, outs, strict=True)):
        assert proc.returncode == 0, out
        assert f"rank {rank}: step 7 weights [0.0, 1.0, 2.0, 3.0]" in out, out
    assert "Numpy is not available" in outs[0], outs[0]  # the stand-in does keep numpy out
