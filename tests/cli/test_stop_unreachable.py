"""A stop signal ends ``aelastic run`` within the grace period while the store is unreachable.

Two ways for a store to be unreachable: it never was there (the node keeps asking to join),
or it died under a running job (the node beats and watches in vain). Either way SIGINT or
SIGTERM ends the launcher within ``--shutdown-timeout`` (plus generous slack), with no retry
line after the signal (no fresh retry budget begins).
"""

from __future__ import annotations

import signal
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests._ports import free_port

from ._proc import Cli, alive

# Says it started, then sleeps until stopped (SIGINT, as torchrun forwards it, too).
# The write is in the try: a starved worker may take the SIGINT before its next line.
SLEEP = """
import os, time
try:
    os.write(1, f"worker pid={os.getpid()}\\n".encode())
    time.sleep(300)
except KeyboardInterrupt:
    pass
"""

GRACE = 3.0
SLACK = 12.0  # the last word to the store (one heartbeat timeout) and a loaded machine


@contextmanager
def _store(kind: str) -> Iterator[tuple[str, object]]:
    if kind == "http":
        pytest.importorskip("aiohttp")
        from tests._http_server import HttpServer

        with HttpServer() as http:
            yield http.endpoint, http
    else:
        pytest.importorskip("redis")
        from tests._redis_server import RedisServer

        with RedisServer() as redis:
            yield redis.url, redis


def _args(kind: str, endpoint: str, run_id: str, nnodes: str) -> list[str]:
    return [
        "run", f"--nnodes={nnodes}", f"--rdzv-backend={kind}", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}", f"--shutdown-timeout={GRACE:g}", "--local-addr=127.0.0.1",
        "--rdzv-conf=keep_alive_interval=0.5", "sleep.py",
    ]  # fmt: skip


def _stopped(node: Cli, sig: signal.Signals) -> None:
    node.signal(sig)
    sent = time.monotonic()
    code = node.wait(60)
    took = time.monotonic() - sent
    assert code == 1, node.output
    assert took < GRACE + SLACK, (took, node.output)
    lines = node.lines
    [received] = [i for i, x in enumerate(lines) if f"received {sig.name}" in x]
    after = lines[received + 1 :]
    assert not [x for x in after if "retrying" in x or "unreachable" in x], node.output
    assert f"stopped by {sig.name}" in node.output, node.output
    assert "Traceback" not in node.output, node.output


@pytest.mark.parametrize(
    ("kind", "sig"), [("redis", signal.SIGINT), ("http", signal.SIGTERM)], ids=["redis", "http"]
)
def test_a_signal_while_the_store_was_never_there(
    tmp_path: Path, run_id: str, kind: str, sig: signal.Signals
) -> None:
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    port = free_port()  # nothing listens there
    endpoint = f"redis://127.0.0.1:{port}/0" if kind == "redis" else f"127.0.0.1:{port}"
    with Cli(_args(kind, endpoint, run_id, "2"), tmp_path) as node:
        node.wait_for(lambda lines: any("unreachable" in x for x in lines), 60)
        _stopped(node, sig)


@pytest.mark.parametrize(
    ("kind", "sig"), [("redis", signal.SIGTERM), ("http", signal.SIGINT)], ids=["redis", "http"]
)
def test_a_signal_after_the_store_died_under_a_running_job(
    tmp_path: Path, run_id: str, kind: str, sig: signal.Signals
) -> None:
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    with (
        _store(kind) as (endpoint, server),
        Cli(_args(kind, endpoint, run_id, "1"), tmp_path) as node,
    ):
        node.wait_for(lambda lines: any("worker pid=" in x for x in lines), 60)
        worker = int(next(x for x in node.lines if "worker pid=" in x).split("=")[1])
        server.kill()  # type: ignore[attr-defined]
        node.wait_for(lambda lines: any("unreachable" in x for x in lines), 60)
        _stopped(node, sig)
    assert not alive(worker)
