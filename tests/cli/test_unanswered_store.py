"""``aelastic run`` at an address that takes connections and never answers: the join gives up
within its join timeout, whatever the read timeout, and etcd says what it waits for every
~10 s before the error.

The address is a real process on a loopback port that accepts, reads and never writes a
byte (``tests/_h2_hostile.py``, mode ``silent``); the launcher is a real ``aelastic run``
subprocess with ``--rdzv-conf join_timeout=20`` and the default read timeout (60 s).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests._h2_hostile import HostileServer

from ._proc import Cli

JOIN_TIMEOUT = 20
OUT_WITHIN = 30.0


@pytest.mark.parametrize("kind", ["etcd", "redis", "http"])
def test_a_store_that_never_answers_is_given_up_within_the_join_timeout(
    tmp_path: Path, run_id: str, kind: str
) -> None:
    (tmp_path / "train.py").write_text("print('never run')\n")
    with HostileServer("silent") as server:
        endpoint = f"redis://{server.endpoint}/0" if kind == "redis" else server.endpoint
        args = [
            "run", "--nnodes=1", f"--rdzv-backend={kind}", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf=join_timeout={JOIN_TIMEOUT}",
            "--local-addr=127.0.0.1", "train.py",
        ]  # fmt: skip
        started = time.monotonic()
        with Cli(args, tmp_path) as node:
            code = node.wait(OUT_WITHIN + 30)
            took = time.monotonic() - started
            lines = node.lines
    output = "\n".join(lines)
    assert code == 1 and took < OUT_WITHIN, (took, output)
    [error] = [i for i, x in enumerate(lines) if "error: rendezvous failed" in x]
    assert "did not answer node" in lines[error] and server.endpoint in lines[error], output
    assert f"within its join timeout ({JOIN_TIMEOUT} s)" in lines[error], output
    assert "never run" not in output and "Traceback" not in output, output
    if kind == "etcd":  # a line every ~10 s says what it waits for
        waiting = [x for x in lines[:error] if re.search(r"etcd at \S+ unreachable", x)]
        assert waiting and "said nothing for 10 s" in waiting[0], output
        assert "retrying for" in waiting[0] and server.endpoint in waiting[0], output
