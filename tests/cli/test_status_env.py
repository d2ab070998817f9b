"""``aelastic status`` as an operator runs it: from a job's PET_* variables, failing fast."""

from __future__ import annotations

import time
from pathlib import Path

from tests._http_server import HttpServer, free_port

from ._proc import run_cli


def test_status_reads_the_jobs_pet_variables(tmp_path: Path) -> None:
    with HttpServer() as server:
        env = {
            "PET_RDZV_BACKEND": "http",
            "PET_RDZV_ENDPOINT": server.endpoint,
            "PET_RDZV_ID": "from-env",
        }
        code, out = run_cli(["status", "--json"], tmp_path, env=env)
    assert code == 0, out
    assert '"run_id": "from-env"' in out or "from-env" in out, out


def test_status_of_a_c10d_job_reads_its_host_and_never_hosts(tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    code, out = run_cli(
        ["status", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "job", "--timeout", "1"],
        tmp_path,
    )  # fmt: skip
    assert code == 1, out
    assert len(out.strip().splitlines()) == 1 and "error:" in out, out
    assert time.monotonic() - started < 30  # generous: the point is seconds, not minutes
