"""``aelastic.worker.InPlace`` without an agent, and what it takes for a broken group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from aelastic.worker import GroupChanged, InPlace
from aelastic.worker._inplace import recoverable


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
            print("raised:", exc, len(calls), calls[0].world_size, calls[0].source)
        """
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sys.path[0]}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert "raised: Connection closed by peer 1 1 None" in out.stdout, out.stderr
