"""The Redis ACL docs/production-store.md gives the nodes, on a real ``redis-server``.

The lines are read from the document itself and run as they are (passwords filled in); a
whole rendezvous, the members' store, a listing and a reset then run under those users.
A user missing one command gets an error (or, for the two a script does without, a
warning) naming it.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from aelastic import RendezvousConnectionError, RendezvousParameters
from aelastic.backends.redis import RedisBackend, create_backend
from aelastic.backends.redis._calls import CLUSTER_ACL, NODE_ACL, OPERATOR_ACL
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.rendezvous import RendezvousSettings
from tests._redis_server import RedisServer
from tests._rendezvous_helpers import SECRET, assert_one_group, handler_group, join_all

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[2] / "docs" / "production-store.md"
PASSWORDS = {"aelastic-node": "node-pw", "aelastic-operator": "operator-pw"}


def documented_acl() -> dict[str, list[str]]:
    """The ``ACL SETUSER`` lines of the document, by user, as arguments."""
    lines = re.findall(r"^ACL SETUSER .+$", DOC.read_text(), re.MULTILINE)
    users: dict[str, list[str]] = {}
    for line in lines:
        user, *args = shlex.split(line)[2:]
        users[user] = [f">{PASSWORDS[user]}" if a.startswith(">") else a for a in args]
    return users


def test_the_documented_lines_are_the_commands_aelastic_runs() -> None:
    users = documented_acl()
    assert set(users) == set(PASSWORDS)
    node = " ".join(a for a in users["aelastic-node"] if a.startswith("+"))
    operator = " ".join(a for a in users["aelastic-operator"] if a.startswith("+"))
    assert node == NODE_ACL
    assert operator == f"{NODE_ACL} {OPERATOR_ACL}"
    assert f"`{CLUSTER_ACL}`" in DOC.read_text()


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        client = server.client()
        try:
            for user, args in documented_acl().items():
                client.execute_command("ACL", "SETUSER", user, *args)
            # The default user may do nothing: only the documented users work.
            client.execute_command("ACL", "SETUSER", "default", "on", "nopass", "-@all")
        finally:
            client.close()
        yield server


def url(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{server.port}/0"


@asynccontextmanager
async def backend(endpoint: str, run_id: str, **conf: Any) -> AsyncIterator[RedisBackend]:
    made = create_backend(RendezvousParameters("redis", endpoint, run_id, 1, 2, **conf))
    try:
        yield made
    finally:
        await made.aclose()


async def test_a_rendezvous_and_the_store_run_under_the_node_user(
    acl_server: RedisServer, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "aelastic.backends.redis")
    node = url(acl_server, "aelastic-node")
    async with handler_group("redis", node, run_id, 2, 2, 2) as handlers:
        infos = await join_all(handlers)
        assert_one_group(infos, 2)
        store = infos[0].store
        await store.set("k", b"v")
        assert await store.get("k", 5) == b"v"
        assert await store.add("n", 2) == 2
        assert await store.compare_set("k", b"v", b"w") == b"w"
        await store.wait(["k", "n"], 5)  # (a wait: EXISTS, woken by the channel)
        assert await store.delete_key("n")
        assert await handlers[0].num_nodes_waiting() == 0
        assert await handlers[0].report_departures() == 0  # CLIENT LIST, nobody gone
        failure = FailureReport(time=1.5, rank=0, local_rank=0, exitcode=1, message="boom")
        assert await handlers[0].report(NodeReport(failure=failure))
        assert await handlers[1].report(NodeReport(quarantine="flaky"))
        assert all([await h.mark_done() for h in handlers])
        health = await handlers[1].health()
        assert health is not None and health.latest is not None and health.quarantined
        await handlers[0].set_closed()
        assert await handlers[1].is_closed()
    async with backend(url(acl_server, "aelastic-operator"), run_id) as operator:
        listed = [r for r, _ in await operator.list_runs(10)]
        assert run_id in listed
        await operator.reset()
        assert await operator.snapshot() is None
    assert not caplog.records, [r.getMessage() for r in caplog.records]


async def test_the_publish_probe_reaches_no_member(run_id: str) -> None:
    """Each client tries PUBLISH once: on a channel of the run's prefix that nobody
    listens to, never on the run's own (every member would get every node's probe: N²
    messages when N nodes start)."""
    from aelastic.backends.redis._scripts import RunKeys

    keys = RunKeys("aelastic", run_id)
    with RedisServer() as server:
        listener = server.client().pubsub()
        listener.psubscribe(f"{keys.base}:*")
        try:
            assert listener.get_message(timeout=5)["type"] == "psubscribe"
            for _ in range(3):  # three clients, each probing once
                async with backend(server.url, run_id, share_connections=0) as b:
                    await b.snapshot()
            seen = []
            while (message := listener.get_message(timeout=1)) is not None:
                seen.append((message["channel"], message["data"]))
        finally:
            listener.close()
    assert seen == [(f"{keys.base}:probe".encode(), b"p")] * 3
    assert all(channel != keys.channel.encode() for channel, _ in seen)


async def test_the_node_user_may_not_list_or_reset(acl_server: RedisServer, run_id: str) -> None:
    async with backend(url(acl_server, "aelastic-node"), run_id) as node:
        with pytest.raises(RendezvousConnectionError, match="'scan' command"):
            await node.list_runs(10)


@pytest.mark.parametrize("missing", ["time", "zadd", "evalsha", "eval"])
async def test_a_missing_command_is_named(run_id: str, missing: str) -> None:
    with RedisServer() as server:
        client = server.client()
        try:
            args = documented_acl()["aelastic-node"]
            client.execute_command("ACL", "SETUSER", "aelastic-node", *args, f"-{missing}")
        finally:
            client.close()
        async with backend(url(server, "aelastic-node"), run_id, read_timeout=5) as node:
            params = RendezvousParameters("redis", "h", run_id, 1, 2)
            rules = RendezvousSettings.from_parameters(params).rules
            with pytest.raises(RendezvousConnectionError) as refused:
                await node.apply(Request(Op.JOIN, NodeDesc("10.0.0.1", 1, 0), rules, secret=SECRET))
    message = str(refused.value)
    said, hint = message.split("; a node's Redis user needs", 1)
    named = f"may not run {missing.upper()} " in said or f"run the '{missing}' command" in said
    assert named, message
    assert "ACL SETUSER" in hint and NODE_ACL in hint
    assert "node-pw" not in message


def node_user_without(server: RedisServer, *commands: str) -> None:
    """Make the documented node user on ``server``, less ``commands``."""
    client = server.client()
    try:
        args = documented_acl()["aelastic-node"]
        client.execute_command(
            "ACL", "SETUSER", "aelastic-node", *args, *(f"-{c}" for c in commands)
        )
    finally:
        client.close()


@pytest.mark.parametrize("missing", ["publish", "info"])
async def test_a_command_a_script_does_without_is_named_in_a_warning(
    run_id: str, missing: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "aelastic.backends.redis")
    with RedisServer() as server:
        node_user_without(server, missing)
        async with handler_group(
            "redis", url(server, "aelastic-node"), run_id, 2, 2, 2, recheck_interval=0.2
        ) as handlers:
            assert_one_group(await join_all(handlers), 2)  # the run goes on
    lines = [r.getMessage() for r in caplog.records if "may not run" in r.getMessage()]
    assert len(lines) == 1, lines  # once per client (the handlers share one)
    assert f"may not run {missing.upper()}" in lines[0] and "ACL SETUSER" in lines[0]


async def test_on_a_cluster_the_node_user_needs_two_more(run_id: str) -> None:
    from tests._redis_ha import RedisCluster

    with RedisCluster(primaries=3, replicas=0) as cluster:
        for server in cluster.servers:
            client = server.client()
            try:
                args = [*documented_acl()["aelastic-node"], *CLUSTER_ACL.split()]
                client.execute_command("ACL", "SETUSER", "aelastic-node", *args)
                client.execute_command("ACL", "SETUSER", "default", "on", "nopass", "-@all")
            finally:
                client.close()
        user = f"aelastic-node:{PASSWORDS['aelastic-node']}@"
        endpoint = cluster.endpoint.replace("redis+cluster://", f"redis+cluster://{user}")
        async with handler_group("redis", endpoint, run_id, 2, 2, 2) as handlers:
            infos = await join_all(handlers)
            assert_one_group(infos, 2)
            await infos[0].store.set("k", b"v")
            assert await infos[1].store.get("k", 5) == b"v"


async def test_a_user_without_client_commands_leaves_departures_to_the_window(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "aelastic.backends.redis")
    with RedisServer() as server:
        node_user_without(server, "client|setname", "client|list")
        async with handler_group("redis", url(server, "aelastic-node"), run_id, 2, 2, 2) as hs:
            assert_one_group(await join_all(hs), 2)
            assert await hs[0].report_departures() == 0
            assert await hs[0].num_nodes_waiting() == 0  # the run goes on
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "refused to name" in said and "refused CLIENT LIST" in said, said
