"""Hugging Face accelerate on aelastic's rendezvous, exactly as docs/torchrun-plugin.md says.

The commands are read from the page's accelerate section (its ``bash`` blocks and its
``python`` block); a test only replaces their hosts, ports, process counts and script
(``examples/accelerate_train.py``, CPU over gloo), and fails if the page no longer has what
it replaces. Real servers (``aelastic serve``, ``redis-server``), real ``accelerate launch``
processes (torch's launcher and agent, the torchrun plugin), the accelerate of
tests/requirements.lock. A server "on another machine" listens on 127.0.0.2: accelerate's
check of ``--main_process_port`` on machine rank 0 looks at ``localhost`` only.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests._http_server import HttpServer
from tests._ports import free_port
from tests.examples._run import ROOT, finish, run, start

pytest.importorskip("accelerate")

DOC = ROOT / "docs" / "torchrun-plugin.md"
SCRIPT = "examples/accelerate_train.py"
#: accelerate (then torch) imports take ~5 s on a quiet 2-core machine, far more under load;
#: a job run again with its id waits up to 30 s more for it.
TIMEOUT = 150
ACCELERATE = ["-m", "accelerate.commands.accelerate_cli"]


# -- the page ------------------------------------------------------------------------------


def _section() -> str:
    text = DOC.read_text()
    return text.split("## Under Hugging Face accelerate", 1)[1].split("\n## ", 1)[0]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _section(), re.DOTALL)


def _documented(*, has: str = "", lacks: str = "") -> tuple[dict[str, str], list[str]]:
    """(exported variables, accelerate's arguments) of the page's ``bash`` block that has
    ``has`` and lacks ``lacks``."""
    found = [b for b in _blocks("bash") if has in b and not (lacks and lacks in b)]
    assert len(found) == 1, found
    env: dict[str, str] = {}
    argv: list[str] = []
    for line in found[0].replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            for word in words[1:]:
                name, _, value = word.partition("=")
                env[name] = value
        elif words[:2] == ["accelerate", "launch"]:
            argv = words[1:]
    assert argv, found[0]
    return env, argv


def _with(argv: list[str], **values: str) -> list[str]:
    """``argv`` with the value after each ``--<flag>`` replaced (a flag the page does not
    have fails), and the script replaced by the example."""
    argv = list(argv)
    for flag, value in values.items():
        index = argv.index(f"--{flag}")  # ValueError: the page lost the flag
        argv[index + 1] = value
    assert argv[-1] == "train.py", argv
    argv[-1] = SCRIPT
    return ACCELERATE + argv


def _trained(out: str) -> list[str]:
    """The ranks that trained, each with the model it fitted (all equal under DDP)."""
    fitted = re.findall(r"\[accelerate\] rank (\d) of 2 \(DistributedType\.MULTI_CPU\): (.*)", out)
    assert len({model for _, model in fitted}) == 1, out
    return sorted(rank for rank, _ in fitted)


# -- the stores ----------------------------------------------------------------------------


@pytest.fixture(params=["http", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(backend, endpoint) of a real store on 127.0.0.1."""
    with _store(request.param, "127.0.0.1") as found:
        yield found


@contextlib.contextmanager
def _store(kind: str, host: str) -> Iterator[tuple[str, str]]:
    """A real store of ``kind`` listening on ``host``: (torchrun backend, ``host:port``)."""
    if kind == "http":
        with HttpServer(host=host) as server:
            yield "aelastic-http", server.endpoint
    else:
        from tests._redis_server import RedisServer

        with RedisServer(host=host) as server:
            yield "aelastic-redis", f"{host}:{server.port}"


# -- one machine ---------------------------------------------------------------------------


@pytest.mark.timeout(2 * TIMEOUT + 20)
def test_accelerate_launch_twice_with_its_default_id(store: tuple[str, str]) -> None:
    backend, endpoint = store
    env, argv = _documented(lacks="--num_machines")
    assert set(env) == {"PET_RDZV_ENDPOINT", "PET_RDZV_ID"}
    env = {"PET_RDZV_ENDPOINT": endpoint}  # and no PET_RDZV_ID: accelerate's id, none
    args = _with(argv, num_processes="2", rdzv_backend=backend)
    outs = []
    for _ in range(2):
        code, out = run(args, timeout=TIMEOUT, env=env)
        assert code == 0, out
        assert _trained(out) == ["0", "1"], out
        outs.append(out)
    first, second = outs
    assert "the job id is 'none', torch's default" in first, first
    assert "waiting for the job id" not in first, first
    waits = re.findall(r"\[aelastic\] waiting for the job id: .* free again in (\d+) s", second)
    assert waits and int(waits[0]) <= 30, second


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(TIMEOUT + 10)
def test_an_endpoint_taken_by_default_is_named_in_the_first_line_and_the_error() -> None:
    pytest.importorskip("redis")
    if _listening(6379):
        pytest.skip("something listens on localhost:6379: the default endpoint would answer")
    _, argv = _documented(lacks="--num_machines")
    args = _with(argv, num_processes="2")
    # No PET_RDZV_ENDPOINT: aelastic-redis goes to localhost:6379, where nothing answers.
    code, out = run([*args[:-1], "--rdzv_conf", "read_timeout=5", args[-1]], TIMEOUT)
    assert code != 0, out
    note = (
        "the endpoint localhost:6379 is taken by default: no --rdzv-endpoint or "
        "PET_RDZV_ENDPOINT was given"
    )
    lines = [line for line in out.splitlines() if line.startswith("[aelastic] redis at")]
    assert lines and lines[0].endswith(f"retrying for 5 s more; {note}"), out
    assert all(note not in line for line in lines[1:]), out  # said once
    assert re.search(rf"RendezvousConnectionError: Redis at .*\({re.escape(note)}\)$", out, re.M)


# -- two machines --------------------------------------------------------------------------


def _two_machines(
    argv: list[str], env: dict[str, str], hosted: int | None = None, **values: str
) -> list[str]:
    """Machine ranks 0 and 1 of one job, on this host. With ``hosted`` (the port machine
    rank 0 hosts the rendezvous on), rank 1 starts once rank 0 listens there: on two real
    machines only rank 0's is local, but here both are, and accelerate refuses to start
    machine rank 0 when the port is taken, as it is if rank 1 came first and hosted it."""
    nodes = [start(_with(argv, machine_rank="0", num_processes="2", **values), env)]
    if hosted is not None and not _listens_within(hosted, nodes[0], TIMEOUT):
        code, out = finish(nodes[0], 5)
        raise AssertionError(f"machine rank 0 never listened on {hosted} (exit {code}):\n{out}")
    nodes.append(start(_with(argv, machine_rank="1", num_processes="2", **values), env))
    outs = []
    for node in nodes:
        code, out = finish(node, TIMEOUT)
        assert code == 0, out
        outs.append(out)
    return outs


def _listens_within(port: int, proc: subprocess.Popen[str], within: float) -> bool:
    """Whether something listens on 127.0.0.1:``port`` within ``within`` seconds, while
    ``proc`` runs."""
    deadline = time.monotonic() + within
    while proc.poll() is None and time.monotonic() < deadline:
        if _listening(port):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(2 * TIMEOUT + 20)
@pytest.mark.parametrize("kind", ["http", "redis", "c10d"])
def test_accelerate_launch_on_two_machines_with_the_main_process_flags(kind: str) -> None:
    env, argv = _documented(has="--main_process_ip")
    assert set(env) == {"PET_RDZV_ID"}
    env = {"PET_RDZV_ID": f"two-machines-{kind}"}
    if kind == "c10d":  # the machine at --main_process_ip hosts the rendezvous
        port = free_port()
        outs = _two_machines(
            argv,
            env,
            hosted=port,
            rdzv_backend="aelastic-c10d",
            main_process_ip="127.0.0.1",
            main_process_port=str(port),
        )
    else:  # the store is on "another machine": 127.0.0.2, not localhost
        with _store(kind, "127.0.0.2") as (backend, endpoint):
            host, port = endpoint.rsplit(":", 1)
            outs = _two_machines(
                argv, env, rdzv_backend=backend, main_process_ip=host, main_process_port=port
            )
    ranks = [_trained(out) for out in outs]
    assert sorted(r for node in ranks for r in node) == ["0", "1"], outs


@pytest.mark.timeout(TIMEOUT + 20)
def test_accelerate_launch_on_two_machines_with_a_store_on_machine_rank_0(
    store: tuple[str, str],
) -> None:
    # The store listens on localhost of machine rank 0: the flags cannot name it there
    # (accelerate refuses a port in use); PET_RDZV_ENDPOINT with --same_network can, in the
    # URL form too.
    backend, endpoint = store
    env, argv = _documented(has="--same_network")
    assert set(env) == {"PET_RDZV_ENDPOINT", "PET_RDZV_ID"}
    scheme = "http" if backend == "aelastic-http" else "redis"
    env = {"PET_RDZV_ENDPOINT": f"{scheme}://{endpoint}", "PET_RDZV_ID": "on-rank-0"}
    outs = _two_machines(argv, env, rdzv_backend=backend)
    assert sorted(r for out in outs for r in _trained(out)) == ["0", "1"], outs


# -- notebook_launcher ---------------------------------------------------------------------

TRAIN = """
import sys


def train():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), "sum")
    sys.stdout.write(
        f"[notebook] rank {accelerator.process_index} of {accelerator.num_processes}: "
        f"sum {total.item():g}\\n"
    )
    sys.stdout.flush()

"""


@pytest.mark.timeout(TIMEOUT + 10)
def test_notebook_launcher_cell_run_twice(store: tuple[str, str]) -> None:
    backend, endpoint = store
    (cell,) = _blocks("python")
    for documented, ours in (('"aelastic-http"', repr(backend)), ("server-host:29400", endpoint)):
        assert documented in cell, cell
        cell = cell.replace(documented, ours)
    ran = "print('the cell ran', flush=True)\n"
    code, out = run(["-c", textwrap.dedent(TRAIN) + cell + ran + cell + ran], TIMEOUT)
    assert code == 0, out
    first, second = out.split("the cell ran\n")[:2]
    for part in (first, second):
        sums = re.findall(r"\[notebook\] rank (\d) of 2: sum 3$", part, re.M)
        assert sorted(sums) == ["0", "1"], out
    assert "waiting for the job id" not in first, out
    assert re.search(r"\[aelastic\] waiting for the job id: .* free again in \d+ s", second), out


@pytest.mark.timeout(TIMEOUT + 10)
def test_notebook_launcher_on_two_machines(store: tuple[str, str]) -> None:
    # Each machine's notebook runs the cell with num_nodes=2 and the same rdzv_id.
    backend, endpoint = store
    (cell,) = _blocks("python")
    for documented, ours in (
        ('"aelastic-http"', repr(backend)),
        ("server-host:29400", endpoint),
        ("num_processes=2,", "num_processes=2, num_nodes=2,"),
    ):
        assert documented in cell, cell
        cell = cell.replace(documented, ours)
    notebooks = [start(["-c", textwrap.dedent(TRAIN) + cell]) for _ in range(2)]
    sums = []
    for notebook in notebooks:
        code, out = finish(notebook, TIMEOUT)
        assert code == 0, out
        sums += re.findall(r"\[notebook\] rank (\d) of 4: sum 10$", out, re.M)
    assert sorted(sums) == ["0", "1", "2", "3"], sums
