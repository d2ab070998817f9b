"""The torchrun plugin: torch's own registry and agent drive aelastic's rendezvous.

In-process tests call torch's registry (as torchrun does) and check torch's types; the
end-to-end tests run real ``torchrun`` processes whose workers all-reduce over gloo.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from aelastic import RendezvousParameters as AelasticParameters
from aelastic import sync
from aelastic.integrations import torchrun as plugin

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
n = dist.get_world_size()
assert value.item() == n * (n + 1) / 2, value
print(f"OK rank={dist.get_rank()} world={n} sum={value.item():g} "
      f"agent_store={os.environ['TORCHELASTIC_USE_AGENT_STORE']}", flush=True)
dist.destroy_process_group()
"""


def _params(run_id: str, nodes: int = 1, **config: Any) -> RendezvousParameters:
    conf = {"join_timeout": "20", "last_call_timeout": "0.1", **config}
    return RendezvousParameters(
        backend="aelastic-memory",
        endpoint="",
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        local_addr="127.0.0.1",
        **conf,
    )


def _join_all(handlers: list[Any]) -> list[Any]:
    infos: list[Any] = [None] * len(handlers)
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return infos


def test_entry_points_are_registered() -> None:
    found = {ep.name: ep for ep in entry_points(group="torchrun.handlers")}
    for name in plugin.BACKENDS:
        assert name in found, f"pip install -e . registers {name}"
        creator = found[name].load()()
        assert creator is plugin.create_handler


def test_handler_through_torchs_registry(run_id: str) -> None:
    handler = get_rendezvous_handler(_params(run_id))
    late = get_rendezvous_handler(_params(run_id))  # a node of this job that comes late
    try:
        assert isinstance(handler, RendezvousHandler)
        assert handler.get_backend() == "aelastic-memory"
        assert handler.get_run_id() == run_id
        assert handler.use_agent_store
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert isinstance(info.store, dist.Store)
        # Workers connect to the TCPStore that group rank 0 hosts for them.
        boot = info.bootstrap_store_info
        client = dist.TCPStore(boot.master_addr, boot.master_port, is_master=False)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert handler.num_nodes_waiting() == 0
        assert not handler.is_closed()
    finally:
        assert handler.shutdown()
    assert handler.is_closed()
    with pytest.raises(RendezvousClosedError, match="the job that used this id is over"):
        late.next_rendezvous()
    late.shutdown()
    # The job is over in this process: the next job with the same id runs (as torch's c10d,
    # whose store dies with the job).
    again = get_rendezvous_handler(_params(run_id))
    try:
        assert (again.next_rendezvous().rank, again.is_closed()) == (0, False)
    finally:
        assert again.shutdown()


def test_store_is_a_torch_store(run_id: str) -> None:
    handler = get_rendezvous_handler(_params(run_id))
    try:
        store = handler.next_rendezvous().store
        store.set("a", "1")
        store.set("b", b"\x00\xff")
        assert store.get("a") == b"1"
        assert store.multi_get(["a", "b"]) == [b"1", b"\x00\xff"]
        store.multi_set(["c", "d"], ["3", "4"])
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert store.check(["a", "c"]) and not store.check(["zz"])
        assert store.compare_set("a", "1", "2") == b"2"
        assert store.compare_set("a", "1", "3") == b"2"
        assert store.delete_key("a") and not store.delete_key("a")
        store.wait(["b", "c"])
        store.set_timeout(datetime.timedelta(seconds=0.1))
        assert store.timeout == datetime.timedelta(seconds=0.1)
        with pytest.raises(dist.DistStoreError):
            store.get("missing")
        with pytest.raises(dist.DistStoreError):
            store.wait(["missing"], datetime.timedelta(milliseconds=50))
        # torch's own helpers run on it (the agent's exit barrier uses them).
        from torch.distributed.elastic.utils.store import barrier

        store.set_timeout(datetime.timedelta(seconds=10))
        barrier(store, 1, key_prefix="test/barrier", barrier_timeout=10)
    finally:
        handler.shutdown()


def test_store_serves_init_process_group(run_id: str) -> None:
    import torch

    handler = get_rendezvous_handler(_params(run_id))
    try:
        info = handler.next_rendezvous()
        store = dist.PrefixStore("pg", info.store)
        dist.init_process_group("gloo", store=store, rank=info.rank, world_size=info.world_size)
        try:
            value = torch.ones(3)
            dist.all_reduce(value)
            dist.barrier()
            assert value.tolist() == [1.0, 1.0, 1.0]
        finally:
            dist.destroy_process_group()
    finally:
        handler.shutdown()


