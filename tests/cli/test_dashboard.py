"""``aelastic dashboard``: bad input and an unreachable backend are one line each."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests._http_server import free_port

from ._proc import run_cli

pytest.importorskip("aiohttp")


def test_an_unreachable_backend_is_one_line_within_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    code, out = run_cli(
        ["dashboard", "--rdzv-backend", "http", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         "--timeout", "1", "--port", "0"],
        tmp_path,
    )  # fmt: skip
    assert code == 1, out
    assert out.count("\n") == 0 and out.startswith("aelastic dashboard: error: "), out
    assert time.monotonic() - started < 30  # seconds, not the default minute


def test_bad_flags_and_a_taken_port_exit_2(tmp_path: Path) -> None:
    from tests._http_server import HttpServer

    code, out = run_cli(["dashboard", "--rdzv-backend", "memory", "--rdzv-endpoint", "x"], tmp_path)
    assert code == 2 and out.count("\n") == 0 and "memory backend" in out, out
    code, out = run_cli(["dashboard"], tmp_path)
    assert code == 2 and "--rdzv-backend and --rdzv-endpoint are required" in out, out
    with HttpServer() as server, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = run_cli(
            ["dashboard", "--rdzv-backend", "http", "--rdzv-endpoint", server.endpoint,
             "--port", str(port)],
            tmp_path,
        )  # fmt: skip
    assert code == 2 and out.count("\n") == 0 and f"cannot serve on 127.0.0.1:{port}" in out, out
