"""Lease renewals on etcd's keep-alive stream, against a real etcd: one stream per client,
each node's lease its own, a stream that breaks opened again, a killed process's leases
running out with it."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic import RendezvousConnectionError, RendezvousParameters
from aelastic.backends.etcd import create_backend, parse_endpoint
from aelastic.backends.etcd._client import EtcdClient
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request
from tests._etcd_server import EtcdServer, b64
from tests._redis_server import RedisServer

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
RULES = Rules(3, 3, last_call_ms=100, window_ms=2_000)  # a lease of 2 s


@pytest.fixture(scope="module")
def server() -> Iterator[EtcdServer]:
    with EtcdServer() as etcd:
        yield etcd


def keep_alive_streams(server: EtcdServer) -> tuple[int, int]:
    """etcd's count of keep-alive streams opened and keep-alive messages received."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()

    def total(metric: str) -> int:
        pattern = rf'^{metric}\{{[^}}]*grpc_method="LeaseKeepAlive"[^}}]*\}} (\S+)$'
        return int(sum(float(v) for v in re.findall(pattern, text, re.M)))

    return total("grpc_server_started_total"), total("grpc_server_msg_received_total")


def ttl_of(server: EtcdServer, key: str) -> int:
    """The time to live left of the lease ``key`` is on (-1: the key is gone)."""
    kvs = server.call("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
    if not kvs:
        return -1
    answer = server.call("/v3/lease/timetolive", {"ID": kvs[0]["lease"]})
    return int(answer.get("TTL", -1))


async def test_the_nodes_of_a_process_renew_on_one_stream_each_lease_its_own(
    server: EtcdServer,
) -> None:
    """Two nodes whose backends share the event loop's client beat on one keep-alive
    stream (one message per beat, no new stream); the node that stops beating loses its
    lease alone, within its time to live, while the other's lives on."""
    run, nodes = "one-stream", [NodeDesc("10.0.1.1", 1, 0), NodeDesc("10.0.1.2", 1, 0)]
    backends = [
        create_backend(RendezvousParameters("etcd", server.endpoint, run, 3, 3)) for _ in nodes
    ]
    try:
        for i, (b, node) in enumerate(zip(backends, nodes, strict=True)):
            reply = await b.apply(Request(Op.JOIN, node, RULES, port=i + 1, secret=f"{i}" * 32))
            assert reply.outcome is Outcome.WAIT
        beats = [Request(Op.KEEP_ALIVE, n, RULES, secret=f"{i}" * 32) for i, n in enumerate(nodes)]
        await asyncio.gather(*(b.apply(r) for b, r in zip(backends, beats, strict=True)))
        streams, messages = keep_alive_streams(server)
        began = time.monotonic()
        for _ in range(5):
            replies = await asyncio.gather(
                *(b.apply(r) for b, r in zip(backends, beats, strict=True))
            )
            assert all(r.known for r in replies)
            for b in backends:  # renewed in the background: the beat did not wait
                assert b._leases is not None
                await b._leases.settled()
        streams_after, messages_after = keep_alive_streams(server)
        assert streams_after == streams  # the stream was open: no new one
        # One message per beat; on a loaded machine a request that takes a third of the
        # lease's time to live also has its lease renewed beside it (``Leases.kept``): at
        # most one more per node per elapsed second here.
        extra = messages_after - messages - 10
        assert 0 <= extra <= 2 * math.ceil(time.monotonic() - began), extra
        keys = [backends[0].keys.member("p", n) for n in nodes]
        stopped = time.monotonic()
        while ttl_of(server, keys[1]) >= 0:  # the second node is silent from now on
            assert time.monotonic() - stopped < 2 + 3, "its lease outlived its time to live"
            assert (await backends[0].apply(beats[0])).known
            await asyncio.sleep(0.4)
        assert ttl_of(server, keys[0]) > 0
    finally:
        for b in backends:
            await b.aclose()


async def test_a_broken_stream_is_opened_again_and_no_renewal_is_lost() -> None:
    """etcd restarted under a beating node: the renewals waiting on the broken stream are
    sent again on a new one once etcd is back (within the call's time), and the lease lives."""
    with EtcdServer() as etcd:
        client = EtcdClient(parse_endpoint(etcd.endpoint, {}), read_timeout=30)
        try:
            lease = int((await client.call("/v3/lease/grant", {"TTL": 30}, "grant"))["ID"])
            assert int((await client.keep_alive(lease))["TTL"]) > 0
            etcd.kill()
            renewing = asyncio.ensure_future(client.keep_alive(lease))
            await asyncio.sleep(1.0)
            assert not renewing.done()
            etcd.start()
            answer = await asyncio.wait_for(renewing, 30)
            assert int(answer["TTL"]) > 0
        finally:
            await client.aclose()


async def test_a_renewal_of_a_lease_etcd_does_not_know_says_it_is_gone(
    server: EtcdServer,
) -> None:
    client = EtcdClient(parse_endpoint(server.endpoint, {}))
    try:
        live = int((await client.call("/v3/lease/grant", {"TTL": 30}, "grant"))["ID"])
        answers = await asyncio.gather(*(client.keep_alive(n) for n in (live, 12345, live)))
        ttls = [int(a.get("TTL", 0)) for a in answers]
        assert ttls[0] > 0 and ttls[1] == 0 and ttls[2] > 0
        assert [int(a["ID"]) for a in answers] == [live, 12345, live]
    finally:
        await client.aclose()


async def test_a_keep_alive_to_a_port_without_etcd_is_one_clear_line() -> None:
    with RedisServer() as redis:
        client = EtcdClient(parse_endpoint(f"127.0.0.1:{redis.port}", {}), read_timeout=20)
        try:
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="does not answer etcd") as info:
                await client.keep_alive(1)
        finally:
            await client.aclose()
    assert time.monotonic() - started < 10
    assert str(redis.port) in str(info.value) and "\n" not in str(info.value)