def test_two_nodes_and_a_lost_member(run_id: str) -> None:
    params = _params(run_id, nodes=2, keep_alive_interval="0.1", keep_alive_max_attempt="2")
    first, second = get_rendezvous_handler(params), get_rendezvous_handler(params)
    try:
        infos = _join_all([first, second])
        assert sorted(i.rank for i in infos) == [0, 1]
        assert {i.world_size for i in infos} == {2}
        boots = {
            (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos
        }
        assert len(boots) == 1  # both nodes send their workers to the same TCPStore
        assert first.num_nodes_waiting() == 0
        # The second node dies silently: no leave, no more heartbeats.
        sync.run(second._handler.async_handler.aclose())
        sync.run(asyncio.wait({first._watch}, timeout=20))
        # torch's agent polls this and re-rendezvous when it is > 0.
        assert first.num_nodes_waiting() == 1
    finally:
        first.shutdown()


def test_member_loss_can_be_ignored_like_torch(run_id: str) -> None:
    handler = get_rendezvous_handler(_params(run_id, rescale_on_member_loss="false"))
    try:
        handler.next_rendezvous()
        assert handler._watch is None
    finally:
        handler.shutdown()


def test_memory_waiting_for_other_nodes_is_said(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A torchrun of its own would wait alone until its join timeout, silently before (a
    # TorchX `dist.ddp -j 2x1 --rdzv_backend aelastic-memory` job did).
    handler = plugin.create_handler(_params(run_id, nodes=2))
    try:
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(
            "lives in this process" in m and "waits for 2 nodes" in m and "aelastic-redis" in m
            for m in said
        ), said
    finally:
        handler.shutdown()


def test_a_token_on_torchruns_command_line_is_warned_about(
    run_id: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "T0k-on-the-line"
    argv = ["torchrun", "--rdzv-backend=aelastic-memory", f"--rdzv-conf=token={token}", "t.py"]
    monkeypatch.setattr(sys, "orig_argv", argv)
    handler = plugin.create_handler(_params(run_id, token=token))
    handler.shutdown()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        m.startswith("the token in --rdzv-conf is on the command line, which every user")
        and "give the option in the environment instead (PET_RDZV_CONF)" in m
        for m in said
    ), said
    assert not any(token in m for m in said)


def test_an_endpoint_taken_by_default_is_where_the_backend_goes() -> None:
    from aelastic.backends import BUILTINS, create_backend
    from aelastic.backends.etcd import parse_endpoint as etcd_endpoint
    from aelastic.backends.redis import parse_endpoint as redis_endpoint

    parse = {"redis": redis_endpoint, "etcd": etcd_endpoint}
    for info in BUILTINS:
        if info.default_endpoint is not None:
            read = parse[info.name]
            empty, default = read("", {}, {}), read(info.default_endpoint, {}, {})
            assert empty == default, info.name
        elif info.multi_node:  # no default: an empty endpoint is refused, saying so
            params = AelasticParameters(info.name, "", "x", 1, 1)
            with pytest.raises(ValueError, match="endpoint"):
                create_backend(params)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_default_endpoint_is_named_in_the_first_line_and_the_error(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("redis")
    if _listening(6379):
        pytest.skip("something listens on localhost:6379: the default endpoint would answer")
    params = _params(run_id, read_timeout="2")
    params.backend, params.endpoint = "aelastic-redis", ""
    handler = plugin.create_handler(params)
    note = (
        "the endpoint localhost:6379 is taken by default: no --rdzv-endpoint or "
        "PET_RDZV_ENDPOINT was given"
    )
    try:
        with pytest.raises(Exception) as failed:
            handler.next_rendezvous()
    finally:
        with contextlib.suppress(Exception):
            handler.shutdown()
    assert type(failed.value).__name__ == "RendezvousConnectionError"
    assert type(failed.value).__module__.startswith("torch.")
    assert str(failed.value).endswith(f"({note})"), failed.value
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "aelastic.torchrun" and "redis at" in r.getMessage()
    ]
    assert lines and lines[0].startswith("[aelastic] redis at localhost:6379 unreachable"), lines
    assert lines[0].endswith(f"; {note}") and all(note not in m for m in lines[1:]), lines


def test_the_plugin_logs_what_it_waits_for(run_id: str, caplog: pytest.LogCaptureFixture) -> None:
    # torch's agent says nothing while the rendezvous waits: the plugin logs aelastic's line.
    handler = plugin.create_handler(_params(run_id, nodes=2, join_timeout="1"))
    try:
        with pytest.raises(Exception, match="did not complete"):
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    said = [r for r in caplog.records if r.name == "aelastic.torchrun"]
    waits = [r for r in said if "waiting for nodes" in r.getMessage()]
    assert waits and waits[0].levelname == "WARNING", said
    assert (
        waits[0]
        .getMessage()
        .startswith("[aelastic] waiting for nodes: 1 joined of min 2 (max 2); join timeout in")
    ), waits[0].getMessage()


def test_a_job_on_a_store_with_torchs_default_id_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    params = _params("none")
    params.backend, params.endpoint = "aelastic-http", "127.0.0.1:1"  # never reached
    plugin.create_handler(params)._handler.close()
    memory = _params("none")  # a rendezvous of this process: no other job can share it
    plugin.create_handler(memory).shutdown()
    warned = [r.getMessage() for r in caplog.records if "the job id is 'none'" in r.getMessage()]
    assert len(warned) == 1 and "PET_RDZV_ID" in warned[0], warned


def test_unknown_backend_name() -> None:
    params = _params("x")
    params.backend = "aelastic-nope"
    with pytest.raises(ValueError, match="aelastic-nope"):
        plugin.create_handler(params)


# -- real torchrun ------------------------------------------------------------------------


def _torchrun(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 90) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish:\n{out}")
    assert proc.returncode == 0, out
    return out


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "allreduce.py"
    path.write_text(WORKER)
    return path


@pytest.mark.parametrize("share", ["1", "0"])
def test_torchrun_one_node_two_workers(worker: Path, run_id: str, share: str) -> None:
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share == "1" else "1"}
    proc = _torchrun(
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=aelastic-memory",
        f"--rdzv-id={run_id}",
        str(worker),
        cwd=worker.parent,
        env=env,
    )
    out = _finish(proc)
    assert out.count("OK rank=") == 2
    assert f"agent_store={'True' if share == '1' else 'False'}" in out


def _http_ready() -> bool:
    return importlib.util.find_spec("aelastic.backends.http.client") is not None


def _redis_ready() -> bool:
    return (ROOT / "tests" / "_redis_server.py").exists() and (
        importlib.util.find_spec("aelastic.backends.redis") is not None
    )


@pytest.fixture(params=["http", "redis", "etcd"])
def shared_endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if request.param == "http":
        if not _http_ready():
            pytest.skip("the HTTP backend client has not landed yet")
        from tests._http_server import HttpServer

        with HttpServer() as server:
            yield "aelastic-http", server.endpoint
    elif request.param == "etcd":
        from tests._etcd_server import EtcdServer

        with EtcdServer() as etcd:
            yield "aelastic-etcd", etcd.endpoint
    else:
        if not _redis_ready():
            pytest.skip("the Redis backend has not landed yet")
        from tests._redis_server import RedisServer  # type: ignore[import-not-found]

        with RedisServer() as server:
            yield "aelastic-redis", server.url


def test_torchrun_two_nodes(worker: Path, run_id: str, shared_endpoint: tuple[str, str]) -> None:
    backend, endpoint = shared_endpoint
    args = [
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=0.1,join_timeout=60",
        "--local-addr=127.0.0.1",
        str(worker),
    ]
    nodes = [_torchrun(*args, cwd=worker.parent) for _ in range(2)]
    outs = [_finish(p, timeout=120) for p in nodes]
    combined = "".join(outs)
    assert combined.count("OK rank=") == 2
    assert "world=2 sum=3" in combined


# A worker without torch: prints its world, finishes once it runs in a world of one.
WORLD_WORKER = """
import os, time
world = int(os.environ["WORLD_SIZE"])
print(f"world={world} pid={os.getpid()}", flush=True)
if world != 1:
    time.sleep(120)
"""


def _lines_until(proc: subprocess.Popen[str], text: str, seen: list[str], timeout: float) -> None:
    """Read ``proc``'s output into ``seen`` until a line contains ``text`` (in a thread)."""
    found = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if text in line:
                found.set()
                return

    threading.Thread(target=pump, daemon=True).start()
    assert found.wait(timeout), "".join(seen)


def test_torchrun_survivors_reform_after_a_node_dies(tmp_path: Path, run_id: str) -> None:
    if not _http_ready():
        pytest.skip("the HTTP backend client has not landed yet")
    from tests._http_server import HttpServer

    worker = tmp_path / "world.py"
    worker.write_text(WORLD_WORKER)
    with HttpServer() as server:
        args = [
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=aelastic-http",
            f"--rdzv-endpoint={server.endpoint}",
            f"--rdzv-id={run_id}",
            # A node alone would end at once (its worker wants a world of 1): the last call
            # leaves room for the two torchruns' slow start (torch's import) on a loaded machine.
            "--rdzv-conf=last_call_timeout=5,keep_alive_interval=0.5,keep_alive_max_attempt=3",
            "--local-addr=127.0.0.1",
            str(worker),
        ]
        a, b = (_torchrun(*args, cwd=tmp_path) for _ in range(2))
        try:
            out_a: list[str] = []
            out_b: list[str] = []
            _lines_until(a, "world=2", out_a, 90)
            _lines_until(b, "world=2", out_b, 90)
            # Node B dies with its worker: no goodbye, no more heartbeats.
            victims = [b.pid, *_child_pids(b.pid)]
            for pid in victims:
                os.kill(pid, 9)
            b.wait(30)
            # torch's own agent sees num_nodes_waiting() > 0 and re-forms the group alone.
            a.wait(90)
            rest = a.stdout.read() if a.stdout else ""
        finally:
            for proc in (a, b):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
    output = "".join(out_a) + rest
    assert a.returncode == 0, output
    assert "world=1" in output


def _child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fp:
            direct = [int(p) for p in fp.read().split()]
    except OSError:
        return []
    return direct + [q for child in direct for q in _child_pids(child)]
