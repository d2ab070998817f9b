"""Secrets in the CLI: a real job against a real password-protected redis-server.

The password is given in the endpoint URL, and credentials sit in the launcher's
environment. Nothing the launcher, ``aelastic status`` or the agent's events show may
contain one, and no worker (cold, or started from a warm standby) may inherit one: the
workers print their whole environment, and the standbys' start environment, to the console.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._proc import Cli, run_cli

pytest.importorskip("redis")

from tests._redis_server import RedisServer

PASSWORD = "Pw-4f9d2c-s3cret"
TOKEN = "Tok-77a1e0-s3cret"
SENTINEL = "Sen-0b3c5e-s3cret"
SECRETS = (PASSWORD, TOKEN, SENTINEL)
SECRET_ENV = {
    "AELASTIC_REDIS_PASSWORD": PASSWORD,
    "AELASTIC_HTTP_TOKEN": TOKEN,
    "AELASTIC_REDIS_SENTINEL_PASSWORD": SENTINEL,
}

# Prints its environment and how it was started; the first attempt waits for the warm
# standby of the next one, prints that standby's start environment, and fails, so the
# second attempt starts from the standby. The second attempt sleeps until stopped.
WORKER = r"""
import json, os, sys, time

def environ_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as fp:
        return [e.decode(errors="replace") for e in fp.read().split(b"\0") if e]