_NODES = textwrap.dedent(
    """
    import asyncio, json, sys
    from aelastic import RendezvousParameters
    from aelastic.backends.etcd import create_backend
    from aelastic.core.params import Rules
    from aelastic.core.state import NodeDesc, Op, Request

    async def main():
        rules = Rules(3, 3, last_call_ms=100, window_ms=2_000)
        params = RendezvousParameters("etcd", sys.argv[1], "killed", 3, 3)
        nodes = [NodeDesc("10.0.2.1", 1, 0), NodeDesc("10.0.2.2", 1, 0)]
        backends = [create_backend(params) for _ in nodes]
        for i, (b, n) in enumerate(zip(backends, nodes)):
            await b.apply(Request(Op.JOIN, n, rules, port=i + 1, secret=str(i) * 32))
        print(json.dumps([backends[0].keys.member("p", n) for n in nodes]), flush=True)
        while True:  # both beat on the process's one stream
            for i, (b, n) in enumerate(zip(backends, nodes)):
                await b.apply(Request(Op.KEEP_ALIVE, n, rules, secret=str(i) * 32))
            await asyncio.sleep(0.3)

    asyncio.run(main())
    """
)


async def test_a_killed_process_takes_its_stream_and_its_nodes_leases_with_it(
    server: EtcdServer,
) -> None:
    """A process whose two nodes beat on its one stream is SIGKILLed: both leases run out
    within their time to live (they died together), while a node of another process, on
    another stream, keeps its own."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _NODES, server.endpoint,
        cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    survivor = NodeDesc("10.0.2.3", 1, 0)
    b = create_backend(RendezvousParameters("etcd", server.endpoint, "killed", 3, 3))
    try:
        assert child.stdout is not None
        keys = json.loads(await asyncio.wait_for(child.stdout.readline(), 60))
        await b.apply(Request(Op.JOIN, survivor, RULES, port=3, secret="s" * 32))
        await asyncio.sleep(1.0)
        assert all(ttl_of(server, k) > 0 for k in keys)  # beating
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), 10)
        killed = time.monotonic()
        beat = Request(Op.KEEP_ALIVE, survivor, RULES, secret="s" * 32)
        while any(ttl_of(server, k) >= 0 for k in keys):
            assert time.monotonic() - killed < 2 + 3, "a killed node's lease lived on"
            await b.apply(beat)
            await asyncio.sleep(0.4)
        assert ttl_of(server, b.keys.member("p", survivor)) > 0
    finally:
        if child.returncode is None:
            child.kill()
            await asyncio.wait_for(child.wait(), 10)
        await b.aclose()


async def test_a_heartbeat_renews_its_lease_before_a_full_request(server: EtcdServer) -> None:
    """A heartbeat that cannot be answered from the watch (the watch is down: a round's
    first members open theirs again when it completes, to hear of lost members) is a full
    request, a read that a busy etcd takes seconds over when a whole round sends one at
    once: it renews the node's lease first, then reads."""
    nodes = [NodeDesc(f"10.0.1.{i}", 1, 0) for i in range(2)]
    params = RendezvousParameters("etcd", server.endpoint, "beat-first", 2, 2, share_connections=0)
    backends = [create_backend(params) for _ in nodes]
    rules = Rules(2, 2, last_call_ms=100, window_ms=20_000)
    try:
        joins = [
            b.apply(Request(Op.JOIN, n, rules, port=1, secret=f"{i}" * 32))
            for i, (n, b) in enumerate(zip(nodes, backends, strict=True))
        ]
        replies = await asyncio.gather(*joins)
        while replies[0].outcome is Outcome.WAIT:
            await backends[0].wait_for_change(replies[0].status.token, 5)
            replies[0] = await backends[0].apply(
                Request(Op.JOIN, nodes[0], rules, port=1, secret="0" * 32)
            )
        a = backends[0]
        assert a._stream is not None and a._shared is not None
        a._stream.watch.on_lost()  # what the stream does when its connection fails
        client, order = a._shared.client, []
        keep_alive, call_many = client.keep_alive, client.call_many

        async def renewing(*args: object, **kw: object) -> object:
            order.append("renew")
            return await keep_alive(*args, **kw)  # type: ignore[arg-type]

        async def calling(*args: object, **kw: object) -> object:
            order.append("call")
            return await call_many(*args, **kw)  # type: ignore[arg-type]

        client.keep_alive, client.call_many = renewing, calling  # type: ignore[method-assign]
        beat = await a.apply(Request(Op.KEEP_ALIVE, nodes[0], rules, secret="0" * 32))
        assert beat.known, beat
        assert order[:2] == ["renew", "call"], order
    finally:
        for b in backends:
            await b.aclose()


async def test_a_lease_is_kept_while_its_node_waits_for_a_slow_request(
    server: EtcdServer,
) -> None:
    """A request of a node's that etcd takes longer over than the lease's time to live (a
    busy etcd's join): the lease is renewed meanwhile, a third of its time to live after the
    last renewal; a node that waits without it loses its lease."""
    from aelastic.backends.etcd._leases import Leases

    client = EtcdClient(parse_endpoint(server.endpoint, {}))
    kept, left = NodeDesc("10.0.0.1", 1, 0), NodeDesc("10.0.0.2", 2, 0)
    leases = Leases(client, ttl=2)
    try:
        for node in (kept, left):
            await leases.grant(node, 2_000)
        async with leases.kept(kept):
            await asyncio.sleep(3.5)  # the slow request
        for node, alive in ((kept, True), (left, False)):
            answer = await client.call("/v3/lease/timetolive", {"ID": leases.of(node)}, "ttl")
            assert (int(answer.get("TTL", -1)) > 0) is alive, (node, answer)
    finally:
        await client.aclose()
