"""The Redis backend against a real redis-server: protocol, credentials, faults, scale."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest

from aelastic import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousStateError,
)
from aelastic.backends import RendezvousBackend, _shared
from aelastic.backends.redis import (
    ENV_PASSWORD,
    ENV_USERNAME,
    RedisBackend,
    _lua,
    _scripts,
    create_backend,
    parse_endpoint,
)
from aelastic.backends.redis._servers import Standalone
from aelastic.core.health import NodeReport
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request
from aelastic.rendezvous import DynamicRendezvousHandler, RendezvousInfo
from aelastic.store import Store
from tests._redis_server import RedisServer, free_port, redis_server_fixture
from tests._rendezvous_helpers import PROMPT, SECRET, assert_one_group, eventually, handler_group
from tests._rendezvous_helpers import join_all as join_all_within

pytestmark = pytest.mark.anyio

PASSWORD = "s3cret-pa55"
RULES = Rules(2, 3, last_call_ms=60_000, window_ms=60_000)

server = redis_server_fixture()
auth_server = redis_server_fixture(password=PASSWORD)


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server of this test alone (fault tests stop, kill and restart it)."""
    with RedisServer() as srv:
        yield srv


@asynccontextmanager
async def backend(url: str, run_id: str, **conf: Any) -> AsyncIterator[RedisBackend]:
    b = create_backend(RendezvousParameters("redis", url, run_id, 1, 1, **conf))
    try:
        yield b
    finally:
        await b.aclose()


def group(
    url: str, run_id: str, count: int, min_nodes: int, max_nodes: int, **conf: Any
) -> AbstractAsyncContextManager[list[DynamicRendezvousHandler]]:
    return handler_group(
        "redis", url, run_id, count, min_nodes, max_nodes, **{"join_timeout": 60, **conf}
    )


async def join_all(handlers: list[DynamicRendezvousHandler]) -> list[RendezvousInfo[Store]]:
    return await join_all_within(handlers, 3 * PROMPT)


