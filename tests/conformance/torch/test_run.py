"""torch's ``test/distributed/launcher/test_run.py`` (formerly ``run_test.py``; its older
copy ``elastic_launch_test.py`` has the same scenarios): ``torch.distributed.run``'s
``main`` in the test's process, against :mod:`aelastic.run` with real workers.

Ported: 20 of its 26 tests, as 21 test functions: ``test_launch_user_script_python``,
``..._caffe2_bc``, ``..._bash`` (with ``--no-python`` and ``--module`` refused together),
``..._default_nproc``, ``test_launch_with_env_vars`` (``PET_*``),
``test_nproc_launch_auto_configurations``, ``..._number_...``, ``..._unknown_...``,
``test_launch_elastic`` (``c10d``, with torch's quoted ``--rdzv-conf``),
``test_launch_elastic_worker_raise_exception``, ``test_launch_elastic_agent_raise_exception``
(an error of the agent's own, here its rendezvous', raised as it is), ``test_launch_standalone``,
``test_launch_run_path``, ``test_launch_elastic_multiple_agents`` (a second ``main`` in a
process of its own), ``test_min_max_nodes_parse`` (as two tests), ``test_launch_shutdown`` (on
Redis: the run is closed afterwards), ``test_is_torchelastic_launched``,
``test_is_torchelastic_launched_with_logs_spec_defined``,
``test_logs_logs_spec_entrypoint_must_be_defined``,
``test_capture_logs_using_default_logs_specs``.
Not ported: ``test_nproc_gpu_launch_configurations`` and ``..._xpu_...`` (mocks of
``torch.cuda``/``torch.xpu``; aelastic counts devices without torch:
``tests/cli/test_devices.py``), ``test_is_not_torchelastic_launched`` (torch alone, no
launcher), ``test_init_method_tcp_with_torchelastic``/``..._env_...`` (gloo in four workers,
each importing torch: gloo through aelastic's environment is ``tests/launcher/
test_launcher.py``'s), ``test_virtual_local_rank`` (two GPUs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aelastic import RendezvousConnectionError
from aelastic.run import main
from tests._ports import free_port

from ._agents import WORKER, worker_envs


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's setUp: no ``PET_*`` variables, a sentinel the workers must inherit."""
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TEST_SENTINEL_PARENT", "FOOBAR")


def _script(tmp_path: Path) -> Path:
    """torch's ``bin/test_script.sh``: touches ``<dir>/<RANK>``."""
    script = tmp_path / "test_script.sh"
    script.write_text('#!/bin/bash\ntouch "$1/$RANK"\n')
    script.chmod(0o755)
    return script


def _ranks(out: Path) -> list[int]:
    return sorted(worker_envs(out))


COMMON = ["--monitor-interval=1", "--start-method=spawn", "--no-warm-standby", "-q"]


def _ok(out: Path) -> list[str]:
    """torch's ``bin/test_script.py --touch-file-dir=OUT``: the worker and its arguments."""
    return [WORKER, str(out), "ok"]


def test_launch_user_script_python(run_id: str, tmp_path: Path) -> None:
    main(["--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={run_id}", *COMMON, *_ok(tmp_path)])
    assert _ranks(tmp_path) == [0, 1, 2, 3]
    assert {env["TEST_SENTINEL_PARENT"] for env in worker_envs(tmp_path).values()} == {"FOOBAR"}


def test_launch_user_script_python_caffe2_bc(tmp_path: Path) -> None:
    args = ["--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost"]
    args += [f"--master-port={free_port()}", "--node-rank=0", *COMMON, WORKER, str(tmp_path), "ok"]
    main(args)
    assert _ranks(tmp_path) == [0, 1, 2, 3]


def test_launch_user_script_bash(run_id: str, tmp_path: Path) -> None:
    args = ["--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={run_id}", *COMMON, "--no-python"]
    script_args = [str(_script(tmp_path)), str(tmp_path)]
    with pytest.raises(ValueError):
        main([*args, "--module", *script_args])  # --no-python cannot be used with --module
    main(args + script_args)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]


