"""SIGINT ends `aelastic run` wherever it is: starting up, in the rendezvous, running workers.

Each case also runs with SIGINT inherited ignored (a background job of a shell script),
which once made the signal-handling of Python and asyncio, and so aelastic, deaf to it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .._http_server import HttpServer
from ._proc import Cli, alive, cli_env

SLEEP = """
import os, time
os.write(1, f"worker pid={os.getpid()}\\n".encode())
time.sleep(120)
"""

#: Generous: the machine may be loaded; a stuck launcher would wait for 120 s.
EXIT_BOUND = 60.0


def _has(text: str):  # type: ignore[no-untyped-def]
    return lambda lines: any(text in line for line in lines)


def _workers(cli: Cli) -> list[int]:
    return [int(pid) for pid in re.findall(r"worker pid=(\d+)", cli.output)]


@pytest.mark.parametrize(
    ("point", "inherited"),
    [
        ("start", "default"),  # a SIGINT ignored before Python runs aelastic is lost
        ("launch", "default"),
        ("launch", "ignored"),
        ("workers", "default"),
        ("workers", "ignored"),
    ],
)
def test_sigint_ends_a_standalone_launch(tmp_path: Path, point: str, inherited: str) -> None:
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    args = ["run", "--nproc-per-node", "2", "sleep.py"]
    with Cli(args, tmp_path, sigint=inherited) as cli:
        if point == "launch":
            cli.wait_for(_has("launching sleep.py"))
        elif point == "workers":
            cli.wait_for(lambda lines: len(re.findall(r"worker pid=", "\n".join(lines))) == 2)
        cli.signal(signal.SIGINT)
        code = cli.wait(EXIT_BOUND)
    if point == "start":  # before aelastic's own code ran, Python's KeyboardInterrupt ends it
        assert code in (1, -signal.SIGINT), cli.output
    else:
        assert code == 1, cli.output
        assert "received SIGINT" in cli.output, cli.output
    assert not [pid for pid in _workers(cli) if alive(pid)], cli.output


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_ends_a_launch_waiting_in_the_rendezvous(
    tmp_path: Path, run_id: str, inherited: str
) -> None:
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    with HttpServer() as server:
        rdzv = [
            "--rdzv-backend=http",
            f"--rdzv-endpoint={server.endpoint}",
            f"--rdzv-id={run_id}",
        ]
        status = ["status", *rdzv, "--watch"]
        with Cli(status, tmp_path) as watch:
            watch.wait_for(_has("no rendezvous state"))
            args = ["run", "--nnodes=2", *rdzv, "--local-addr=127.0.0.1", "sleep.py"]
            with Cli(args, tmp_path, sigint=inherited) as node:
                # It joined and waits for a second node that never comes.
                watch.wait_for(_has("participants (1)"))
                node.signal(signal.SIGINT)
                code = node.wait(EXIT_BOUND)
            assert code == 1, node.output
            assert "received SIGINT" in node.output, node.output
            assert not _workers(node)
            watch.wait_for(_has("participants (0)"))  # and it left the rendezvous
            watch.signal(signal.SIGINT)
            assert watch.wait(EXIT_BOUND) == 130


# Starts like a background job of a script (SIGINT ignored), then gets SIGINT while the
# command's own modules load: the kernel once discarded it, and the command ran on.
EARLY = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
module, argv = sys.argv[1], sys.argv[2:]

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
from aelastic.cli import main
sys.exit(main(argv))
"""


@pytest.mark.parametrize(
    ("command", "module", "code"),
    [
        ("status", "aelastic.cli.status", 130),
        ("serve", "aelastic.cli.serve", 130),
        ("run", "aelastic.cli.launch", 1),
    ],
)
def test_sigint_while_a_command_starts_with_sigint_inherited_ignored(
    tmp_path: Path, command: str, module: str, code: int
) -> None:
    (tmp_path / "early.py").write_text(EARLY)
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    args = {
        "status": ["--rdzv-backend=http", "--rdzv-endpoint=127.0.0.1:9", "--rdzv-id=x", "--watch"],
        "serve": ["--port=0"],
        "run": ["--standalone", "sleep.py"],
    }[command]
    env = cli_env()
    proc = subprocess.run(
        [sys.executable, "early.py", module, command, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXIT_BOUND,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "worker pid=" not in proc.stdout