# -- endpoints and credentials --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ("localhost", 6379, 0, False, None, None)),
        ("myhost", ("myhost", 6379, 0, False, None, None)),
        ("myhost:7000", ("myhost", 7000, 0, False, None, None)),
        ("[::1]:7001", ("::1", 7001, 0, False, None, None)),
        ("redis://myhost", ("myhost", 6379, 0, False, None, None)),
        ("redis://myhost:7002/3", ("myhost", 7002, 3, False, None, None)),
        ("redis://:pw@myhost", ("myhost", 6379, 0, False, None, "pw")),
        ("redis://alice:p%40ss@myhost:1/2", ("myhost", 1, 2, False, "alice", "p@ss")),
        ("rediss://bob:x@[fe80::1]:6380/0", ("fe80::1", 6380, 0, True, "bob", "x")),
        ("REDIS://MyHost:9", ("MyHost", 9, 0, False, None, None)),
    ],
)
def test_endpoint_forms(text: str, expected: tuple[Any, ...]) -> None:
    e = parse_endpoint(text, environ={})
    assert (e.host, e.port, e.db, e.tls, e.username, e.password) == expected
    assert e.password is None or e.password not in e.display
    assert e.password is None or e.password not in repr(e)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("myhost:0", "port"),
        ("http://myhost", "scheme"),
        ("unix:///tmp/redis.sock", "scheme"),
        ("redis://:6379", "host is missing"),
        ("redis://myhost/x", "database"),
        ("redis://myhost/1/2", "database"),
        ("redis://myhost?db=1", "query"),
        ("redis://[::1", "IPv6"),
        ("::1:6379", "brackets"),
        ("user:secret-word@myhost:1", "bare host"),
        ("redis://my host", "white space"),
    ],
)
def test_bad_endpoints_are_value_errors_that_hide_passwords(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        parse_endpoint(text, environ={})
    assert "secret-word" not in str(info.value)
    assert "redis://" in str(info.value)  # says what is expected


@pytest.mark.parametrize("text", ["myhost:", "myhost:abc", "myhost:65536", "my host", "~"])
def test_bad_bare_endpoints_get_torchs_messages(text: str) -> None:
    with pytest.raises(ValueError, match="of the rendezvous endpoint"):
        parse_endpoint(text, environ={})


def test_credentials_precedence_config_then_url_then_environment() -> None:
    env = {ENV_USERNAME: "env-user", ENV_PASSWORD: "env-pw"}
    assert parse_endpoint("h", environ=env).password == "env-pw"
    assert parse_endpoint("h", environ=env).username == "env-user"
    assert parse_endpoint("redis://u:url-pw@h", environ=env).password == "url-pw"
    picked = parse_endpoint("redis://u:url-pw@h", {"password": "cfg-pw"}, env)
    assert (picked.username, picked.password) == ("u", "cfg-pw")
    assert parse_endpoint("h", {"username": "cfg-user"}, env).username == "cfg-user"


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        parse_endpoint("h", {"ssl_cert_reqs": "maybe"}, {})
    with pytest.raises(ValueError, match="tls"):
        parse_endpoint("h", {"tls": "sometimes"}, {})
    with pytest.raises(ValueError, match="read_timeout"):
        create_backend(RendezvousParameters("redis", "h", "r", 1, 1, read_timeout=0))
    with pytest.raises(ValueError, match="key_ttl"):
        create_backend(RendezvousParameters("redis", "h", "r", 1, 1, key_ttl=-1))
    assert parse_endpoint("h", {"tls": "yes"}, {}).tls


def test_endpoint_property_never_shows_the_password() -> None:
    b = create_backend(
        RendezvousParameters("redis", "redis://alice:hunter2@myhost:7000/1", "r", 1, 1)
    )
    assert b.endpoint == "redis://alice@myhost:7000/1"
    assert "hunter2" not in repr(b)
    assert isinstance(b, RendezvousBackend)


async def test_password_from_config_url_or_environment_is_accepted(
    auth_server: RedisServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with backend(auth_server.url, run_id, password=PASSWORD) as b:
        await b.kv_set("x", b"x")
    url_with_password = f"redis://:{PASSWORD}@127.0.0.1:{auth_server.port}/0"
    async with backend(url_with_password, run_id) as b:
        assert await b.kv_get(["x"]) == [b"x"]
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
    async with backend(auth_server.url, run_id) as b:
        assert await b.kv_get(["x"]) == [b"x"]


@pytest.mark.parametrize("password", [None, "wrong-password"])
async def test_wrong_or_missing_password_fails_at_once_saying_auth_failed(
    auth_server: RedisServer, run_id: str, password: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_PASSWORD, raising=False)
    conf = {} if password is None else {"password": password}
    async with backend(auth_server.url, run_id, read_timeout=30, **conf) as b:
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="Authentication") as info:
            await b.snapshot()
        assert time.monotonic() - start < PROMPT  # not retried until read_timeout
    assert f"127.0.0.1:{auth_server.port}" in str(info.value)
    assert "wrong-password" not in str(info.value)


async def test_acl_user_from_config_with_password_from_environment(
    auth_server: RedisServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with auth_server.client() as client:
        client.acl_setuser(
            "alice",
            enabled=True,
            passwords=["+alice-pw"],
            categories=["+@all"],
            keys=["aelastic:*"],
            channels=["aelastic:*"],
        )
        for name, keys, channels in (("bob", ["other:*"], ["*"]), ("carol", ["*"], ["x"])):
            client.acl_setuser(
                name,
                enabled=True,
                passwords=[f"+{name}-pw"],
                categories=["+@all"],
                keys=keys,
                channels=channels,
                reset_channels=True,
            )
    monkeypatch.setenv(ENV_PASSWORD, "alice-pw")
    async with group(auth_server.url, run_id, 2, 2, 2, username="alice") as g:
        assert_one_group(await join_all(g), 2)
    monkeypatch.setenv(ENV_PASSWORD, "bob-pw")  # bob may not touch the run's keys
    async with backend(auth_server.url, run_id, username="bob") as b:
        with pytest.raises(RendezvousConnectionError, match="refused") as info:
            await b.apply(request(b, Op.JOIN, 0))
    assert f"bob@127.0.0.1:{auth_server.port}" in str(info.value)
    # carol may not subscribe: no notifications, so waits fall back to asking themselves
    monkeypatch.setenv(ENV_PASSWORD, "carol-pw")
    async with backend(auth_server.url, run_id + "-c", username="carol", recheck_interval=0.2) as b:
        token = (await b.apply(request(b, Op.JOIN, 0))).status.token
        waiting = asyncio.ensure_future(b.wait_for_change(token, 60))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        foreign_op(auth_server, b.keys, Op.JOIN, 1)
        with anyio.fail_after(PROMPT):
            await waiting


async def test_tls_with_the_servers_certificate(run_id: str) -> None:
    with RedisServer(tls=True) as srv:
        assert srv.url.startswith("rediss://")
        async with backend(srv.url, run_id, ssl_ca_certs=str(srv.ca_file)) as b:
            await b.kv_set("x", b"x")
            async with group(srv.url, run_id + "-g", 2, 2, 2, ssl_ca_certs=str(srv.ca_file)) as g:
                assert_one_group(await join_all(g), 2)
        async with backend(srv.url, run_id, ssl_cert_reqs="none") as b:  # not verified
            assert await b.kv_get(["x"]) == [b"x"]
        async with backend(srv.url, run_id, read_timeout=0.5) as b:  # an unknown certificate
            with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError, match="rediss"):
                await b.snapshot()


# -- the rendezvous state ------------------------------------------------------------------


def request(b: RedisBackend, op: Op, index: int = 0, **flags: Any) -> Request:
    return Request(op, NodeDesc("10.9.8.7", 4000 + index, 0), RULES, secret=SECRET, **flags)


def foreign_op(
    srv: RedisServer, keys: _scripts.RunKeys, op: Op, index: int, operator: bool = False
) -> Any:
    """One request from another client (another process, in effect); ``operator``: a close
    by the run's operator."""
    args = [
        op.value, f"10.9.8.7_{4000 + index}_0", RULES.min_nodes, RULES.max_nodes,
        RULES.last_call_ms, RULES.window_ms, "0", "0", 1, "", "feed", 60_000, keys.channel,
        "0", SECRET, "1" if operator else "0",
    ]  # fmt: skip
    with srv.client() as client:
        return json.loads(client.eval(_lua.OP, len(keys.rendezvous), *keys.rendezvous, *args))


async def test_requests_and_tokens(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        assert await b.snapshot() is None
        first = await b.apply(request(b, Op.JOIN, 0))
        assert first.outcome is Outcome.WAIT and first.status.participants == 1
        epoch, generation = first.status.token.split(".")
        assert epoch and generation == "0"
        second = await b.apply(request(b, Op.JOIN, 1))
        assert second.status.token == f"{epoch}.1"  # the last call started
        snapshot = await b.snapshot()
        assert snapshot is not None and len(snapshot.participants) == 2
        assert all(e.rank is None for e in snapshot.participants)


async def test_heartbeats_wake_nobody_and_transitions_wake_every_waiter(
    server: RedisServer, run_id: str
) -> None:
    async with backend(server.url, run_id, recheck_interval=60) as b:
        token = (await b.apply(request(b, Op.JOIN, 0))).status.token
        start = time.monotonic()
        assert await b.wait_for_change(token, 0.3) is None  # nothing changes: it times out
        assert 0.25 <= time.monotonic() - start < PROMPT
        waiters = [asyncio.ensure_future(b.wait_for_change(token, 60)) for _ in range(20)]
        await asyncio.sleep(0.2)
        for _ in range(5):  # heartbeats from another process: nobody wakes
            assert foreign_op(server, b.keys, Op.KEEP_ALIVE, 0)["known"] is True
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiters)
        start = time.monotonic()
        foreign_op(server, b.keys, Op.JOIN, 1)  # another process starts the last call
        with anyio.fail_after(PROMPT):
            statuses = await asyncio.gather(*waiters)
        assert time.monotonic() - start < 2.0  # woken by the change, not the 60 s re-check
        assert all(s is not None and s.deadline_ms is not None for s in statuses)


async def test_wait_returns_at_once_for_a_stale_token(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id, recheck_interval=60) as b:
        t0 = (await b.apply(request(b, Op.JOIN, 0))).status.token
        await b.apply(request(b, Op.JOIN, 1))
        with anyio.fail_after(PROMPT):
            assert await b.wait_for_change(t0, 60) is not None
            assert await b.wait_for_change("", 60) is not None
            assert await b.wait_for_change("other0epoch.1", 60) is not None


async def test_token_is_new_after_flushall_no_aba(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        old = (await b.apply(request(b, Op.JOIN, 0))).status.token
        with server.client() as client:
            client.flushall()
        assert await b.snapshot() is None
        new = (await b.apply(request(b, Op.JOIN, 0))).status.token
        assert new.split(".")[0] != old.split(".")[0]


async def test_keys_are_namespaced_and_expire(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id, key_ttl=100) as b:
        await b.apply(request(b, Op.JOIN, 0))
        await b.kv_set("k", b"v")
        await b.kv_add("n", 1)
        with server.client() as client:
            keys = {k.decode() for k in client.keys(f"aelastic:{{{run_id}}}:*")}
            base = f"aelastic:{{{run_id}}}"
            assert {f"{base}:state", f"{base}:p", f"{base}:b", f"{base}:kv:k"} <= keys
            assert all(0 < client.ttl(k) <= 100 for k in keys)  # op records included
            client.expire(b.keys.state, 5)
        await b.apply(request(b, Op.KEEP_ALIVE, 0))  # a request refreshes the expiry
        with server.client() as client:
            assert client.ttl(b.keys.state) > 50
    assert _scripts.RunKeys("p", "a{b}c").base.startswith("p:{sha1-")


@pytest.mark.parametrize(
    ("key", "kind", "value"),
    [
        ("state", "string", b"not a hash"),
        ("state", "list", [b"a", b"b"]),
        ("state", "hash", {"something": "else"}),
        ("state", "hash", {"epoch": "e", "version": "1", "data": "not json"}),
        ("p", "string", b"participants are a sorted set"),
        ("b", "hash", {"beats": "are a sorted set"}),
    ],
)
async def test_foreign_state_is_reported_and_left_untouched(
    server: RedisServer, run_id: str, key: str, kind: str, value: Any
) -> None:
    async with backend(server.url, run_id) as b:
        name = f"{b.keys.base}:{key}"
        with server.client() as client:
            if kind == "string":
                client.set(name, value)
            elif kind == "list":
                client.rpush(name, *value)
            else:
                client.hset(name, mapping=value)
            before = client.dump(name)
        for call in (
            lambda: b.apply(request(b, Op.JOIN, 0)),
            b.snapshot,
            lambda: b.wait_for_change("", 1),
        ):
            with pytest.raises(RendezvousStateError, match="left as it is"):
                await call()
        with server.client() as client:
            assert client.dump(name) == before


async def test_a_state_of_the_first_format_is_refused_naming_both_versions(
    server: RedisServer, run_id: str
) -> None:
    """A run created by an aelastic of state format 1 (one JSON blob) is never overwritten."""
    async with backend(server.url, run_id) as b:
        v1 = {"format": "aelastic.rendezvous.state", "version": 1, "round": 0}
        with server.client() as client:
            client.hset(
                b.keys.state,
                mapping={"epoch": "abc", "version": "3", "data": json.dumps(v1)},
            )
            before = client.dump(b.keys.state)
        with pytest.raises(RendezvousStateError, match=r"version 1.*version 4"):
            await b.apply(request(b, Op.JOIN, 0))
        with server.client() as client:
            assert client.dump(b.keys.state) == before


@pytest.mark.parametrize("version", [2, 3])
async def test_a_state_of_an_older_format_is_refused_naming_both_versions(
    server: RedisServer, run_id: str, version: int
) -> None:
    """A run made by an aelastic of state format 2 (no rules, no node secrets) or 3 (the
    job's control state in the members' store) is reported and never overwritten: nodes of
    both versions cannot share it."""
    async with backend(server.url, run_id) as b:
        old = {"format": "aelastic.rendezvous.state", "version": version}
        with server.client() as client:
            client.hset(
                b.keys.state,
                mapping={
                    "format": str(version), "epoch": "abc", "version": "3",
                    "complete": "1", "data": json.dumps(old),
                },
            )  # fmt: skip
            client.zadd(b.keys.rendezvous[5], {"10.9.8.7_4000_0": 1})
            before = [client.dump(k) for k in b.keys.rendezvous]
        for op in (Op.JOIN, Op.STATUS, Op.KEEP_ALIVE, Op.REPORT, Op.DONE):
            report = NodeReport(quarantine="why") if op is Op.REPORT else None
            with pytest.raises(RendezvousStateError, match=rf"version {version}; this aelastic"):
                await b.apply(request(b, op, 0, report=report))
        with pytest.raises(RendezvousStateError, match=rf"version {version}"):
            await b.snapshot()
        with pytest.raises(RendezvousStateError, match=rf"version {version}"):
            await b.health()
        with server.client() as client:
            assert [client.dump(k) for k in b.keys.rendezvous] == before


async def test_a_node_of_the_first_format_reads_a_state_naming_both_versions(
    server: RedisServer, run_id: str
) -> None:
    """What a format-1 node finds where it looks (hash fields epoch, version, data): a
    state document of format version 4, which its decoder refuses naming the version."""
    async with backend(server.url, run_id) as b:
        await b.apply(request(b, Op.JOIN, 0))
        with server.client() as client:
            epoch, version, data = client.hmget(b.keys.state, "epoch", "version", "data")
        assert epoch and version is not None and version.isdigit()
        assert json.loads(data) == {"format": "aelastic.rendezvous.state", "version": 4}


async def test_garbage_reply_of_a_script_is_a_clear_error(server: RedisServer, run_id: str) -> None:
    async with group(server.url, run_id, 1, 1, 1) as (handler,):
        keys = _scripts.RunKeys("aelastic", run_id)
        with server.client() as client:
            client.hset(keys.state, mapping={"format": "2", "epoch": "e", "version": "x"})
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousError):
            await handler.next_rendezvous()


async def test_foreign_store_value_is_reported_and_left_untouched(
    server: RedisServer, run_id: str
) -> None:
    async with backend(server.url, run_id) as b:
        key = b.keys.kv("k")
        with server.client() as client:
            client.rpush(key, b"x")
        for call in (
            b.kv_get(["k"]),
            b.kv_set("k", b"v"),
            b.kv_add("k", 1),
            b.kv_compare_set("k", None, b"v"),
            b.kv_delete("k"),
        ):
            with pytest.raises(RendezvousStateError):
                await call
        with server.client() as client:
            assert client.lrange(key, 0, -1) == [b"x"]


async def test_run_watched_again_right_after_release_still_wakes(
    server: RedisServer, run_id: str
) -> None:
    async with backend(server.url, run_id + "-keeps-the-connection-open") as keeper:
        await keeper.snapshot()
        for round_ in range(5):  # subscribe, unsubscribe, subscribe: only the last counts
            async with backend(server.url, run_id) as released:
                await released.snapshot()
            async with backend(server.url, run_id, recheck_interval=60) as b:
                token = (await b.apply(request(b, Op.JOIN, 0))).status.token
                waiting = asyncio.ensure_future(b.wait_for_change(token, 60))
                await asyncio.sleep(0.05)
                assert not waiting.done()
                op = Op.CLOSE if round_ % 2 else Op.JOIN
                foreign_op(server, b.keys, op, 1, operator=op is Op.CLOSE)
                with anyio.fail_after(2.0):
                    await waiting
                await b.reset()


# -- the members' store ---------------------------------------------------------------------


async def test_add_beyond_64_bits_is_a_value_error(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        await b.kv_set("big", str(2**63 - 1).encode())
        with pytest.raises(ValueError):
            await b.kv_add("big", 1)
        assert await b.kv_get(["big"]) == [str(2**63 - 1).encode()]


async def test_concurrent_adds_from_many_backends_all_count(
    server: RedisServer, run_id: str
) -> None:
    backends = [create_backend(RendezvousParameters("redis", server.url, run_id, 1, 1))]
    backends += [create_backend(RendezvousParameters("redis", server.url, run_id, 1, 1))]
    try:
        results = await asyncio.gather(*(backends[i % 2].kv_add("n", 1) for i in range(100)))
        assert sorted(results) == list(range(1, 101))
    finally:
        for b in backends:
            await b.aclose()


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("operation", ["snapshot", "apply", "wait_for_change", "kv_get"])
async def test_unreachable_redis_fails_within_read_timeout_naming_it(operation: str) -> None:
    port = free_port()
    url = f"redis://:hidden-pw@127.0.0.1:{port}/0"  # nothing listens there
    async with backend(url, "run", read_timeout=0.5) as b:
        calls = {
            "snapshot": b.snapshot,
            "apply": lambda: b.apply(request(b, Op.JOIN, 0)),
            "wait_for_change": lambda: b.wait_for_change("", 30),
            "kv_get": lambda: b.kv_get(["k"]),
        }
        start = time.monotonic()
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError) as info:
            await calls[operation]()
        assert time.monotonic() - start < 0.5 + 5.0
    assert f"redis://127.0.0.1:{port}/0" in str(info.value)
    assert "hidden-pw" not in str(info.value)


async def test_the_retry_budget_runs_once_per_outage_and_is_whole_again_after_an_answer(
    own_server: RedisServer, run_id: str
) -> None:
    async with backend(own_server.url, run_id, read_timeout=1.0) as b:
        await b.kv_set("k", b"1")
        own_server.kill()
        timings = []
        for _ in range(2):  # one outage: the second call gets what is left (one attempt)
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError):
                await b.kv_get(["k"])
            timings.append(time.monotonic() - start)
        assert 0.9 <= timings[0] < 5.0 and timings[1] < 0.9, timings
        own_server.start()
        assert await b.kv_get(["k"]) == [None]  # answered (an empty restart): outage over
        own_server.kill()
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError):
            await b.kv_get(["k"])
        assert 0.9 <= time.monotonic() - start < 5.0  # a new outage, a whole budget
        own_server.start()


