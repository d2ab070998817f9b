"""`aelastic serve` and `aelastic status`: a real server, real launchers, read-only status."""

from __future__ import annotations

import json
import re
import signal
import textwrap
from pathlib import Path

import pytest

from ._proc import Cli, run_cli

pytest.importorskip("aiohttp")

SLEEP = """
import os, time
print(f"worker pid={os.getpid()} rank={os.environ['RANK']}", flush=True)
time.sleep(120)
"""


def _status(tmp_path: Path, endpoint: str, run_id: str, *extra: str) -> tuple[int, str]:
    args = ["status", "--rdzv-backend", "http", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    return run_cli([*args, *extra], tmp_path)


def test_serve_status_and_a_running_job(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    with Cli(["serve", "--port", "0"], tmp_path) as server:
        server.wait_for(lambda lines: any("listening on http://" in line for line in lines))
        url = re.findall(r"listening on (http://\S+)", server.output)[0]
        endpoint = url.removeprefix("http://")

        code, out = _status(tmp_path, endpoint, run_id)
        assert code == 0, out
        assert "no rendezvous state" in out

        node_args = [
            "run",
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "http",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            "last_call_timeout=0.1",
            "--local-addr",
            "127.0.0.1",
            "sleep.py",
        ]
        with Cli(node_args, tmp_path) as node:
            node.wait_for(lambda lines: any("worker pid=" in line for line in lines))
            code, out = _status(tmp_path, endpoint, run_id)
            assert code == 0, out
            assert re.search(rf"job '{run_id}': round \d+, complete", out), out
            assert re.search(r"rank +0 +127\.0\.0\.1_\d+_\d+ +heartbeat \d+\.\d s ago", out), out
            assert "waiting (0)" in out and "redundant (0)" in out

            code, out = _status(tmp_path, endpoint, run_id, "--json")
            doc = json.loads(out)
            assert doc["complete"] and not doc["closed"]
            assert [p["rank"] for p in doc["participants"]] == [0]
            assert doc["participants"][0]["alive"]

            node.signal(signal.SIGTERM)
            assert node.wait(60) == 1

        # The stopped node left the rendezvous (without closing it for the others).
        code, out = _status(tmp_path, endpoint, run_id, "--json")
        doc = json.loads(out)
        assert doc["participants"] == [] and not doc["closed"], doc

        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0


def test_status_of_an_unreachable_server(tmp_path: Path) -> None:
    from tests._http_server import free_port

    code, out = _status(
        tmp_path, f"127.0.0.1:{free_port()}", "job", "--rdzv-conf", "read_timeout=2"
    )
    assert code == 1
    assert "error" in out


def test_status_rejects_the_memory_backend(tmp_path: Path) -> None:
    code, out = run_cli(
        ["status", "--rdzv-backend", "memory", "--rdzv-endpoint", "x", "--rdzv-id", "y"], tmp_path
    )
    assert code == 2 and "redis, http or etcd" in out


def test_serve_port_in_use(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code, out = run_cli(["serve", "--port", str(port)], tmp_path)
    assert code == 1
    assert "cannot serve" in out


def test_status_watch_prints_each_change(tmp_path: Path, run_id: str) -> None:
    from tests._http_server import HttpServer

    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    with HttpServer() as server:
        args = ["status", "--rdzv-backend", "http", "--rdzv-endpoint", server.endpoint]
        with Cli([*args, "--rdzv-id", run_id, "--watch"], tmp_path) as watch:
            watch.wait_for(lambda lines: any("no rendezvous state" in line for line in lines))
            node = Cli(
                [
                    "run",
                    "--rdzv-backend=http",
                    f"--rdzv-endpoint={server.endpoint}",
                    f"--rdzv-id={run_id}",
                    "--local-addr=127.0.0.1",
                    "sleep.py",
                ],
                tmp_path,
            )
            with node:
                watch.wait_for(lambda lines: any(", complete" in line for line in lines))
                watch.wait_for(lambda lines: any("rank   0  127.0.0.1_" in line for line in lines))
                node.wait_for(lambda lines: any("worker pid=" in line for line in lines))
                node.signal(signal.SIGTERM)
                assert node.wait(60) == 1, node.output
            # The node left: the watcher shows a state without participants.
            watch.wait_for(lambda lines: any("participants (0)" in line for line in lines))
            watch.signal(signal.SIGINT)
            assert watch.wait(30) in (0, 130)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_status_watch_ends_on_sigint(tmp_path: Path, run_id: str, inherited: str) -> None:
    # SIGINT inherited ignored (a background job of a script) once left --watch running.
    from tests._http_server import HttpServer

    with HttpServer() as server:
        args = ["status", "--rdzv-backend", "http", "--rdzv-endpoint", server.endpoint]
        with Cli([*args, "--rdzv-id", run_id, "--watch"], tmp_path, sigint=inherited) as watch:
            watch.wait_for(lambda lines: any("no rendezvous state" in line for line in lines))
            watch.signal(signal.SIGINT)
            assert watch.wait(60) == 130, watch.output


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--trusted-proxy", "proxy.example"], "--trusted-proxy: 'proxy.example' is not an IP"),
        (["--trusted-proxy", "127.0.0.1,10.0.0.0/33"], "'10.0.0.0/33' is not an IP"),
        (["--max-nodes-per-client", "-1"], "--max-nodes-per-client must be >= 0"),
    ],
)
def test_serve_refuses_bad_client_limits(tmp_path: Path, flags: list[str], said: str) -> None:
    code, out = run_cli(["serve", "--port", "0", *flags], tmp_path)
    assert code == 2 and said in out, out


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "auto"])
def test_serve_runs_on_the_event_loop_asked(tmp_path: Path, run_id: str, loop: str) -> None:
    from tests._http_server import HttpServer

    with HttpServer(extra_args=("--loop", loop)) as server:
        code, out = _status(tmp_path, server.endpoint, run_id)
    assert code == 0 and "no rendezvous state" in out, out


def test_serve_refuses_an_unknown_event_loop(tmp_path: Path) -> None:
    code, out = run_cli(["serve", "--port", "0", "--loop", "trio"], tmp_path)
    assert code == 2 and "invalid choice: 'trio'" in out, out


def test_the_server_s_loop_names_what_it_needs() -> None:
    from aelastic.backends.http.server import resolve_loop

    assert resolve_loop("asyncio") == "asyncio"
    assert resolve_loop("auto") == "uvloop"  # installed with the http extra
    with pytest.raises(ValueError, match="unknown event loop 'tornado'"):
        resolve_loop("tornado")