def standbys():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fp:
                ppid = int(fp.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fp:
                cmdline = fp.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getppid() and b"_standby.py" in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found

with open("/proc/self/cmdline", "rb") as fp:
    warm = b"_standby.py" in fp.read()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
report = {"restart": restart, "warm": warm, "env": dict(os.environ),
          "start_env": environ_of("self")}
os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
if restart == "0":
    deadline = time.monotonic() + 30
    while not (pids := standbys()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        os.write(1, ("STANDBY " + json.dumps(environ_of(pid)) + "\n").encode())
    sys.exit(3)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as srv:
        yield srv


def _url(server: RedisServer, password: str = PASSWORD) -> str:
    return f"redis://default:{password}@127.0.0.1:{server.port}/0"


def _status(tmp_path: Path, endpoint: str, run_id: str, *extra: str) -> tuple[int, str]:
    args = ["status", "--rdzv-backend", "redis", "--rdzv-endpoint", endpoint]
    return run_cli([*args, "--rdzv-id", run_id, *extra], tmp_path, env=SECRET_ENV)


@contextlib.contextmanager
def _stopped_at_the_end(node: Cli) -> Iterator[None]:
    """Stop the launcher with SIGTERM if the test fails, so that its workers go too (they
    hold the output pipe open, and a SIGKILL of the launcher alone would leave them)."""
    try:
        yield
    finally:
        if node.proc.poll() is None:
            node.signal(signal.SIGTERM)
            node.wait(60)


def _warned(what: str, variable: str, text: str) -> bool:
    return any(
        line.startswith(f"aelastic status: warning: {what} is on the command line")
        and f"set {variable} in the environment instead" in line
        for line in text.splitlines()
    )


def _assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shown in:\n{text}"


@pytest.mark.timeout(300)
def test_a_job_shows_no_secret_and_workers_inherit_none(
    server: RedisServer, tmp_path: Path, run_id: str
) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    # The endpoint with its password comes in PET_RDZV_ENDPOINT (as a Kubeflow pod's would);
    # an etcd password too (any backend's AELASTIC_*_PASSWORD is kept from the workers).
    env = {
        **SECRET_ENV,
        "AELASTIC_REDIS_USERNAME": "default",
        "AELASTIC_ETCD_PASSWORD": PASSWORD,
        "PET_RDZV_ENDPOINT": _url(server),
    }
    args = [
        "run",
        "--rdzv-backend=redis",
        f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",
        "--max-restarts=1",
        "-v",  # info logs too: they must be clean as well
        "worker.py",
    ]
    with Cli(args, tmp_path, env=env) as node, _stopped_at_the_end(node):
        node.wait_for(lambda lines: any('"restart": "1"' in line for line in lines), 90)

        # aelastic status, text and JSON, with the password in the URL or in --rdzv-conf.
        # The password on status's command line is warned about, naming the variable.
        code, out = _status(tmp_path, _url(server), run_id)
        assert code == 0, out
        assert re.search(rf"job '{run_id}': round \d+, complete", out), out
        assert _warned("the password in --rdzv-endpoint", "AELASTIC_REDIS_PASSWORD", out)
        _assert_no_secret(out)
        code, out = _status(tmp_path, _url(server), run_id, "--json")
        assert code == 0, out
        document = "\n".join(x for x in out.splitlines() if not x.startswith("aelastic status:"))
        assert [p["rank"] for p in json.loads(document)["participants"]] == [0]
        _assert_no_secret(out)
        plain = f"redis://127.0.0.1:{server.port}/0"
        code, out = _status(tmp_path, plain, run_id, "--rdzv-conf", f"password={PASSWORD}")
        assert code == 0, out
        assert _warned("the password in --rdzv-conf", "AELASTIC_REDIS_PASSWORD", out)
        _assert_no_secret(out)
        # An error message: a wrong password is not shown either.
        wrong = "Wr0ng-9e8d7c-pw"
        code, out = _status(tmp_path, _url(server, wrong), run_id)
        assert code == 1 and "Authentication" in out, out
        assert wrong not in out and "Traceback" not in out, out

        node.signal(signal.SIGTERM)
        assert node.wait(60) == 1, node.output

    out = node.output
    _assert_no_secret(out)
    assert "on the command line" not in out  # the endpoint came in PET_RDZV_ENDPOINT
    assert f"redis rendezvous at redis://default:***@127.0.0.1:{server.port}/0" in out
    assert "restarting the workers" in out

    reports = [json.loads(line.split(" ", 1)[1]) for line in node.lines if "REPORT {" in line]
    assert [r["restart"] for r in reports] == ["0", "1"], out
    assert reports[1]["warm"], "the restarted worker did not start from its warm standby"
    standby_envs = [json.loads(line.split(" ", 1)[1]) for line in node.lines if "STANDBY [" in line]
    assert standby_envs, out
    for report in reports:
        assert not set(SECRET_ENV) & set(report["env"]), report["env"]
        assert "AELASTIC_REDIS_USERNAME" not in report["env"]  # half a login: not needed
        assert "AELASTIC_ETCD_PASSWORD" not in report["env"]
        masked = f"redis://default:***@127.0.0.1:{server.port}/0"
        assert report["env"]["PET_RDZV_ENDPOINT"] == masked
        start_names = {entry.split("=", 1)[0] for entry in report["start_env"]}
        assert not set(SECRET_ENV) & start_names
    for start_env in standby_envs:
        assert not set(SECRET_ENV) & {entry.split("=", 1)[0] for entry in start_env}


@pytest.mark.anyio
async def test_agent_events_and_metrics_show_no_secret(
    server: RedisServer, tmp_path: Path, run_id: str
) -> None:
    from aelastic.agent import ElasticAgent
    from aelastic.agent.events import AgentEvent
    from aelastic.cli.launch import build_spec
    from aelastic.cli.options import parse_config

    script = tmp_path / "fail_once.py"
    script.write_text(
        "import os, sys\nsys.exit(3 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"
    )
    config = parse_config(
        [
            "--rdzv-backend=redis",
            f"--rdzv-endpoint={_url(server)}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf=password={PASSWORD}",
            "--local-addr=127.0.0.1",
            "--max-restarts=1",
            "--no-warm-standby",
            str(script),
        ]
    )
    _assert_no_secret(repr(config))
    spec = build_spec(config)
    agent = ElasticAgent(spec)
    events: list[AgentEvent] = []
    agent.add_listener(events.append)
    try:
        result = await agent.run()
    finally:
        await spec.rdzv_handler.aclose()
    assert not result.is_failed()
    assert {e.kind.value for e in events} >= {"rendezvous", "restart", "finished"}
    _assert_no_secret(repr(events))
    _assert_no_secret(repr(agent.metrics))
    _assert_no_secret(repr(spec))


def test_a_usage_error_shows_no_secret(tmp_path: Path) -> None:
    endpoint = f"redis://u:{PASSWORD}@h:99999/0"
    args = ["run", "--rdzv-backend", "redis", "--rdzv-endpoint", endpoint, "--rdzv-id", "x"]
    code, out = run_cli([*args, "w.py"], tmp_path)
    assert code == 2, out
    assert "error" in out and "Traceback" not in out
    _assert_no_secret(out)


def test_a_bad_http_endpoint_shows_no_secret(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    endpoint = f"ftp://u:{TOKEN}@h:1/"
    args = ["run", "--rdzv-backend", "http", "--rdzv-endpoint", endpoint, "--rdzv-id", "x"]
    code, out = run_cli([*args, "w.py"], tmp_path)
    assert code == 2, out
    assert "http://" in out and "Traceback" not in out
    _assert_no_secret(out)


# Works until the file "go" exists.
UNTIL_GO = """
import os, time
while not os.path.exists("go"):
    time.sleep(0.05)
"""


def _get_runs(port: int, token: str | None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/runs")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.parametrize("given", ["command line", "environment"])
def test_a_hosted_token_on_the_command_line_is_warned_about_the_environments_is_taken(
    tmp_path: Path, run_id: str, given: str
) -> None:
    """torch's c10d rendezvous, hosted by the node: its token given as ``--rdzv-conf
    token=...`` (which ``ps`` shows every user) is warned about, naming AELASTIC_HTTP_TOKEN;
    given in that variable, it is not, and the hosted server requires it all the same."""
    pytest.importorskip("aiohttp")
    from tests._ports import free_port

    (tmp_path / "train.py").write_text(textwrap.dedent(UNTIL_GO))
    port = free_port()
    args = ["run", "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    args += [f"--rdzv-id={run_id}", "train.py"]
    env = {}
    if given == "command line":
        args.insert(1, f"--rdzv-conf=token={TOKEN}")
    else:
        env["AELASTIC_HTTP_TOKEN"] = TOKEN
    with Cli(args, tmp_path, env=env) as node, _stopped_at_the_end(node):
        node.wait_for(lambda lines: any("started 1 worker" in x for x in lines), 60)
        assert _get_runs(port, None) == 401
        assert _get_runs(port, "not-" + TOKEN) == 401
        assert _get_runs(port, TOKEN) == 200
        (tmp_path / "go").touch()
        assert node.wait(60) == 0, node.output
    warned = [x for x in node.lines if "is on the command line" in x]
    if given == "command line":
        [line] = warned
        assert "warning: the token in --rdzv-conf is on the command line, which every user" in line
        assert "set AELASTIC_HTTP_TOKEN in the environment instead" in line
    else:
        assert not warned, node.output
    _assert_no_secret(node.output)
