"""The etcd backend against a real etcd: endpoints, credentials, faults, losses, a cluster."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest

from aelastic import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from aelastic.backends import create_backend as create_any
from aelastic.backends.etcd import (
    ENV_PASSWORD,
    ENV_USERNAME,
    EtcdBackend,
    create_backend,
    parse_endpoint,
)
from aelastic.backends.etcd._client import SLOW, EtcdClient
from aelastic.backends.etcd._leases import SLACK
from aelastic.core.params import Rules
from aelastic.core.redact import redact
from aelastic.core.state import NodeDesc, Op, Outcome, Request, Status, Transition
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._etcd_server import EtcdCluster, EtcdServer, b64
from tests._ports import free_port
from tests._redis_server import RedisServer
from tests._rendezvous_helpers import PROMPT, assert_one_group, handler_group, join_all

pytestmark = pytest.mark.anyio

PASSWORD = "s3cret-pa55"


@pytest.fixture(scope="module")
def server() -> Iterator[EtcdServer]:
    with EtcdServer() as etcd:
        yield etcd


@asynccontextmanager
async def backend(endpoint: str, run_id: str, **conf: Any) -> AsyncIterator[EtcdBackend]:
    b = create_backend(RendezvousParameters("etcd", endpoint, run_id, 1, 1, **conf))
    try:
        yield b
    finally:
        await b.aclose()


def group(
    endpoint: str, run_id: str, count: int, min_nodes: int, max_nodes: int, **conf: Any
) -> AbstractAsyncContextManager[list[DynamicRendezvousHandler]]:
    return handler_group("etcd", endpoint, run_id, count, min_nodes, max_nodes, **conf)


async def _until(b: EtcdBackend, seen: Status, told: Callable[[Status], bool]) -> Status:
    """The status ``b``'s watch tells once ``told`` holds (a node asks again only then)."""
    while not told(seen):
        news = await b.wait_for_change(seen.token, PROMPT)
        assert news is not None
        seen = news
    return seen


# -- endpoints and options ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "config", "members", "tls"),
    [
        ("", {}, (("localhost", 2379),), False),
        ("e0", {}, (("e0", 2379),), False),
        ("e0:1,e1:2, e2", {}, (("e0", 1), ("e1", 2), ("e2", 2379)), False),
        ("e0:1", {"protocol": "https"}, (("e0", 1),), True),
        ("https://e0:1,https://e1", {}, (("e0", 1), ("e1", 2379)), True),
        ("[::1]:7", {}, (("::1", 7),), False),
    ],
)
def test_endpoints_in_torchs_form(
    endpoint: str, config: dict[str, str], members: tuple[tuple[str, int], ...], tls: bool
) -> None:
    parsed = parse_endpoint(endpoint, config, environ={})
    assert parsed.members == members
    assert parsed.tls is tls


@pytest.mark.parametrize(
    ("endpoint", "config", "message"),
    [
        ("e0:x", {}, "port"),
        ("e0", {"protocol": "ftp"}, "http or https"),
        ("http://e0,https://e1", {}, "mix"),
        ("e0", {"cacert": "/ca.pem"}, "protocol=https"),
        ("e0", {"protocol": "https", "key": "/k.pem"}, "needs 'cert'"),
        ("u:pw@e0", {}, ENV_PASSWORD),
        ("http://u:pw@e0", {}, ENV_PASSWORD),
        ("e0", {"password": "pw"}, ENV_PASSWORD),
    ],
)
def test_bad_endpoints_and_options_are_one_clear_line(
    endpoint: str, config: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_endpoint(endpoint, config, environ={})
    assert "\n" not in str(info.value) and "pw" not in str(info.value).replace(ENV_PASSWORD, "")


def test_credentials_come_from_the_environment_and_never_show() -> None:
    env = {ENV_USERNAME: "alice", ENV_PASSWORD: PASSWORD}
    parsed = parse_endpoint("e0:1,e1:2", {"etcd_prefix": "jobs/"}, environ=env)
    assert (parsed.username, parsed.password) == ("alice", PASSWORD)
    assert parsed.prefix == "/jobs"
    for shown in (parsed.display, repr(parsed)):
        assert PASSWORD not in shown
    assert ENV_PASSWORD in redact.__globals__["SECRET_ENV"]


def test_the_registry_knows_torchs_names() -> None:
    for name in ("etcd", "etcd-v2", "aelastic-etcd"):
        made = create_any(RendezvousParameters(name, "127.0.0.1:1", "r", 1, 1))
        assert isinstance(made, EtcdBackend)


# -- bad input: one clear line each, nothing overwritten --------------------------------------


async def test_a_port_without_etcd_fails_at_once_naming_it() -> None:
    with RedisServer() as redis:
        async with backend(f"127.0.0.1:{redis.port}", "wrong", read_timeout=30) as b:
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="does not answer etcd") as info:
                await b.kv_get(["k"])
    assert time.monotonic() - started < 10
    assert str(redis.port) in str(info.value) and "\n" not in str(info.value)