async def test_transient_outage_is_retried(own_server: RedisServer, run_id: str) -> None:
    async with backend(own_server.url, run_id, read_timeout=20) as b:
        await b.kv_set("k", b"1")
        own_server.stop()
        pending = asyncio.ensure_future(b.kv_set("k", b"2"))
        await asyncio.sleep(0.3)
        assert not pending.done()  # retrying, not failed
        own_server.start()
        with anyio.fail_after(PROMPT):
            await pending
        assert await b.kv_get(["k"]) == [b"2"]


@pytest.mark.parametrize("how", ["restart", "sigkill"])
async def test_redis_lost_mid_rendezvous_then_fresh_rendezvous_works(
    own_server: RedisServer, run_id: str, how: str
) -> None:
    async with group(own_server.url, run_id, 3, 3, 3, recheck_interval=60) as handlers:
        first_two = [asyncio.ensure_future(h.next_rendezvous()) for h in handlers[:2]]
        observer = handlers[2].backend
        with anyio.fail_after(PROMPT):  # both joined and are waiting for the third
            while True:
                snapshot = await observer.snapshot()
                if snapshot is not None and len(snapshot.participants) == 2:
                    break
                await asyncio.sleep(0.02)
        if how == "restart":
            own_server.stop()
        else:
            own_server.kill()
        own_server.start()  # empty: the state is gone
        third = asyncio.ensure_future(handlers[2].next_rendezvous())
        with anyio.fail_after(3 * PROMPT):
            results = await asyncio.gather(*first_two, third, return_exceptions=True)
        for result in results:  # each node completed or failed with a clear error
            assert isinstance(result, RendezvousInfo | RendezvousConnectionError), result
        infos = await join_all(handlers)  # and a fresh round works
        assert_one_group(infos, 3)


