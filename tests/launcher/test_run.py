"""aelastic.run: torchrun's Python entry points, as Lightning Fabric and accelerate call them.

``torch.distributed.run.main([...])`` / ``run(args)`` with the import changed: a job runs,
a failed worker raises torch's ``ChildFailedError`` naming the rank and the exception, and
the launcher's own ``TORCHELASTIC_ERROR_FILE`` gets the root cause in torch's format.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.elastic.multiprocessing.errors as torch_errors

import aelastic.run as distrib_run
from tests.cli._proc import cli_env

FAILING = """
import os
if os.environ["RANK"] == "1":
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise KeyError("no such shard on rank 1")

    main()
"""


@pytest.fixture
def failing(tmp_path: Path) -> Path:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    return script


def test_main_raises_torchs_child_failed_error_and_writes_the_error_file(
    failing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "launcher-error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(torch_errors.ChildFailedError) as caught:
        distrib_run.main(["--nproc-per-node", "2", "--max-restarts", "0", str(failing)])
    rank, failure = caught.value.get_first_failure()
    assert rank == 1 and failure.local_rank == 1 and failure.exitcode == 1
    assert failure.message["message"] == "KeyError: 'no such shard on rank 1'"
    assert caught.value.name == str(failing)
    assert "KeyError: 'no such shard on rank 1'" in str(caught.value)
    written = json.loads(error_file.read_text())
    assert written["message"]["message"] == "KeyError: 'no such shard on rank 1'"
    assert "failing.py" in written["message"]["extraInfo"]["py_callstack"]
    assert written["message"]["errorCode"] == 1


def test_run_takes_a_namespace_built_like_accelerates(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    out = tmp_path / "out"
    script.write_text(
        f"import os\nopen({str(out)!r} + os.environ['RANK'], 'w').write(os.environ['WORLD_SIZE'])\n"
    )
    # accelerate filters its own namespace through get_args_parser() and sets values as text.
    args, _ = distrib_run.get_args_parser().parse_known_args(["--training_script", "x"])
    args.training_script = str(script)
    args.training_script_args = []
    args.nproc_per_node = "2"
    args.nnodes = "1"
    args.master_port = "29555"
    args.node_rank = 0
    distrib_run.run(args)
    assert [(tmp_path / f"out{r}").read_text() for r in (0, 1)] == ["2", "2"]


def test_config_from_args_gives_torchs_triple(tmp_path: Path) -> None:
    args = distrib_run.parse_args(
        [
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "h:29400",
            "--rdzv-id",
            "j",
            "-m",
            "pkg",
            "--flag",
        ]
    )
    config, cmd, cmd_args = distrib_run.config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (1, 2, "c10d")
    assert config.run_id == "j" and config.rdzv_endpoint == "h:29400"
    assert cmd == sys.executable and cmd_args == ["-u", "-m", "pkg", "--flag"]


def test_bad_flags_exit_as_argparse_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        distrib_run.parse_args(["--no-such-flag", "x.py"])
    assert caught.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_main_records_its_own_error(
    failing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "launcher-error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(ValueError, match="--nnodes"):
        distrib_run.main(["--nnodes", "3:1", str(failing)])
    assert "ValueError" in json.loads(error_file.read_text())["message"]["message"]


def test_aelastic_run_writes_the_root_cause_to_its_error_file(
    failing: Path, tmp_path: Path
) -> None:
    error_file = tmp_path / "torchx-reads-this.json"
    env = {**cli_env(), "TORCHELASTIC_ERROR_FILE": str(error_file)}
    out = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "--nproc-per-node", "2", str(failing)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    written = json.loads(error_file.read_text())
    assert written["message"]["message"] == "KeyError: 'no such shard on rank 1'"
    assert written["message"]["errorCode"] == 1


def test_the_banner_says_which_rendezvous_runs(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("")
    for flags, shown in [
        ([], "one node, static rendezvous in this process"),
        (["--standalone"], "standalone (the rendezvous runs in this process)"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "aelastic", "run", *flags, str(script)],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert shown in out.stderr


def test_progress_lines_name_the_backend_asked_for(tmp_path: Path) -> None:
    from tests._ports import free_port

    script = tmp_path / "never.py"
    script.write_text("")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aelastic",
            "run",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--rdzv-conf",
            "is_host=false,join_timeout=1.5",
            str(script),
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "c10d at 127.0.0.1:" in out.stderr and "unreachable" in out.stderr
    assert "http at" not in out.stderr
    assert "c10d rendezvous at 127.0.0.1:" in out.stderr  # the banner