async def test_etcd_down_at_start_fails_after_read_timeout_naming_it() -> None:
    port = free_port()
    async with backend(f"127.0.0.1:{port}", "down", read_timeout=1) as b:
        with pytest.raises(RendezvousConnectionError, match="could not be reached within 1 s"):
            await b.kv_get(["k"])


async def test_etcd_that_comes_up_within_read_timeout_is_waited_for() -> None:
    etcd = EtcdServer()
    try:
        async with backend(etcd.endpoint, "late", read_timeout=30) as b:
            waiting = asyncio.ensure_future(b.kv_set("k", b"v"))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(etcd.start)
            with anyio.fail_after(PROMPT):
                await waiting
            assert await b.kv_get(["k"]) == [b"v"]
    finally:
        etcd.close()


async def test_wrong_credentials_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with EtcdServer(auth=("root", PASSWORD)) as etcd:
        monkeypatch.setenv(ENV_USERNAME, "root")
        monkeypatch.setenv(ENV_PASSWORD, "wrong-" + PASSWORD)
        async with backend(etcd.endpoint, "auth") as b:
            with pytest.raises(RendezvousConnectionError, match=ENV_PASSWORD) as info:
                await b.kv_set("k", b"v")
        message = str(info.value)
        assert PASSWORD not in message and "\n" not in message
        monkeypatch.delenv(ENV_USERNAME)
        monkeypatch.delenv(ENV_PASSWORD)
        async with backend(etcd.endpoint, "auth") as b:
            with pytest.raises(RendezvousConnectionError, match="authentication"):
                await b.kv_set("k", b"v")
        monkeypatch.setenv(ENV_USERNAME, "root")
        monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
        async with group(etcd.endpoint, "auth-ok", 2, 2, 2) as handlers:
            assert_one_group(await join_all(handlers), 2)