async def test_a_reply_made_before_the_subscription_is_not_trusted(
    server: RedisServer, run_id: str
) -> None:
    """The first node's join is made by the server, the second node completes the round
    (its notification goes out), and only then the first node's subscription takes effect;
    the first join's reply (held by ``WAIT``: no replica here) arrives after that. Its
    status predates the subscription: the node must ask the server rather than wait for a
    notification that was sent before it listened (it would wait for its keep-alive)."""
    conf: dict[str, Any] = dict(
        share_connections=0, keep_alive_interval=30, heartbeat_timeout=60, last_call_timeout=60
    )
    async with (
        group(server.url, run_id, 1, 2, 2, wait_replicas=1, **conf) as (first,),
        group(server.url, run_id, 1, 2, 2, wait_replicas=0, **conf) as (second,),
    ):
        gate = asyncio.Event()
        find = Standalone.pubsub_address
        gated: list[Any] = []

        async def held(self: Standalone) -> tuple[str, int]:
            if not gated:  # the first client to subscribe: the first node's
                gated.append(self)
                await gate.wait()
            return await find(self)

        with server.client() as client:
            client.script_load(_lua.OP)  # (a first EVALSHA refused would wait for WAIT too)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Standalone, "pubsub_address", held)
            started = time.monotonic()
            joining = asyncio.ensure_future(first.next_rendezvous())
            await asyncio.sleep(0.3)  # its join is in; the reply waits for WAIT (1 s)
            with anyio.fail_after(PROMPT):
                await second.next_rendezvous()  # completes the round, notifies
            assert time.monotonic() - started < 0.9 and not joining.done()
            gate.set()  # subscribed now: after the notification, before the first reply
            with anyio.fail_after(PROMPT):
                await joining
        assert time.monotonic() - started < 10  # not at the 30 s keep-alive


