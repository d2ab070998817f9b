"""`aelastic run` flags: torchrun's names, meanings, defaults and PET_* fallbacks."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from aelastic.cli.options import (
    LaunchConfig,
    UsageError,
    build_parser,
    config_from_args,
    parse_config,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
)


@pytest.fixture(autouse=True)
def _no_pet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("PET_") or name in ("OMP_NUM_THREADS", "PYTHON_EXEC"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)


def _config(*argv: str) -> LaunchConfig:
    args = build_parser().parse_args(list(argv))
    return config_from_args(args, nproc_resolver=lambda v: (int(v) if v.isdigit() else 3, "cpu"))


def test_defaults_are_torchruns() -> None:
    config = _config("train.py")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 1)
    assert config.standalone  # torchrun: static + one node -> a local rendezvous
    assert config.rdzv_backend == "memory"
    assert config.max_restarts == 0
    assert config.monitor_interval == 0.1
    assert config.role == "default"
    assert config.redirects == "0" and config.tee == "0"
    assert config.local_ranks_filter is None
    assert config.stop_grace_period == 30.0
    assert config.signals == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    assert config.entrypoint == sys.executable
    assert config.args == ("-u", "train.py")
    assert dict(config.env).keys() == {"TORCHELASTIC_SIGNALS_TO_HANDLE"}


def test_torch_parser_agrees_on_the_shared_defaults() -> None:
    from torch.distributed.run import get_args_parser

    torch_args = get_args_parser().parse_args(["x.py"])
    ours = build_parser().parse_args(["x.py"])
    for name in (
        "nnodes",
        "nproc_per_node",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "standalone",
        "max_restarts",
        "monitor_interval",
        "role",
        "module",
        "no_python",
        "run_path",
        "log_dir",
        "redirects",
        "tee",
        "local_ranks_filter",
        "node_rank",
        "local_addr",
        "signals_to_handle",
        "shutdown_timeout",
        "start_method",
    ):
        assert getattr(ours, name) == getattr(torch_args, name), name


def test_every_flag() -> None:
    config = _config(
        "--nnodes=2:4",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "aelastic-redis",
        "--rdzv-endpoint",
        "redis://h:6379/0",
        "--rdzv-id",
        "job7",
        "--rdzv-conf",
        "join_timeout=30, last_call_timeout=2",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        "--role",
        "trainer",
        "--log-dir",
        "/tmp/logs",
        "-r",
        "0:1,1:2",
        "-t",
        "3",
        "--local-ranks-filter",
        "0,1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29600",
        "--local-addr",
        "10.0.0.2",
        "--shutdown-timeout",
        "5",
        "--signals-to-handle",
        "SIGTERM,USR1",
        "--exit-barrier-timeout",
        "60",
        "-m",
        "pkg.train",
        "--lr",
        "0.1",
    )
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 4, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == (
        "redis",
        "redis://h:6379/0",
        "job7",
    )
    assert config.rdzv_configs == {"join_timeout": "30", "last_call_timeout": "2"}
    assert not config.standalone
    assert config.max_restarts == 3 and config.monitor_interval == 0.5
    assert config.role == "trainer" and config.log_dir == "/tmp/logs"
    assert config.redirects == "0:1,1:2" and config.tee == "3"
    assert config.local_ranks_filter == frozenset({0, 1})
    assert (config.master_addr, config.master_port, config.local_addr) == (
        "10.0.0.1",
        29600,
        "10.0.0.2",
    )
    assert config.stop_grace_period == 5.0 and config.exit_barrier_timeout == 60.0
    assert config.signals == (signal.SIGTERM, signal.SIGUSR1)
    assert config.args == ("-u", "-m", "pkg.train", "--lr", "0.1")
    assert dict(config.env).keys() == {"OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE"}


def test_pet_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "1:3")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_RDZV_BACKEND", "http")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "h:29400")
    monkeypatch.setenv("PET_RDZV_ID", "envjob")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_NO_PYTHON", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    config = _config("/bin/echo", "hi")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 3, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == (
        "http",
        "h:29400",
        "envjob",
    )
    assert config.max_restarts == 2
    assert (config.entrypoint, config.args) == ("/bin/echo", ("hi",))
    assert "OMP_NUM_THREADS" not in config.env  # set by the user: left alone


def test_command_line_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_STANDALONE", "0")
    config = _config("--max-restarts", "5", "--standalone", "x.py")
    assert config.max_restarts == 5 and config.standalone


def test_standalone_ignores_rendezvous_flags() -> None:
    config = _config(
        "--standalone", "--rdzv-backend", "redis", "--rdzv-endpoint", "redis://x", "x.py"
    )
    assert config.rdzv_backend == "memory" and config.standalone
    assert config.run_id.startswith("standalone-")
    assert config.warnings


def test_run_path_and_no_python() -> None:
    config = _config("--run-path", "/abs/train.py", "a")
    assert config.entrypoint == sys.executable
    assert config.args[-2:] == ("/abs/train.py", "a")
    config = _config("--no-python", "./run.sh", "--x")
    assert (config.entrypoint, config.args) == ("./run.sh", ("--x",))


def test_python_exec_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py/bin/python")
    assert _config("x.py").entrypoint == "/opt/py/bin/python"


def test_script_arguments_are_not_parsed() -> None:
    config = _config("x.py", "--nnodes", "9", "-m")
    assert config.args == ("-u", "x.py", "--nnodes", "9", "-m")
    assert config.max_nodes == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "0:2", "x.py"], "0 < MIN <= MAX"),
        (["--nnodes", "3:2", "x.py"], "0 < MIN <= MAX"),
        (["--nnodes", "a:b", "x.py"], "not N or MIN:MAX"),
        (["--nnodes", "1:2:3", "x.py"], "not N or MIN:MAX"),
        (["--max-restarts", "-1", "x.py"], "max-restarts"),
        (["--max-restarts", "many", "x.py"], "invalid int"),
        (["--monitor-interval", "0", "x.py"], "monitor-interval"),
        (["--rdzv-backend", "etcd", "--nnodes", "2", "x.py"], "needs --rdzv-endpoint"),
        (["--rdzv-backend", "etcd-v2", "x.py"], "needs --rdzv-endpoint"),
        (["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1", "x.py"], "unknown"),
        (["--rdzv-backend", "redis", "x.py"], "needs --rdzv-endpoint"),
        (["--nnodes", "2:3", "x.py"], "static rendezvous needs a fixed number"),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "not in"),
        (["--nnodes", "2", "--rdzv-backend", "memory", "x.py"], "cannot wait for other nodes"),
        (["--rdzv-conf", "a=1,b", "--standalone", "x.py"], "must have a value"),
        (["--rdzv-conf", "=1", "--standalone", "x.py"], "key1=value1"),
        (["-r", "7", "x.py"], "--redirects"),
        (["-t", "0:9", "x.py"], "--tee"),
        (["--local-ranks-filter", "0,a", "x.py"], "comma-separated"),
        (["--master-port", "70000", "x.py"], "port"),
        (["--signals-to-handle", "SIGNOPE", "x.py"], "unknown signal"),
        (["--signals-to-handle", "SIGKILL", "x.py"], "cannot be handled"),
        (["--no-python", "-m", "x"], "--no-python"),
        (["--run-path", "rel.py"], "absolute"),
        (["--unknown-flag", "x.py"], "unrecognized"),
        ([], "no training script"),
        (["--shutdown-timeout", "-1", "x.py"], ">= 0"),
    ],
)
def test_bad_flags(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        _config(*argv)
    assert "\n" not in str(info.value)


def test_bad_pet_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "x")
    with pytest.raises(UsageError, match="PET_MAX_RESTARTS"):
        build_parser()
    monkeypatch.delenv("PET_MAX_RESTARTS")
    monkeypatch.setenv("PET_STANDALONE", "yes")
    with pytest.raises(UsageError, match="PET_STANDALONE"):
        build_parser()


def test_nproc_resolution_errors_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="Unsupported nproc_per_node"):
        parse_config(["--nproc-per-node", "lots", "x.py"])


def test_helpers() -> None:
    assert parse_nnodes("3") == (3, 3)
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf("a = 1 ,b=x=y") == {"a": "1", "b": "x=y"}
    assert parse_signals("term,SIGINT,SIGTERM") == (signal.SIGTERM, signal.SIGINT)


def test_warm_standby_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config("train.py").warm_standby is True
    assert _config("--no-warm-standby", "train.py").warm_standby is False
    monkeypatch.setenv("PET_NO_WARM_STANDBY", "1")
    assert _config("train.py").warm_standby is False


def test_fixed_nodes_with_a_master_is_torchruns_static_rendezvous() -> None:
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--master-port", "1234"]
    config = parse_config([*argv, "x.py"])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "h:1234")
    assert dict(config.rdzv_configs)["rank"] == "1"
    # The master port serves the rendezvous: the workers' store gets another port.
    assert config.master_addr == "h" and config.master_port is None
    assert not config.standalone


def test_c10d_is_accepted_as_torchs() -> None:
    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--nnodes", "1:4", "x.py"]
    config = parse_config(argv)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "h:29400")
    assert (config.min_nodes, config.max_nodes) == (1, 4)


def test_every_torchrun_flag_is_accepted() -> None:
    torch_run = pytest.importorskip("torch.distributed.run")
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    theirs = {o for a in torch_run.get_args_parser()._actions for o in a.option_strings}
    assert theirs <= ours, sorted(theirs - ours)


def test_torchrun_only_flags_are_checked_and_applied() -> None:
    config = parse_config(["--logs-specs", "default", "--numa-binding", "node", "x.py"])
    assert config.numa_binding == "node" and not config.warnings
    assert parse_config(["x.py"]).numa_binding is None
    with pytest.raises(UsageError, match=r"torchrun\.logs_specs"):
        parse_config(["--logs-specs", "nope", "x.py"])
    with pytest.raises(UsageError, match="numa-binding must be one of"):
        parse_config(["--numa-binding", "nope", "x.py"])


def test_long_flags_abbreviate_as_torchruns() -> None:
    assert parse_config(["--max-rest", "3", "--monitor-int", "0.5", "x.py"]).max_restarts == 3


def test_workers_are_told_the_signals_handled_as_torchruns() -> None:
    config = parse_config(["--signals-to-handle", "SIGTERM,SIGUSR1", "x.py"])
    assert dict(config.env)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
    assert dict(parse_config(["x.py"]).env)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == (
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    )


@pytest.mark.parametrize(
    ("text", "filters"),
    [("", ()), ("apple", ("apple",)), ("apple,orange", ("apple", "orange")), ("a,,b", ("a,b",))],
)
def test_duplicate_filters_follow_torchruns_list_syntax(
    text: str, filters: tuple[str, ...]
) -> None:
    config = parse_config(["--tee", "3", "--duplicate-stdout-filters", text, "x.py"])
    assert config.duplicate_stdout_filters == filters
    assert config.duplicate_stderr_filters == ()
    assert not config.warnings


def test_duplicate_filters_of_a_stream_not_teed_are_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PET_DUPLICATE_STDERR_FILTERS", "boom")
    config = parse_config(["--tee", "1", "x.py"])
    assert config.duplicate_stderr_filters == ("boom",)
    assert [w for w in config.warnings if "--duplicate-stderr-filters" in w], config.warnings
    assert not [w for w in config.warnings if "stdout" in w]


def _doc_table(title: str) -> list[list[str]]:
    text = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    section = text.split(title, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_docs_table_lists_every_torchrun_flag_with_its_pet_variable() -> None:
    torch_run = pytest.importorskip("torch.distributed.run")
    rows = _doc_table("### torchrun's flags, one by one")
    documented = {flag: row[1] for row in rows for flag in re.findall(r"`(-[-\w]+)", row[0])}
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    assert set(documented) <= ours | {"-h", "--help"}
    for action in torch_run.get_args_parser()._actions:
        names = [o for o in action.option_strings if "_" not in o]
        if not names:
            continue
        for name in names:
            assert name in documented, name
        # torchrun's env actions read PET_<DEST>; the others read nothing.
        reads_env = type(action).__name__ in ("env", "check_env")
        expected = f"`PET_{action.dest.upper()}`" if reads_env else ""
        if name not in ("-h", "--help"):
            assert (expected or "(none") in documented[names[-1]], (name, documented[names[-1]])


@pytest.mark.parametrize("name", ["etcd", "etcd-v2", "aelastic-etcd"])
def test_torch_etcd_names_mean_the_etcd_backend(name: str) -> None:
    """torch's etcd names (Kubeflow's PyTorchJob admits etcd and etcd-v2) run on etcd's v3 API."""
    config = _config("--nnodes", "1:2", "--rdzv-backend", name, "--rdzv-endpoint", "e:2379", "x.py")
    assert config.rdzv_backend == "etcd"
    assert config.rdzv_endpoint == "e:2379"