async def test_nodes_beat_past_their_auth_tokens_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd's simple tokens expire after --auth-token-ttl (2 s) unused; the nodes beat every
    2.5 s (window 7.5 s) for longer than the window: nobody is dropped (etcd 3.4 renews a
    lease without looking at the token; a newer etcd that refuses the expired token has
    the node log in again), and the members' store, called with expired tokens, logs in
    again and works."""
    monkeypatch.setenv(ENV_USERNAME, "root")
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
    conf = {"keep_alive_interval": 2.5, "keep_alive_max_attempt": 3, "share_connections": 0}
    with EtcdServer(auth=("root", PASSWORD), token_ttl=2) as etcd:
        async with group(etcd.endpoint, "token-ttl", 2, 2, 2, **conf) as handlers:
            infos = await join_all(handlers)
            clients = [h.backend._shared.client for h in handlers]  # type: ignore[attr-defined]
            tokens = [c._token for c in clients]
            assert all(tokens)
            watchers = [asyncio.ensure_future(h.watch()) for h in handlers]
            await asyncio.sleep(8.0)  # past the window and the token's time to live
            assert not any(w.done() for w in watchers), [w.result() for w in watchers if w.done()]
            for w in watchers:
                w.cancel()
            await asyncio.sleep(2.5)
            await infos[0].store.set("after", "expiry")
            assert await infos[1].store.get("after") == b"expiry"
            assert all(c._token not in (None, t) for c, t in zip(clients, tokens, strict=True))
            assert len(etcd.keys("/aelastic/token-ttl/p/")) == 2


async def test_a_foreign_value_under_the_prefix_is_left_alone(server: EtcdServer) -> None:
    server.put("/aelastic/foreign/h", "not ours")
    async with group(server.endpoint, "foreign", 1, 1, 1) as handlers:
        with pytest.raises(RendezvousStateError, match="did not write") as info:
            await handlers[0].next_rendezvous()
    assert "\n" not in str(info.value) and "left as it is" in str(info.value)
    assert server.get("/aelastic/foreign/h") == b"not ours"
    assert server.keys("/aelastic/foreign/") == ["/aelastic/foreign/h"]


async def test_another_format_version_is_named_and_left_alone(server: EtcdServer) -> None:
    other = json.dumps({"format": "aelastic.rendezvous.state", "version": 9})
    server.put("/aelastic/newer/h", other)
    async with group(server.endpoint, "newer", 1, 1, 1) as handlers:
        with pytest.raises(RendezvousStateError, match="version 9"):
            await handlers[0].next_rendezvous()
    assert server.get("/aelastic/newer/h") == other.encode()


# -- losses ---------------------------------------------------------------------------------


async def test_a_silent_member_is_seen_lost_within_the_window(server: EtcdServer) -> None:
    """etcd drops a silent node's keys when its lease ends; a sentinel (ranks 0-2) writes
    the loss, and every member hears of it. Window: 0.5 s x 4 = 2 s."""
    conf = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 4}
    async with group(server.endpoint, "silent", 5, 2, 5, **conf) as handlers:
        infos = await join_all(handlers)
        by_rank = {info.rank: h for info, h in zip(infos, handlers, strict=True)}
        for victim_rank in (4, 0):  # not a sentinel, then one
            victim = by_rank.pop(victim_rank)
            await victim._heartbeats.stop()  # silent from now on, as if killed
            started = time.monotonic()
            views = await asyncio.wait_for(
                asyncio.gather(*(h.watch() for h in by_rank.values())), 2 + PROMPT
            )
            assert all(victim.node in v.lost for v in views)
            assert all(v.lost_count >= 1 for v in views)
            assert time.monotonic() - started < 2 + 0.5 + 4  # window + lease tick + slack
            infos = await join_all(list(by_rank.values()), 2 * PROMPT)
            assert_one_group(infos, len(by_rank))
            by_rank = {info.rank: h for info, h in zip(infos, by_rank.values(), strict=True)}


async def test_members_leaving_their_round_at_once_do_not_contend_on_one_key(
    server: EtcdServer,
) -> None:
    """Every member of a complete round leaves at once (the survivors of a lost node
    re-rendezvous so): each writes its own keys and mark, compared against them alone; only
    the first few, which fill the lost sample, write the header. So the leaves cost a read
    and a write each, plus a few retries for the sample: not one retry per member that
    left before (the header rewritten for each, every other leave retried: O(N^2))."""
    n = 32
    rules = Rules(n, n, last_call_ms=100, window_ms=30_000)
    nodes = [NodeDesc(f"10.0.1.{i}", 1, 0) for i in range(n)]
    secrets = [f"{i:032d}" for i in range(n)]
    params = RendezvousParameters("etcd", server.endpoint, "leaves", n, n, share_connections=0)
    backends = [create_backend(params) for _ in range(n)]
    try:
        joins = await asyncio.gather(*(
            b.apply(Request(Op.JOIN, node, rules, port=1, secret=s))
            for b, node, s in zip(backends, nodes, secrets, strict=True)
        ))  # fmt: skip
        assert sum(r.outcome is Outcome.FINISH for r in joins) >= 1
        for b, node, s, join in zip(backends, nodes, secrets, joins, strict=True):
            await _until(b, join.status, lambda seen: seen.complete)  # then it asks again
            done = await b.apply(Request(Op.JOIN, node, rules, port=1, secret=s))
            assert done.outcome is Outcome.FINISH and done.rank is not None
        clients = [b._shared.client for b in backends]  # type: ignore[union-attr]
        before = sum(c.requests for c in clients)
        leaves = await asyncio.gather(*(
            b.apply(Request(Op.LEAVE, node, rules, secret=s))
            for b, node, s in zip(backends, nodes, secrets, strict=True)
        ))  # fmt: skip
        spent = sum(c.requests for c in clients) - before
        assert all(r.transition is Transition.REMOVE for r in leaves)
        status = await backends[0].apply(Request(Op.STATUS, nodes[0], rules))
        assert status.status.round == 1 and not status.status.complete  # the next round
        # A read and a write each; the sample's four header writes and the next round's
        # make the others that wanted one retry, five times each at most; the sentinels'
        # status requests (the old way: ~n * n / 2 retries, 541 here).
        assert spent <= n * (2 + 5) + 3 * 4, spent
    finally:
        for b in backends:
            await b.aclose()


@pytest.mark.parametrize("slow_header_write", [False, True])
async def test_the_last_members_leaving_at_once_open_the_next_round(
    server: EtcdServer, slow_header_write: bool
) -> None:
    """Once the lost sample is full, a leave does not write the header: when the last
    members leave at once, each read counting the others, the one whose write may have
    been the last counts the participants at its revision and, finding none, opens the next
    round (a node on the wait list is not left waiting for a round that never opens). So
    does a leave that wrote the header (the first finished one) while the others wrote
    their own keys between its read and its write (its compare, on the header, held)."""
    n = 7
    rules = Rules(n, n, last_call_ms=100, window_ms=30_000)
    nodes = [NodeDesc(f"10.0.2.{i}", 1, 0) for i in range(n + 1)]
    secrets = [f"{i:032d}" for i in range(n + 1)]
    run = f"last-{int(slow_header_write)}"
    params = RendezvousParameters("etcd", server.endpoint, run, n, n, share_connections=0)
    backends = [create_backend(params) for _ in range(n + 1)]

    def request(i: int, op: Op, finished: bool = False) -> Request:
        return Request(op, nodes[i], rules, port=1, secret=secrets[i], finished=finished)

    try:
        joins = await asyncio.gather(*(backends[i].apply(request(i, Op.JOIN)) for i in range(n)))
        for i in range(n):
            await _until(backends[i], joins[i].status, lambda seen: seen.complete)
            assert (await backends[i].apply(request(i, Op.JOIN))).outcome is Outcome.FINISH
        for i in range(4):  # the lost sample is full
            await backends[i].apply(request(i, Op.LEAVE))
        waiting = await backends[n].apply(request(n, Op.JOIN))
        assert waiting.outcome is Outcome.WAIT and waiting.status.complete
        if slow_header_write:  # its write waits until the others' leaves are written
            port = backends[4]._port
            assert port is not None
            write = port._write

            async def slow(*args: Any) -> Any:
                await asyncio.sleep(0.5)
                return await write(*args)

            port._write = slow  # type: ignore[method-assign,assignment]
        started = time.monotonic()
        await asyncio.gather(*(
            backends[i].apply(request(i, Op.LEAVE, finished=slow_header_write and i == 4))
            for i in range(4, n)
        ))  # fmt: skip
        raw = server.call("/v3/kv/range", {"key": b64(backends[n].keys.header)})["kvs"][0]
        header = json.loads(base64.b64decode(raw["value"]))  # as the leaves left it
        assert header["round"] == 1 and not header["complete"], header
        await _until(backends[n], waiting.status, lambda seen: seen.round == 1)
        joined = await backends[n].apply(request(n, Op.JOIN))
        assert joined.outcome is Outcome.WAIT and joined.status.participants == 1
        assert time.monotonic() - started < PROMPT
    finally:
        for b in backends:
            await b.aclose()


async def test_a_heartbeat_wakes_nobody_and_costs_one_request(server: EtcdServer) -> None:
    conf = {"keep_alive_interval": 0.2}
    async with group(server.endpoint, "idle", 3, 3, 3, **conf) as handlers:
        await join_all(handlers)
        before = [h.stats.requests for h in handlers]
        watchers = [asyncio.ensure_future(h.watch()) for h in handlers]
        await asyncio.sleep(1.2)
        assert not any(w.done() for w in watchers)
        for w in watchers:
            w.cancel()
        beats = [h.stats.requests - b for h, b in zip(handlers, before, strict=True)]
        assert all(3 <= n <= 8 for n in beats), beats  # one request per beat, ~6 each


async def test_a_nodes_lease_lives_the_runs_window_not_its_requests(server: EtcdServer) -> None:
    """A node whose first join carried a 1 ms window is refused (the run's is 6 s); joined
    with the run's rules, its key lives on a lease of the run's window, and the key's value
    (which holds the node's secret) is in no snapshot."""
    rules = Rules(2, 2, last_call_ms=100, window_ms=6_000)
    first, second = NodeDesc("10.0.0.1", 1, 0), NodeDesc("10.0.0.2", 1, 0)
    async with (
        backend(server.endpoint, "lease-window") as a,
        backend(server.endpoint, "lease-window") as b,
    ):
        await a.apply(Request(Op.JOIN, first, rules, port=1, secret="a" * 32))
        tiny = dataclasses.replace(rules, window_ms=1)
        refused = await b.apply(Request(Op.JOIN, second, tiny, port=2, secret="b" * 32))
        assert refused.outcome is Outcome.ERROR_RULES and refused.run_rules == rules
        joined = await b.apply(Request(Op.JOIN, second, rules, port=2, secret="b" * 32))
        assert joined.outcome is Outcome.FINISH and joined.rank == 1
        raw = server.call("/v3/kv/range", {"key": b64(b.keys.member("p", second))})["kvs"][0]
        lease = server.call("/v3/lease/timetolive", {"ID": raw["lease"]})
        assert int(lease["grantedTTL"]) == 6 + SLACK  # the window, and etcd's own delay
        snapshot = await b.snapshot()
    assert snapshot is not None and snapshot.rules == rules
    assert "b" * 32 not in repr(snapshot) and "b" * 32 in base64.b64decode(raw["value"]).decode()


async def test_a_forged_request_through_the_nodes_own_backend_changes_nothing(
    server: EtcdServer,
) -> None:
    """A keep-alive and a join naming a member with another secret (any text, not only hex)
    sent through the backend that holds the member's lease: refused, the round as it was."""
    async with group(server.endpoint, "forged-own", 2, 2, 2) as handlers:
        await join_all(handlers)
        member, backend = handlers[0], handlers[0].backend
        before = await backend.snapshot()
        rules = member.settings.rules
        for op in (Op.KEEP_ALIVE, Op.JOIN, Op.LEAVE):
            reply = await backend.apply(Request(op, member.node, rules, secret="nœud"))
            assert reply.outcome is Outcome.ERROR_FORBIDDEN and not reply.known, op
        after = await backend.snapshot()
        assert before is not None and after is not None
        assert after.ranks() == before.ranks() and not after.status.closed
        assert (await member.keep_alive(0.0)).known  # the member's own: still listed


async def test_a_busy_member_is_waited_for_and_never_sent_a_request_twice(
    server: EtcdServer,
) -> None:
    """The only member stops answering for longer than a request's patience and its status
    probe's (SIGSTOP): the write is waited for, not sent again (a busy etcd must not be
    given twice the work): one request, at most one status probe, one version more."""
    client = EtcdClient(parse_endpoint(server.endpoint, {}), read_timeout=30)
    key = b64("/busy/k")
    try:
        await client.call("/v3/kv/put", {"key": key, "value": b64("0")}, "put")
        assert server.process is not None
        sent = client.requests
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            body = {"key": key, "value": b64("1")}
            put = asyncio.ensure_future(client.call("/v3/kv/put", body, "put"))
            await asyncio.sleep(2 * SLOW + 0.5)  # the probe of the member timed out meanwhile
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        await asyncio.wait_for(put, PROMPT)
        # The write once, and the probe unless a starved loop sent it after the member woke.
        assert client.requests - sent in (1, 2)
    finally:
        await client.aclose()
    assert server.call("/v3/kv/range", {"key": key})["kvs"][0]["version"] == "2"


async def test_an_only_member_slow_to_accept_is_given_the_calls_time() -> None:
    """The only member's accept queue is full (it drops new connections' SYNs, as a busy
    etcd does): the call waits within its budget instead of connecting again every 2 s
    (each try would add to that backlog); it then fails naming the endpoint."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue
            client = EtcdClient(parse_endpoint(f"127.0.0.1:{port}", {}), read_timeout=4.5)
            try:
                with pytest.raises(RendezvousConnectionError, match="could not be reached"):
                    await client.call("/v3/kv/range", {"key": b64("k")}, "read")
                assert client.requests == 2  # the call and one status probe
            finally:
                await client.aclose()


# -- a 3-member cluster ---------------------------------------------------------------------


async def test_a_round_forms_and_keeps_its_store_across_a_leader_kill() -> None:
    with EtcdCluster(3) as cluster:
        conf = {"keep_alive_interval": 0.5, "read_timeout": 20}
        async with group(cluster.endpoint, "failover", 3, 3, 3, **conf) as handlers:
            infos = await join_all(handlers)
            await infos[0].store.set("before", "kill")
            watchers = [asyncio.ensure_future(h.watch()) for h in handlers]
            await asyncio.to_thread(cluster.leader().kill)
            await asyncio.to_thread(cluster.leader)  # another is elected
            await infos[1].store.set("after", "kill")
            assert await infos[2].store.get("before") == b"kill"
            assert await infos[0].store.get("after") == b"kill"
            await asyncio.sleep(2.0)  # two windows: nobody was dropped meanwhile
            assert not any(w.done() for w in watchers), [w.result() for w in watchers if w.done()]
            for w in watchers:
                w.cancel()


async def test_runs_are_listed_one_range_each(server: EtcdServer) -> None:
    prefix = {"etcd_prefix": "/listing"}
    async with (
        group(server.endpoint, "job/a", 1, 1, 1, **prefix) as a,
        group(server.endpoint, "job-b", 2, 1, 2, **prefix) as b,
    ):
        await join_all(a)
        await join_all(b)
        server.put("/listing/foreign/h", "not ours")
        async with backend(server.endpoint, "lister", **prefix) as lister:
            runs = await lister.list_runs(10)
            assert [(run, s.participants) for run, s in runs] == [("job-b", 2), ("job/a", 1)]
            assert len(await lister.list_runs(1)) == 1
            assert await lister.reset() is False  # the lister's own run has no keys


async def test_the_retry_budget_runs_once_per_outage() -> None:
    """A call made during an outage gets what is left of read_timeout (at least one more
    attempt); once etcd answered, the next outage has a whole budget again."""
    etcd = EtcdServer()
    try:
        async with backend(etcd.endpoint, "budget", read_timeout=3) as b:
            loop = asyncio.get_running_loop()
            started = loop.time()
            first = asyncio.ensure_future(b.kv_get(["k"]))
            await asyncio.sleep(1.5)
            with pytest.raises(RendezvousConnectionError):
                await b.kv_get(["k"])
            late = loop.time() - started
            with pytest.raises(RendezvousConnectionError):
                await first
            assert late < 4.2, late  # what was left of the outage's 3 s (whole: 4.5 s)
            await asyncio.to_thread(etcd.start)
            assert await b.kv_get(["k"]) == [None]
            await asyncio.to_thread(etcd.kill)
            again = loop.time()
            with pytest.raises(RendezvousConnectionError):
                await b.kv_get(["k"])
            assert loop.time() - again >= 2.5  # a whole budget for the new outage
    finally:
        etcd.close()


# -- the requests of a formation --------------------------------------------------------------


async def test_a_formation_costs_each_node_a_watch_one_write_to_join_and_one_read(
    server: EtcdServer,
) -> None:
    """A node's first join grants its lease, joins and renews the lease in one write (three
    requests, one round trip: the lease counts from the join); it reads the count its join
    made (beside etcd's apply loop) only when the revisions since the run began leave room
    for it to have made min_nodes; once the round completes, each node renews its lease and
    reads its rank at the round's cut in one write. Per node: its watch, those three and
    those two (six); the join that may have made min_nodes reads the count, and the one
    that completes the round also reads and writes the header."""
    conf = {"keep_alive_interval": 5, "share_connections": 0}  # no beat falls due meanwhile
    async with group(server.endpoint, "requests", 4, 4, 4, **conf) as handlers:
        infos = await join_all(handlers)
        assert_one_group(infos, 4)
        sent = sorted(h.backend._shared.client.requests for h in handlers)  # type: ignore[attr-defined]
    # 1 watch + grant/join/renew + renew/rank read = 6 (the first three joins of four:
    # the creator counts in its write, the next two cannot have made 4); one more status
    # read for a node whose watch went live only after its join was answered (a loaded
    # machine); a sentinel (ranks 0-2) opens its watch again to hear of lost members; the
    # fourth join counts, reads and writes the header and renews.
    assert 6 <= sent[0] <= 8, sent
    assert sent[-1] <= 6 + 1 + 1 + 3, sent


async def test_a_member_woken_by_the_completion_renews_its_lease_with_its_rank(
    server: EtcdServer,
) -> None:
    """A member woken by its round's completion renews its lease while it reads its rank,
    however recently it renewed before: its heartbeats start after that answer
    (the first at a random point of the interval), so a lease left to count from the
    member's beat before the completion went that long, the completion's reads and up to an
    interval unrenewed, and under load ran out. A heartbeat renews whenever it comes (a
    first one soon after the completion was skipped: another interval). Window 20 s: a
    fifth of it is 4 s."""
    rules = Rules(2, 2, last_call_ms=100, window_ms=20_000)
    first, second = NodeDesc("10.0.0.1", 1, 0), NodeDesc("10.0.0.2", 1, 0)
    run = "renew-at-completion"
    async with (
        backend(server.endpoint, run, share_connections=0) as a,
        backend(server.endpoint, run, share_connections=0) as b,
    ):
        waiting = await a.apply(Request(Op.JOIN, first, rules, port=1, secret="a" * 32))
        assert waiting.outcome is Outcome.WAIT
        await asyncio.sleep(2.5)  # the lease renewed 2.5 s ago: less than a fifth
        last = await b.apply(Request(Op.JOIN, second, rules, port=2, secret="b" * 32))
        assert last.outcome is Outcome.FINISH and last.rank == 1
        seen = await a.wait_for_change(waiting.status.token, PROMPT)  # a's watch
        assert seen is not None and seen.complete
        assert a._stream is not None and a._stream.cut is not None and a._shared is not None
        sent = a._shared.client.requests
        woken = await a.apply(Request(Op.JOIN, first, rules, port=1, secret="a" * 32))
        assert woken.outcome is Outcome.FINISH and woken.rank == 0
        assert a._shared.client.requests - sent == 2  # the renewal (stream) and the rank
        raw = server.call("/v3/kv/range", {"key": b64(a.keys.member("p", first))})["kvs"][0]
        lease = server.call("/v3/lease/timetolive", {"ID": raw["lease"]})
        assert int(lease["TTL"]) >= 18, lease  # counts from the completion, not 2.5 s before
        assert a._leases is not None  # a heartbeat right after renews too
        renewed = a._leases._ids[first][1]
        beat = await a.apply(Request(Op.KEEP_ALIVE, first, rules, secret="a" * 32))
        await a._leases.settled()  # (renewed in the background: the beat did not wait)
        assert beat.known and a._leases._ids[first][1] > renewed


async def test_a_node_renews_the_lease_its_keys_are_on(server: EtcdServer) -> None:
    """A join sent again after its answer was lost may have granted another lease than the
    one its first sending attached: the next read finds the key's lease and renews that."""
    rules = Rules(2, 2, last_call_ms=100, window_ms=6_000)
    node = NodeDesc("10.0.0.9", 1, 0)
    async with backend(server.endpoint, "adopt") as b:
        await b.apply(Request(Op.JOIN, node, rules, port=1, secret="c" * 32))
        raw = server.call("/v3/kv/range", {"key": b64(b.keys.member("p", node))})["kvs"][0]
        assert b._leases is not None
        other = int(server.call("/v3/lease/grant", {"TTL": 6})["ID"])
        b._leases.adopt(node, other, rules.window_ms)  # as a second sending would have
        await b.apply(Request(Op.STATUS, node, rules, secret="c" * 32))
        reply = await b.apply(Request(Op.JOIN, node, rules, port=1, secret="c" * 32))
        assert reply.outcome is Outcome.WAIT
        assert b._leases.of(node) == int(raw["lease"])


def test_a_calls_refusal_is_etcds_error_with_its_code() -> None:
    from aelastic.backends.etcd._answers import LeaseNotFound, etcd_error, retryable

    refused = etcd_error("etcdserver: request timed out", 14)
    assert refused.code == 14 and retryable(refused)
    gone = etcd_error("etcdserver: requested lease not found", 5)
    assert isinstance(gone, LeaseNotFound) and not retryable(gone)


async def test_pipelined_answers_are_matched_to_their_requests(server: EtcdServer) -> None:
    """Many keep-alives at once on one client, several per write: each answer names the
    lease its request renewed (a dead lease answers without a time to live)."""
    client = EtcdClient(parse_endpoint(server.endpoint, {}))
    try:
        live = int((await client.call("/v3/lease/grant", {"TTL": 30}, "grant"))["ID"])

        async def batch(i: int) -> None:
            ids = [live if (i + j) % 3 == 0 else 1_000_000 + 10 * i + j for j in range(3)]
            make = lambda: [("/v3/lease/keepalive", {"ID": str(n)}) for n in ids]  # noqa: E731
            answers = await client.call_many(make, "keep-alive")
            for n, answer in zip(ids, answers, strict=True):
                assert isinstance(answer, dict)
                assert int(answer["ID"]) == n
                assert (int(answer.get("TTL", 0)) > 0) == (n == live)

        await asyncio.gather(*(batch(i) for i in range(60)))
    finally:
        await client.aclose()