async def test_listener_resubscribes_after_a_restart(own_server: RedisServer, run_id: str) -> None:
    async with backend(own_server.url, run_id, recheck_interval=60) as b:
        await b.apply(request(b, Op.JOIN, 0))
        own_server.restart()
        with anyio.fail_after(PROMPT):
            while await b.snapshot() is not None:
                pass
            token = (await b.apply(request(b, Op.JOIN, 0))).status.token
        waiter = asyncio.ensure_future(b.wait_for_change(token, 60))
        watch = b._watch
        assert watch is not None
        with anyio.fail_after(PROMPT):  # the listener is subscribed again
            await watch.ready.wait()
        await asyncio.sleep(0.1)
        assert not waiter.done()
        start = time.monotonic()
        foreign_op(own_server, b.keys, Op.JOIN, 1)
        with anyio.fail_after(PROMPT):
            await waiter
        assert time.monotonic() - start < 2.0


async def test_pubsub_connection_killed_is_replaced(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id, recheck_interval=60) as b:
        token = (await b.apply(request(b, Op.JOIN, 0))).status.token
        watch, shared = b._watch, b._client
        assert watch is not None and shared is not None
        with anyio.fail_after(PROMPT):
            await watch.ready.wait()  # the subscription is made in the background
        assert watch.live
        killed = shared.listener.conn
        with server.client() as client:
            assert client.client_kill_filter(_type="pubsub") >= 1

        async def resubscribed() -> bool:  # on a new connection
            return shared.listener.conn is not killed and watch.live

        await eventually(resubscribed)
        waiting = asyncio.ensure_future(b.wait_for_change(token, 60))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        foreign_op(server, b.keys, Op.JOIN, 1)
        with anyio.fail_after(2.0):
            await waiting


