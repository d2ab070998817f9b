"""Bad input to the CLI gets one clear line: wrong ports, misspelt keys, impossible flags."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic.cli.conf_keys import RENDEZVOUS_KEYS, known_keys, unknown_key_warnings

from ._proc import Cli, run_cli

HELLO = "import os\nos.write(1, f\"hello rank {os.environ['RANK']}\\n\".encode())\n"  # one write
SLEEP = """
import os, time
os.write(1, f"worker pid={os.getpid()}\\n".encode())
time.sleep(120)
"""


class GarbageServer:
    """A plain TCP server that answers every connection with a line that is not Redis."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(4096)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6 not redis\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the thread
        self._sock.close()
        self._thread.join(5)


@pytest.fixture
def garbage_server() -> Iterator[GarbageServer]:
    server = GarbageServer()
    try:
        yield server
    finally:
        server.close()


def _run_redis(tmp_path: Path, endpoint: str) -> tuple[int, str]:
    (tmp_path / "hello.py").write_text(HELLO)
    args = ["run", "--rdzv-backend", "redis", "--rdzv-endpoint", endpoint, "--rdzv-id", "job"]
    return run_cli([*args, "--local-addr", "127.0.0.1", "hello.py"], tmp_path, timeout=90)


def _assert_one_clear_error(out: str, port: int) -> None:
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out
    assert f"127.0.0.1:{port}" in errors[0] and "is it a Redis server?" in errors[0], out
    # The password warning, the banner, the hangs line, a pub/sub warning at most, the error.
    assert len(out.splitlines()) <= 5, out


def test_redis_backend_at_an_http_server(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    pytest.importorskip("aiohttp")
    from tests._http_server import HttpServer

    with HttpServer() as server:
        code, out = _run_redis(tmp_path, f"redis://user:pw-9c1e@127.0.0.1:{server.port}/0")
    assert code == 1, out
    _assert_one_clear_error(out, server.port)
    assert "pw-9c1e" not in out


def test_redis_backend_at_a_server_answering_garbage(
    tmp_path: Path, garbage_server: GarbageServer
) -> None:
    pytest.importorskip("redis")
    code, out = _run_redis(tmp_path, f"127.0.0.1:{garbage_server.port}")
    assert code == 1, out
    _assert_one_clear_error(out, garbage_server.port)
    assert "SSH-2.0" in out  # what it answered, as a hint

    args = ["status", "--rdzv-backend", "redis", "--rdzv-endpoint"]
    code, out = run_cli([*args, f"127.0.0.1:{garbage_server.port}", "--rdzv-id", "j"], tmp_path)
    assert code == 1, out
    _assert_one_clear_error(out, garbage_server.port)


def test_standalone_cannot_wait_for_other_nodes(tmp_path: Path) -> None:
    (tmp_path / "hello.py").write_text(HELLO)
    for args, env in (
        (["--standalone", "--nnodes", "2"], None),
        (["--standalone", "--nnodes", "2:4"], None),
        ([], {"PET_STANDALONE": "1", "PET_NNODES": "3"}),
    ):
        code, out = run_cli(["run", *args, "hello.py"], tmp_path, env=env, timeout=30)
        assert code == 2, out
        assert out.count("\n") == 0 and out.startswith("aelastic run: error: --standalone"), out
        assert "hello rank" not in out
    # One node is enough: MAX > 1 is only a hope (the round completes after the last call).
    conf = ["--rdzv-conf", "last_call_timeout=0.5"]
    code, out = run_cli(["run", "--standalone", "--nnodes", "1:2", *conf, "hello.py"], tmp_path)
    assert code == 0, out


def test_unknown_rdzv_conf_keys_are_named_once_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "hello.py").write_text(HELLO)
    conf = "join_timout=60,last_call_timeout=1,bogus=1,join_timout=30,keep_alive_intervall=2"
    code, out = run_cli(["run", "--standalone", "--rdzv-conf", conf, "hello.py"], tmp_path)
    assert code == 0, out
    warnings = [line for line in out.splitlines() if "warning: unknown --rdzv-conf" in line]
    assert len(warnings) == 3, out
    assert warnings[0].endswith(
        "warning: unknown --rdzv-conf key 'join_timout' (did you mean 'join_timeout'?)"
    )
    assert warnings[1].endswith("unknown --rdzv-conf key 'bogus' (ignored)")
    assert "'keep_alive_intervall' (did you mean 'keep_alive_interval'?)" in warnings[2]
    assert "last_call_timeout" not in out


def test_known_keys_come_from_each_backend() -> None:
    from aelastic.backends import backend_info

    redis_row, http_row = backend_info("redis"), backend_info("http")
    assert redis_row is not None and http_row is not None
    assert known_keys("redis") == {*RENDEZVOUS_KEYS, *redis_row.config_keys}
    assert known_keys("http") == {*RENDEZVOUS_KEYS, *http_row.config_keys}
    assert known_keys("memory") == set(RENDEZVOUS_KEYS)
    assert known_keys("no-such-backend") is None  # nothing declared: nothing checked
    everything = ["read_timeout", "is_host", "password", "key_ttl"]
    assert unknown_key_warnings([*everything, "tls", "share_connections"], "redis") == []
    assert unknown_key_warnings(["token", "share_connections"], "http") == []
    assert unknown_key_warnings(["passwrd"], "redis") == [
        "unknown --rdzv-conf key 'passwrd' (did you mean 'password'?)"
    ]
    assert unknown_key_warnings(["password"], "http") == [
        "unknown --rdzv-conf key 'password' (ignored)"
    ]


def test_status_warns_about_unknown_keys(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    from tests._http_server import HttpServer

    with HttpServer() as server:
        args = ["status", "--rdzv-backend", "http", "--rdzv-endpoint", server.endpoint]
        code, out = run_cli([*args, "--rdzv-id", "j", "--rdzv-conf", "tokn=x"], tmp_path)
    assert code == 0, out
    assert "warning: unknown --rdzv-conf key 'tokn' (did you mean 'token'?)" in out
    assert "no rendezvous state" in out


def test_status_json_has_no_rank_before_the_round_completes(tmp_path: Path, run_id: str) -> None:
    pytest.importorskip("aiohttp")
    from tests._http_server import HttpServer

    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    with HttpServer() as server:
        rdzv = ["--rdzv-backend", "http", "--rdzv-endpoint", server.endpoint, "--rdzv-id", run_id]
        watch_args = ["status", *rdzv, "--json", "--watch"]
        node_args = ["run", "--nnodes", "2", *rdzv, "--local-addr", "127.0.0.1", "sleep.py"]
        with Cli(watch_args, tmp_path) as watch, Cli(node_args, tmp_path) as node:
            # One node of two joined: the round is forming, its rank is not decided yet.
            watch.wait_for(lambda lines: any('"participants": [{' in line for line in lines))
            doc = json.loads(next(line for line in watch.lines if '"participants": [{' in line))
            assert not doc["complete"], doc
            assert [p["rank"] for p in doc["participants"]] == [None], doc

            # A second node completes it: ranks appear.
            with Cli(node_args, tmp_path) as other:
                watch.wait_for(lambda lines: any('"complete": true' in line for line in lines))
                line = next(line for line in watch.lines if '"complete": true' in line)
                ranks = sorted(p["rank"] for p in json.loads(line)["participants"])
                assert ranks == [0, 1], line
                other.signal(signal.SIGTERM)
                other.wait(60)
            node.signal(signal.SIGTERM)
            node.wait(60)
            watch.signal(signal.SIGINT)
            assert watch.wait(30) in (0, 130)
