"""The Redis backend over Sentinel and Cluster, against real servers that fail over.

Servers come from :mod:`tests._redis_ha` (loopback, started and killed by the tests). A
failover is a SIGKILL of the Sentinel-managed primary, or ``CLUSTER FAILOVER`` on a
replica; the failures that retrying cannot fix end in one-line errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from aelastic import RendezvousConnectionError, RendezvousParameters
from aelastic.backends.redis import RedisBackend, create_backend, parse_endpoint
from aelastic.backends.redis._client import RedisClient
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._redis_ha import SERVICE, RedisCluster, SentinelGroup, wait_until
from tests._redis_server import RedisServer, free_port
from tests._rendezvous_helpers import (
    PROMPT,
    assert_one_group,
    eventually,
    handler_group,
    join_all,
)

pytestmark = pytest.mark.anyio

PASSWORD = "data-pa55word"
SENTINEL_PASSWORD = "sentinel-pa55word"
#: Nothing but notifications (or a re-read after re-subscribing) can tell a waiting node
#: that its round moved: no safety-net re-checks, no heartbeat within the test.
QUIET = {"recheck_interval": 3600, "keep_alive_interval": 60, "keep_alive_max_attempt": 3}


@pytest.fixture(scope="module")
def guarded() -> Iterator[SentinelGroup]:
    """A Sentinel group with passwords on the data nodes and on the sentinels (never
    failed over: the error tests share it)."""
    with SentinelGroup(password=PASSWORD, sentinel_password=SENTINEL_PASSWORD) as ha:
        yield ha


def _params(endpoint: str, run_id: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("redis", endpoint, run_id, 1, 1, **conf)


def _client(handler: DynamicRendezvousHandler) -> RedisClient:
    backend = handler.backend
    assert isinstance(backend, RedisBackend) and backend._client is not None
    return backend._client


async def _one_line_error(
    caplog: pytest.LogCaptureFixture, endpoint: str, run_id: str, **conf: Any
) -> str:
    """The message of the connection error, checked to be one line without secrets; the
    warnings logged meanwhile are short lines too (no pages of redis-py reprs)."""
    backend = create_backend(_params(endpoint, run_id, **conf))
    try:
        with anyio.fail_after(3 * PROMPT), pytest.raises(RendezvousConnectionError) as info:
            await backend.snapshot()
    finally:
        await backend.aclose()
    message = str(info.value)
    assert "\n" not in message, message
    for secret in (PASSWORD, SENTINEL_PASSWORD, "wrong-one"):
        assert secret not in message
    for record in caplog.records:
        said = record.getMessage()
        assert "\n" not in said and "<redis." not in said and len(said) < 500, said
    return message


# -- endpoints ------------------------------------------------------------------------------


def test_sentinel_and_cluster_endpoint_forms() -> None:
    e = parse_endpoint(
        "redis+sentinel://u:pw@h1:1,h2,[::1]:3/svc/2",
        {"sentinel_username": "su", "sentinel_password": "spw"},
        environ={},
    )
    assert (e.kind, e.hosts, e.service, e.db) == (
        "sentinel",
        (("h1", 1), ("h2", 26379), ("::1", 3)),
        "svc",
        2,
    )
    assert (e.username, e.password, e.sentinel_username, e.sentinel_password) == (
        "u",
        "pw",
        "su",
        "spw",
    )
    assert "pw" not in e.display and "spw" not in repr(e)
    env = parse_endpoint("rediss+sentinel://h/s", environ={"AELASTIC_REDIS_SENTINEL_PASSWORD": "x"})
    assert (env.tls, env.sentinel_password, env.db) == (True, "x", 0)
    c = parse_endpoint("redis+cluster://h1:7000,h2:7001", environ={})
    assert (c.kind, c.hosts, c.db) == ("cluster", (("h1", 7000), ("h2", 7001)), 0)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("redis+sentinel://h1:1,h2:2", "service name"),
        ("redis+cluster://h1:1/0", "takes no path"),
        ("redis://h1:1,h2:2", "several hosts"),
        ("redis+sentinel://h1:1/svc/x", "database"),
    ],
)
def test_bad_sentinel_and_cluster_endpoints(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_endpoint(text, environ={})


# -- Sentinel -------------------------------------------------------------------------------


async def test_sentinel_waiting_node_follows_the_new_primary_without_missing_a_join(
    run_id: str,
) -> None:
    """A node waits for a second one; the primary dies. The second joins, completing the
    round, while the first's listener is not subscribed yet (held back until then): that
    publication is lost to the first (no re-checks, no heartbeat interval within the test;
    only the beat its named connection sends once back on the new primary may tell it).
    Once subscribed on the new primary it re-reads the status and completes the round."""
    with SentinelGroup() as ha:
        async with handler_group(
            "redis", ha.endpoint, run_id, 2, 2, 2, share_connections=False, **QUIET
        ) as (first, second):
            waiting = asyncio.ensure_future(first.next_rendezvous())
            await anyio.to_thread.run_sync(
                lambda: wait_until(lambda: _members(ha, run_id) == 1, "the first node joined")
            )
            client = _client(first)
            backend = first.backend
            assert isinstance(backend, RedisBackend) and backend._watch is not None
            watch = backend._watch
            assert watch.live
            asked, gate = asyncio.Event(), asyncio.Event()
            find_primary = client.server.pubsub_address

            async def after_the_join() -> tuple[str, int]:
                asked.set()  # the listener lost its subscription
                await gate.wait()
                return await find_primary()

            client.server.pubsub_address = after_the_join  # type: ignore[method-assign]
            await anyio.to_thread.run_sync(ha.kill_primary)

            async def waits_again_unsubscribed() -> bool:
                # Woken when the subscription was lost, it read the status again (from the
                # new primary: the old one was dead by then) and waits again.
                read = asked.is_set() and watch.latest is not None
                return read and watch.waiting and not watch.live

            await eventually(waits_again_unsubscribed, 3 * PROMPT)
            with anyio.fail_after(3 * PROMPT):
                joined = await second.next_rendezvous()
            await asyncio.sleep(0.5)  # (room for a wrong wake-up to show)
            # Its named connection (departures) may have come back on the new primary and its
            # node beaten since: that answer tells of the round too. Else the re-subscribed
            # listener must.
            gate.set()
            with anyio.fail_after(PROMPT):
                infos = [await waiting, joined]
            assert_one_group(infos, 2)
            new = ("127.0.0.1", ha.primary_port())

            async def both_subscribed_there() -> bool:
                # (The round may have come through the beat, before the listener is back.)
                return client.subscribed_at == new == _client(second).subscribed_at

            await eventually(both_subscribed_there, PROMPT)


def _acknowledged_by_replicas(caplog: pytest.LogCaptureFixture) -> bool:
    """No client said that a replica failed to acknowledge a write (``wait_replicas``)."""
    return not [r for r in caplog.records if "acknowledged a round transition" in r.message]


def _members(ha: SentinelGroup, run_id: str) -> int:
    with ha.client() as client:
        return sum(int(client.zcard(key)) for key in client.keys(f"*{run_id}*:p"))


async def test_sentinel_store_writes_wait_for_the_replica_and_survive_a_failover(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    with SentinelGroup() as ha:
        async with handler_group("redis", ha.endpoint, run_id, 2, 2, 2) as handlers:
            infos = await join_all(handlers, 3 * PROMPT)
            assert_one_group(infos, 2)
            store = infos[0].store
            await store.set("weights", b"v1")
            await store.add("counter", 5)
            assert _acknowledged_by_replicas(caplog)
            await anyio.to_thread.run_sync(ha.kill_primary)
            # Acknowledged by the replica before the reply: nothing was lost.
            with anyio.fail_after(3 * PROMPT):
                assert await infos[1].store.get("weights") == b"v1"
                assert await infos[1].store.add("counter", 1) == 6


async def test_a_sentinel_failover_with_short_heartbeats_keeps_the_round(run_id: str) -> None:
    """1 s heartbeats (a 3 s window) and a primary killed: the failover takes longer than the
    window, and the beats sent meanwhile were lost with the old primary. They are not counted
    against the members: nobody is removed, the watchers see no change (no restart), and
    the members beat on the new primary."""
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "heartbeat_timeout": 2}
    with SentinelGroup(down_after_ms=4000) as ha:  # a failover longer than the window
        async with handler_group("redis", ha.endpoint, run_id, 2, 2, 2, **conf) as handlers:
            assert_one_group(await join_all(handlers, 3 * PROMPT), 2)
            watches = [asyncio.ensure_future(h.watch()) for h in handlers]
            killed = time.monotonic()
            await anyio.to_thread.run_sync(ha.kill_primary)
            backend = handlers[0].backend
            assert isinstance(backend, RedisBackend)

            async def beating_on_the_new_primary() -> bool:
                snapshot = await backend.snapshot()
                assert snapshot is not None and snapshot.status.lost == 0, snapshot
                beats = [e.beat_ms for e in snapshot.participants]
                return len(beats) == 2 and min(beats) > snapshot.status.now_ms - 1_500

            await eventually(beating_on_the_new_primary, 3 * PROMPT)
            assert time.monotonic() - killed > 3.0  # longer than the window
            await asyncio.sleep(4.0)  # another window on the new primary
            assert not any(w.done() for w in watches), [w.result() for w in watches if w.done()]
            snapshot = await backend.snapshot()
            assert snapshot is not None and snapshot.status.lost == 0
            assert set(snapshot.ranks()) == {h.node for h in handlers}
            for watch in watches:
                watch.cancel()
            await asyncio.gather(*watches, return_exceptions=True)


async def test_status_through_sentinel_needs_no_primary_address(
    guarded: SentinelGroup, run_id: str
) -> None:
    conf = {"password": PASSWORD, "sentinel_password": SENTINEL_PASSWORD}
    async with handler_group("redis", guarded.endpoint, run_id, 2, 2, 2, **conf) as handlers:
        infos = await join_all(handlers, 3 * PROMPT)
        assert_one_group(infos, 2)
        snap = await handlers[0].backend.snapshot()
        assert snap is not None and snap.status.complete and len(snap.participants) == 2


async def test_no_sentinel_reachable_is_a_one_line_error(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/{SERVICE}"
    message = await _one_line_error(caplog, endpoint, run_id, read_timeout=1)
    assert "no sentinel at 127.0.0.1:" in message and "could not be reached within 1 s" in message


async def test_unknown_service_name_is_a_one_line_error(
    guarded: SentinelGroup, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = guarded.endpoint.replace(f"/{SERVICE}", "/no-such-service")
    message = await _one_line_error(caplog, endpoint, run_id, sentinel_password=SENTINEL_PASSWORD)
    assert "watch no primary named 'no-such-service'" in message
    assert f"they watch: {SERVICE}" in message


async def test_wrong_sentinel_password_is_a_one_line_error(
    guarded: SentinelGroup, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    message = await _one_line_error(
        caplog, guarded.endpoint, run_id, password=PASSWORD, sentinel_password="wrong-one"
    )
    assert "refused aelastic's login" in message and "sentinel_password" in message


async def test_wrong_data_password_is_a_one_line_error(
    guarded: SentinelGroup, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    message = await _one_line_error(
        caplog, guarded.endpoint, run_id, password="wrong-one", sentinel_password=SENTINEL_PASSWORD
    )
    assert "password" in message.lower() or "login" in message.lower(), message


async def test_a_state_written_under_another_primary_takes_a_new_epoch(run_id: str) -> None:
    """What a promoted replica serves: the state it holds was written under the old
    primary's replication id (here the id is rewritten instead of promoting a replica). The
    first request down the script's whole path moves it to a new epoch, once, and publishes
    it: who waits on a token of the old epoch wakes and re-reads; the round itself is kept.
    A plain heartbeat's short path does not read the id (it writes nothing that names a
    version, and a beat lost in the failover sends it down the whole path)."""
    with RedisServer() as server:
        async with handler_group("redis", server.url, run_id, 2, 2, 2, **QUIET) as handlers:
            assert_one_group(await join_all(handlers, 3 * PROMPT), 2)
            backend = handlers[0].backend
            assert isinstance(backend, RedisBackend)
            before = await backend.snapshot()
            assert before is not None
            with server.client(socket_timeout=5.0) as client:
                client.hset(backend.keys.state, "replid", "f" * 40)
            waiting = asyncio.ensure_future(backend.wait_for_change(before.status.token, 60))
            await asyncio.sleep(0)
            node = handlers[1]
            assert (await node.keep_alive(0.0)).status.token == before.status.token
            unmoved = await backend.snapshot()
            assert unmoved is not None and unmoved.status.token == before.status.token
            await node.num_nodes_waiting()  # a status read: the whole path
            with anyio.fail_after(PROMPT):
                moved = await waiting
            assert moved is not None
            assert moved.token.split(".")[0] != before.status.token.split(".")[0]
            assert (moved.round, moved.complete) == (before.status.round, True)
            after = await backend.snapshot()
            assert after is not None and len(after.participants) == 2
            # Once only: the state now carries this primary's id.
            await node.keep_alive(0.0)
            again = await backend.snapshot()
            assert again is not None
            assert again.status.token.split(".")[0] == moved.token.split(".")[0]


async def test_a_join_lost_in_a_failover_makes_the_round_form_again(run_id: str) -> None:
    """What a promoted replica that missed the last join serves (made here by rewriting the
    state: the second node's join gone, the round not complete, another primary's id): the
    members of the completed round both learn that it is gone, and form one again."""
    with RedisServer() as server:
        async with handler_group("redis", server.url, run_id, 2, 2, 2, **QUIET) as handlers:
            assert_one_group(await join_all(handlers, 3 * PROMPT), 2)
            first, second = handlers
            backend = first.backend
            assert isinstance(backend, RedisBackend)
            watches = [asyncio.ensure_future(h.watch()) for h in handlers]
            await asyncio.sleep(0.2)  # both watching
            keys = backend.keys.rendezvous
            with server.client(socket_timeout=5.0) as client:
                client.zrem(keys[1], str(second.node))
                client.hset(keys[0], mapping={"complete": "0", "replid": "f" * 40})
            # The first request the "promoted" server serves moves the run to a new epoch.
            await first.keep_alive(0.0)
            with anyio.fail_after(PROMPT):
                views = await asyncio.gather(*watches)
            assert all(view.removed for view in views)
            assert_one_group(await join_all(handlers, 3 * PROMPT), 2)


# -- Cluster --------------------------------------------------------------------------------


async def test_cluster_run_forms_and_goes_on_after_a_failover(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisCluster() as cluster:
        conf = {"last_call_timeout": 0.5}
        async with handler_group("redis", cluster.endpoint, run_id, 2, 2, 3, **conf) as handlers:
            infos = await join_all(handlers, 3 * PROMPT)
            assert_one_group(infos, 2)
            await infos[0].store.set("weights", b"v1")
            assert _acknowledged_by_replicas(caplog)  # wait_replicas=1 by default
            backend = handlers[0].backend
            assert isinstance(backend, RedisBackend)
            old, new = await anyio.to_thread.run_sync(cluster.fail_over, backend.keys.state)
            with anyio.fail_after(3 * PROMPT):
                assert await infos[1].store.get("weights") == b"v1"
            # The run goes on: a third node joins, and the three form the next round.
            async with handler_group("redis", cluster.endpoint, run_id, 1, 2, 3, **conf) as (
                third,
            ):
                joining = asyncio.ensure_future(third.next_rendezvous())

                async def third_waits() -> bool:
                    return await handlers[0].num_nodes_waiting() > 0

                await eventually(third_waits, 3 * PROMPT)
                again = await join_all(handlers, 3 * PROMPT)
                infos = [*again, await joining]
            assert_one_group(infos, 3)
            snap = await backend.snapshot()
            assert snap is not None and snap.status.round > 0 and snap.status.complete
            assert cluster.node_of(backend.keys.state) is new and new is not old


async def test_cluster_down_is_a_one_line_error(run_id: str) -> None:
    with RedisCluster() as cluster:
        backend = create_backend(_params(cluster.endpoint, run_id, read_timeout=2))
        try:
            primary = cluster.node_of(backend.keys.state)
            replica = cluster.replica_of(primary)
            replica.kill()
            primary.kill()
            survivor = next(s for s in cluster.servers if s.running)
            await anyio.to_thread.run_sync(
                lambda: wait_until(lambda: _cluster_state(survivor) == "fail", "cluster down")
            )
            with anyio.fail_after(3 * PROMPT), pytest.raises(RendezvousConnectionError) as info:
                await backend.snapshot()
        finally:
            await backend.aclose()
    message = str(info.value)
    assert "\n" not in message
    assert "could not be reached within 2 s" in message
    assert "the cluster is down" in message, message


def _cluster_state(server: RedisServer) -> str:
    with server.client(socket_timeout=5.0) as client:
        return str(client.cluster("INFO")["cluster_state"])


async def test_a_sentinel_lookup_given_up_leaves_no_connection_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The listener's Sentinel lookup times out (a sentinel that takes the connection and
    never answers): redis-py's clean-up of the connection it was reading runs to its end
    (a deadline that cancels at every await cut it short, and the connection was left
    open, to warn when collected)."""
    import gc
    import socket
    import warnings

    from aelastic.backends.redis import _listener
    from aelastic.backends.redis._listener import Listener
    from aelastic.backends.redis._servers import SentinelPrimary

    monkeypatch.setattr(_listener, "CONNECT_TIMEOUT", 0.3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        server = SentinelPrimary(parse_endpoint(f"redis+sentinel://127.0.0.1:{port}/{SERVICE}"), 4)
        listener = Listener(server, 5.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            listener.watch("aelastic:run")
            await asyncio.sleep(1.0)  # lookups given up meanwhile
            await listener.aclose()
            await server.aclose()
            gc.collect()
        leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert not leaks, [str(w.message) for w in leaks]