async def test_a_retried_add_counts_once(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        assert await b.kv_add("n", 1) == 1
        keys = [b.keys.kv("n"), b.keys.op("retried")]
        with server.client() as client:
            add = client.register_script(_scripts.KV_ADD)
            args = [5, 60_000, b.keys.channel, b"kn", 60_000]
            assert add(keys=keys, args=args) == [1, b"6"]
            assert add(keys=keys, args=args) == [1, b"6"]  # the same operation, sent again
        assert await b.kv_get(["n"]) == [b"6"]


# -- scale and resources --------------------------------------------------------------------


async def test_many_handlers_in_one_process_share_few_connections(
    server: RedisServer, run_id: str
) -> None:
    async with group(server.url, run_id, 64, 64, 64, max_connections=8) as handlers:
        infos = await join_all(handlers)
        assert_one_group(infos, 64)
        with server.client() as client:
            clients = client.client_list()
        ours = [c for c in clients if c["cmd"] != "client|list"]
        assert len(ours) <= 8 + 1  # the pool and one pub/sub connection
    loop = asyncio.get_running_loop()
    assert not _shared._clients.get(loop)  # everything released


async def test_aclose_is_idempotent_and_closed_backend_refuses(
    server: RedisServer, run_id: str
) -> None:
    b = create_backend(RendezvousParameters("redis", server.url, run_id, 1, 1))
    await b.aclose()  # never used: nothing to release
    await b.aclose()
    with pytest.raises(RendezvousConnectionError, match="closed"):
        await b.snapshot()