def test_launch_user_script_default_nproc(run_id: str, tmp_path: Path) -> None:
    args = ["--nnodes=1", f"--rdzv-id={run_id}", *COMMON, "--no-python"]
    main([*args, str(_script(tmp_path)), str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0"]


def test_launch_with_env_vars(run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_RDZV_ID": run_id,
        "PET_MONITOR_INTERVAL": "1",
        "PET_START_METHOD": "spawn",
        "PET_NO_PYTHON": "1",
        "PET_MODULE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    script_args = [str(_script(tmp_path)), str(tmp_path)]
    with pytest.raises(ValueError):
        main(["-q", "--no-warm-standby", *script_args])  # --no-python cannot be used with --module
    monkeypatch.setenv("PET_MODULE", "0")
    main(["-q", "--no-warm-standby", *script_args])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]


def _nproc(run_id: str, tmp_path: Path, nproc: str) -> list[str]:
    args = ["--nnodes=1", f"--nproc-per-node={nproc}", f"--rdzv-id={run_id}", *COMMON]
    main([*args, "--no-python", str(_script(tmp_path)), str(tmp_path)])
    return sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())


def test_nproc_launch_auto_configurations(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` without an accelerator: one worker per CPU (torch's ``cpu_count``)."""
    torch_utils = pytest.importorskip("torch._utils")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    expected = torch_utils.cpu_count()
    assert _nproc(run_id, tmp_path, "auto") == [str(i) for i in range(expected)]


def test_nproc_launch_number_configurations(run_id: str, tmp_path: Path) -> None:
    assert _nproc(run_id, tmp_path, "4") == ["0", "1", "2", "3"]


def test_nproc_launch_unknown_configurations(run_id: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _nproc(run_id, tmp_path, "unknown")


def test_launch_elastic(run_id: str, tmp_path: Path) -> None:
    """A 1:2 job on ``c10d`` at a free port, one node launched (torch's quoted
    ``--rdzv-conf`` as it writes it)."""
    main([
        "--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
        f"--rdzv-id={run_id}", *COMMON, WORKER, str(tmp_path), "ok",
    ])  # fmt: skip
    assert _ranks(tmp_path) == [0, 1, 2, 3]


def test_launch_elastic_worker_raise_exception(run_id: str, tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError):
        main([
            "--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
            f"--rdzv-id={run_id}", "--max-restarts=0", *COMMON, WORKER, str(tmp_path), "fail",
        ])  # fmt: skip


def test_launch_elastic_agent_raise_exception(run_id: str, tmp_path: Path) -> None:
    """An error of the agent's own (its rendezvous cannot be reached) is raised as it is."""
    with pytest.raises(RendezvousConnectionError):
        main([
            "--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=redis",
            f"--rdzv-endpoint=redis://127.0.0.1:{free_port()}",
            "--rdzv-conf=join_timeout=1,read_timeout=1", f"--rdzv-id={run_id}",
            "--max-restarts=0", *COMMON, WORKER, str(tmp_path), "ok",
        ])  # fmt: skip


def test_launch_standalone(tmp_path: Path) -> None:
    main(["--nnodes=1", "--nproc-per-node=4", "--standalone", *COMMON, *_ok(tmp_path)])
    assert _ranks(tmp_path) == [0, 1, 2, 3]


def test_launch_run_path(tmp_path: Path) -> None:
    main(["--run-path", "--nnodes=1", "--nproc-per-node=4", *COMMON, *_ok(tmp_path)])
    assert _ranks(tmp_path) == [0, 1, 2, 3]


def test_launch_elastic_multiple_agents(run_id: str, tmp_path: Path) -> None:
    """Two nodes of a 1:2 job on ``c10d`` (the other ``main`` in a process of its own; a
    long last call, so that a slow start of either never makes two jobs of one node: the
    round completes as soon as both are there)."""
    args = [
        "--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}", "--rdzv-conf=last_call_timeout=20",
        f"--rdzv-id={run_id}", *COMMON, WORKER, str(tmp_path), "ok",
    ]  # fmt: skip
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys, aelastic.run as r; r.main(sys.argv[1:])", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        main(args)
        _, err = other.communicate(timeout=60)
    finally:
        if other.poll() is None:
            other.kill()
            other.communicate()
    assert other.returncode == 0, err.decode(errors="replace")[-2000:]
    assert _ranks(tmp_path) == [0, 1, 2, 3]


@pytest.mark.parametrize(("text", "expected"), [("1", (1, 1)), ("2:20", (2, 20))])
def test_min_max_nodes_parse(text: str, expected: tuple[int, int]) -> None:
    """torch's ``parse_min_max_nnodes`` is ``aelastic.cli.rules.parse_nnodes``
    (docs/torch-api.md)."""
    from aelastic.cli.rules import parse_nnodes

    assert parse_nnodes(text) == expected


def test_min_max_nodes_parse_refuses_more_than_two_numbers() -> None:
    from aelastic.cli.rules import parse_nnodes

    with pytest.raises(RuntimeError):
        parse_nnodes("2:20:30")


def test_launch_shutdown(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """A launch that succeeded shuts its rendezvous down: the run is closed afterwards."""
    from aelastic import RendezvousParameters
    from aelastic.sync import create_handler

    main([
        "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=redis",
        f"--rdzv-endpoint={redis_url}", "--rdzv-conf=last_call_timeout=0.1",
        f"--rdzv-id={run_id}", *COMMON, *_ok(tmp_path),
    ])  # fmt: skip
    with create_handler(RendezvousParameters("redis", redis_url, run_id, 1, 2)) as handler:
        assert handler.is_closed()


_LAUNCHED = (
    "import sys, torch.distributed as dist\n"
    "open(sys.argv[1], 'w').write(str(dist.is_torchelastic_launched()))\n"
)


def test_is_torchelastic_launched(tmp_path: Path) -> None:
    """``torch.distributed.is_torchelastic_launched()`` is True in a worker."""
    pytest.importorskip("torch")
    script = tmp_path / "test_script_is_torchelastic_launched.py"
    script.write_text(_LAUNCHED)
    out = tmp_path / "out"
    main(["--run-path", "--nnodes=1", "--nproc-per-node=1", *COMMON, str(script), str(out)])
    assert out.read_text() == "True"


def test_is_torchelastic_launched_with_logs_spec_defined(tmp_path: Path) -> None:
    """With ``--logs-specs=default`` (torch's entry point of its ``DefaultLogsSpecs``) the
    worker is launched as torchelastic's: ``TORCHELASTIC_RUN_ID`` set, which is what
    ``is_torchelastic_launched()`` reads (the worker does not import torch here)."""
    args = ["--run-path", "--nnodes=1", "--nproc-per-node=1", *COMMON, "--logs_specs=default"]
    main([*args, *_ok(tmp_path)])
    assert worker_envs(tmp_path)[0]["TORCHELASTIC_RUN_ID"]


def test_logs_logs_spec_entrypoint_must_be_defined(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        main([
            "--run-path", "--nnodes=1", "--nproc-per-node=1", *COMMON,
            "--logs_specs=DOESNOT_EXIST", WORKER, str(tmp_path), "ok",
        ])  # fmt: skip


def test_capture_logs_using_default_logs_specs(
    run_id: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--redirect=3 --tee=3`` with ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``: each
    worker's lines reach the console with the prefix."""
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    main([
        "--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={run_id}", "--redirect=3", "--tee=3",
        *COMMON, WORKER, str(tmp_path), "print",
    ])  # fmt: skip
    out = capfd.readouterr().out
    for rank in range(4):
        assert f"[rank{rank}]: creating {rank}" in out, out
