"""Redaction: no password or token survives in text, endpoints, reprs, events or environments."""

from __future__ import annotations

import time

import pytest

from aelastic import RendezvousParameters
from aelastic.agent.api import WorkerState
from aelastic.agent.events import AgentEvent, AgentMetrics, Finished, MembershipChanged, Restart
from aelastic.agent.processes.env import inherited_env
from aelastic.core.events import EventHub
from aelastic.core.redact import (
    SECRET_ENV,
    is_secret_key,
    known_secrets,
    redact,
    redact_config,
    redact_endpoint,
)

SECRET = "S3cret-pw"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"redis://user:{SECRET}@host/0", "redis://user:***@host/0"),
        (f"rediss://:{SECRET}@host:6380/2", "rediss://:***@host:6380/2"),
        (
            f"redis+sentinel://user:{SECRET}@h1:26379,h2:26380/mymaster",
            "redis+sentinel://user:***@h1:26379,h2:26380/mymaster",
        ),
        (f"http://user:{SECRET}@host:29400/prefix", "http://user:***@host:29400/prefix"),
        (f"https://user:{SECRET}@host", "https://user:***@host"),
        # An unescaped @ or / in the password: everything up to the last @ is masked.
        ("redis://user:p@ss/w0rd@host:1/0", "redis://user:***@host:1/0"),
        # Inside a message, a repr, a JSON document.
        (
            f"Redis at redis://u:{SECRET}@h:1/0 could not be reached",
            "Redis at redis://u:***@h:1/0 could not be reached",
        ),
        (f"endpoint='redis://u:{SECRET}@h:1/0', x=1", "endpoint='redis://u:***@h:1/0', x=1"),
        (f'{{"endpoint": "http://u:{SECRET}@h"}}', '{"endpoint": "http://u:***@h"}'),
        # Settings and variables.
        (
            f"join_timeout=5,password={SECRET},token={SECRET},sentinel_password={SECRET}",
            "join_timeout=5,password=***,token=***,sentinel_password=***",
        ),
        (f"AELASTIC_REDIS_PASSWORD={SECRET} x", "AELASTIC_REDIS_PASSWORD=*** x"),
        (f"http://h/x?token={SECRET}&a=1", "http://h/x?token=***&a=1"),
        (f"{{'password': '{SECRET}', 'tls': '1'}}", "{'password': '***', 'tls': '1'}"),
        (f'{{"token": "{SECRET}"}}', '{"token": "***"}'),
        (f"Authorization: Bearer {SECRET}", "Authorization: Bearer ***"),
    ],
)
def test_redact_masks_every_form(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert redact(shown) == shown  # idempotent


@pytest.mark.parametrize(
    "text",
    [
        "redis://127.0.0.1:6379/0",
        "redis://alice@host:6379/0",  # a user name is not a secret
        "rediss://host/0 and http://host:29400/v1/runs/x",
        "rendezvous round 3 complete in 12 ms: 2 nodes",
        "worker rank 1 (local 1, pid 42) failed (exit code 3)",
        "the stored token differs",
        "key_prefix=aelastic,tls=1",
    ],
)
def test_redact_leaves_the_rest_alone(text: str) -> None:
    assert redact(text) == text


def test_known_secrets_are_masked_wherever_they_appear() -> None:
    assert redact(f"oops {SECRET} in text", [SECRET]) == "oops *** in text"
    assert redact("a b", ["a"]) == "a b"  # too short to mask as plain text


def test_redact_endpoint_handles_bare_host_port() -> None:
    assert redact_endpoint(f"user:{SECRET}@host:29400") == "user:***@host:29400"
    assert redact_endpoint("host:29400") == "host:29400"
    assert redact_endpoint(f"redis://user:{SECRET}@host/0") == "redis://user:***@host/0"


def test_secret_keys_and_config() -> None:
    for key in ("password", "token", "sentinel_password", "AELASTIC_HTTP_TOKEN", "api_secret"):
        assert is_secret_key(key)
    for key in ("username", "key_prefix", "join_timeout", "sentinel_username"):
        assert not is_secret_key(key)
    config = {"password": SECRET, "token": SECRET, "username": "u", "tls": "1"}
    assert redact_config(config) == {"password": "***", "token": "***", "username": "u", "tls": "1"}


def test_known_secrets_collects_every_source() -> None:
    found = known_secrets(
        "redis://u:p%40ss@h/0",
        {"password": "from-conf", "key_prefix": "x"},
        {"AELASTIC_HTTP_TOKEN": "from-env", "HOME": "/root"},
    )
    assert found == {"p%40ss", "p@ss", "from-conf", "from-env"}
    assert known_secrets() == frozenset()


def test_rendezvous_parameters_repr_hides_the_password() -> None:
    params = RendezvousParameters(
        "redis", f"redis://u:{SECRET}@h:1/0", "job", 1, 2, password=SECRET
    )
    assert SECRET not in repr(params)
    assert "redis://u:***@h:1/0" in repr(params)


def test_backend_reprs_hide_the_password() -> None:
    from aelastic.backends.memory import MemoryBackend
    from aelastic.backends.registry import create_backend

    pytest.importorskip("redis")
    pytest.importorskip("aiohttp")
    for endpoint, backend in (
        (f"redis://u:{SECRET}@127.0.0.1:1/0", "redis"),
        (f"http://u:{SECRET}@127.0.0.1:1", "http"),
    ):
        params = RendezvousParameters(backend, endpoint, "job", 1, 1, token=SECRET)
        created = create_backend(params)
        assert SECRET not in repr(created) and SECRET not in created.endpoint
    assert SECRET not in repr(MemoryBackend("job", f"redis://u:{SECRET}@h"))


def test_event_data_is_redacted_for_every_subscriber() -> None:
    hub = EventHub()
    seen: list[AgentEvent] = []
    hub.add_listener(seen.append)
    reason = f"rendezvous failed: Redis at redis://u:{SECRET}@h:1/0 is gone (password={SECRET})"
    event = Restart(
        at=time.time(),
        role="default",
        run_id="job",
        state=WorkerState.HEALTHY,
        reason=reason,
        spent=False,
    )
    hub.emit(event)
    hub.emit(MembershipChanged(run_id="job", lost=(f"http://a:{SECRET}@b",), lost_count=1))
    assert len(seen) == 2
    assert SECRET not in repr(seen)
    assert seen[0].data["reason"].startswith("rendezvous failed: Redis at redis://u:***@h:1/0")
    assert AgentMetrics().updated(seen[0]).rescales == 1  # metrics still see the event
    plain = Finished(run_id="job", role="default", state=WorkerState.SUCCEEDED)
    hub.emit(plain)
    assert seen[2] is plain  # nothing to hide: the same object


def test_workers_inherit_no_credential() -> None:
    parent = {name: SECRET for name in SECRET_ENV}
    parent.update(
        AELASTIC_REDIS_USERNAME="alice",
        AELASTIC_ETCD_USERNAME="bob",
        AELASTIC_ETCD_PASSWORD=SECRET,
        AELASTIC_ETCD_TOKEN=SECRET,
        AELASTIC_TEST_HUB="/tmp/hub",  # not a credential
        PET_RDZV_ENDPOINT=f"rediss://alice:{SECRET}@redis-host:6379/0",
        PET_RDZV_CONF=f"join_timeout=60,password={SECRET}",
        HOME="/root",
    )
    assert inherited_env(parent) == {
        "AELASTIC_TEST_HUB": "/tmp/hub",
        "PET_RDZV_ENDPOINT": "rediss://alice:***@redis-host:6379/0",
        "PET_RDZV_CONF": "join_timeout=60,password=***",
        "HOME": "/root",
    }
    bare = inherited_env({"PET_RDZV_ENDPOINT": f"alice:{SECRET}@host:29400"})
    assert bare == {"PET_RDZV_ENDPOINT": "alice:***@host:29400"}
    assert {
        "AELASTIC_REDIS_PASSWORD",
        "AELASTIC_REDIS_SENTINEL_PASSWORD",
        "AELASTIC_HTTP_TOKEN",
    } <= SECRET_ENV


def test_worker_and_standby_environments_drop_credentials() -> None:
    import sys

    from aelastic.agent import Worker, WorkerGroup, WorkerSpec
    from aelastic.agent.health.progress import BOOTSTRAP_DIR
    from aelastic.agent.processes.env import worker_env
    from aelastic.agent.processes.standby import standby_env
    from aelastic.rendezvous import create_handler

    handler = create_handler(RendezvousParameters("memory", "redact-tests", "run", 1, 1))
    spec = WorkerSpec("t", 1, handler, sys.executable, ("x.py",))
    group = WorkerGroup(spec)
    group.group_rank, group.group_world_size = 0, 1
    group.master_addr, group.master_port = "node0", 29500
    group.workers = [Worker(0, 0, 0, 1, 1)]
    parent = {name: SECRET for name in SECRET_ENV} | {"PATH": "/bin"}
    env = worker_env(
        group, group.workers[0], restart_count=0, run_id="run", error_file="", base=parent
    )
    assert not SECRET_ENV & set(env) and env["PATH"] == "/bin"
    bootstrap = {"PYTHONPATH": BOOTSTRAP_DIR}  # aelastic's worker bootstrap, no secret
    assert standby_env(spec, parent) == {"PATH": "/bin", **bootstrap}


def test_a_secret_on_the_command_line_is_warned_about_naming_its_variable() -> None:
    from aelastic.backends.registry import secret_variables
    from aelastic.core.redact import exposed_secrets

    url = "redis://default:Pw-secret-1@h:6379/0"
    redis = secret_variables("redis")
    argv = ["aelastic", "run", f"--rdzv-endpoint={url}", "--rdzv-conf", "sentinel_password=S3nt"]
    conf = {"sentinel_password": "S3nt", "key_prefix": "job"}
    first, second = exposed_secrets(url, conf, argv, redis)
    assert first.startswith("the password in --rdzv-endpoint is on the command line, which")
    assert "set AELASTIC_REDIS_PASSWORD in the environment instead and leave the password" in first
    assert "(or give the whole option in PET_RDZV_ENDPOINT)" in first
    assert second.startswith("the sentinel_password in --rdzv-conf is on the command line")
    assert "set AELASTIC_REDIS_SENTINEL_PASSWORD in the environment" in second
    assert not any("Pw-secret-1" in x or "S3nt" in x for x in (first, second))
    # Given in the environment (PET_RDZV_ENDPOINT, PET_RDZV_CONF): not on the command line.
    assert exposed_secrets(url, conf, ["aelastic", "run", "train.py"], redis) == []
    # The hosted backends and the HTTP server's token; a backend aelastic does not know.
    [token] = exposed_secrets("h:29400", {"token": "T0k"}, ["--rdzv-conf=token=T0k"], {})
    assert token.endswith("give the option in the environment instead (PET_RDZV_CONF)")
    for name in ("c10d", "static", "http"):
        [line] = exposed_secrets("h:1", {"token": "T0k"}, ["token=T0k"], secret_variables(name))
        assert "set AELASTIC_HTTP_TOKEN in the environment instead" in line
    assert exposed_secrets("h:1", {"token": ""}, ["token="], secret_variables("http")) == []


def test_each_backends_secret_variable_is_the_one_it_reads() -> None:
    from aelastic.backends.etcd._endpoint import ENV_PASSWORD as ETCD
    from aelastic.backends.http.wire import TOKEN_ENV
    from aelastic.backends.redis._endpoint import ENV_PASSWORD, ENV_SENTINEL_PASSWORD
    from aelastic.backends.registry import BUILTINS
    from aelastic.core.redact import SECRET_ENV

    expected = {
        "redis": {
            "endpoint": ENV_PASSWORD,
            "password": ENV_PASSWORD,
            "sentinel_password": ENV_SENTINEL_PASSWORD,
        },
        "http": {"endpoint": TOKEN_ENV, "token": TOKEN_ENV},
        "c10d": {"token": TOKEN_ENV},
        "static": {"token": TOKEN_ENV},
        "etcd": {"endpoint": ETCD},
    }
    for info in BUILTINS:
        variables = dict(info.secret_env)
        assert set(variables.values()) <= SECRET_ENV, info.name
        assert expected.get(info.name, {}).items() <= variables.items(), info.name
        for key in variables:  # the endpoint, a key it has (etcd: keys it refuses)
            assert key == "endpoint" or key in info.config_keys or info.name == "etcd", key
