"""The etcd client against a hostile HTTP/2 server: whatever the server sends, a node's memory
and event loop stay bounded, and the call fails within its timeout naming the server and
what it did.

The server is a real process on a loopback port speaking raw frames (tests/_h2_hostile.py);
the client is aelastic's, in this process, making one call with a read timeout of 10 s.
How it is measured, while the call runs and for a second after it failed:

* memory: the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
  before the call) less its resident set before the call, under 64 MiB;
* the event loop: a ticker task wakes every 5 ms and records the longest time between two
  of its ticks in CPU time of the loop's thread (``time.thread_time``): what the loop spent
  in other work before the ticker could run again, under 100 ms. The wall-clock gap is
  recorded too, but not asserted: on a shared 2-core machine the process waits for a core
  too, which is no block of the loop;
* CPU after the failure: the loop's thread spends under 0.2 s in the second after it (the
  connection is closed: a flood does not go on).
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pytest

from aelastic.backends.etcd._client import EtcdClient, b64
from aelastic.backends.etcd._endpoint import parse_endpoint
from aelastic.backends.etcd._limits import MAX_HEADER_BLOCK, MAX_HEADER_FRAMES, MAX_MESSAGE
from aelastic.core.errors import RendezvousConnectionError
from tests._h2_hostile import HostileServer

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc"),
]

READ_TIMEOUT = 10.0
MEMORY = 64 << 20
BLOCK = 0.1
CPU_AFTER = 0.2


def _status(field: str) -> int:
    """A field of ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset the process's peak resident set to what it holds now (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Ticker:
    """The longest gaps between the ticks of a task that wakes every 5 ms."""

    busy: float = 0.0  # the loop thread's CPU time between two ticks
    gap: float = 0.0  # the wall-clock time between two ticks
    peak_rss: int = 0  # sampled at each tick (when the peak cannot be reset)

    async def _run(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(0.005)
            now_wall, now_cpu = time.perf_counter(), time.thread_time()
            self.gap = max(self.gap, now_wall - wall)
            self.busy = max(self.busy, now_cpu - cpu)
            self.peak_rss = max(self.peak_rss, _status("VmRSS"))
            wall, cpu = now_wall, now_cpu

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.ensure_future(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


#: Each mode of the hostile server and what the error says it did.
CASES = {
    "oversized-headers": f"a HEADERS frame of {(1 << 24) - 1} bytes",
    "endless-continuation": f"a header block of more than {MAX_HEADER_FRAMES} frames",
    "ping-flood": "flood; the last: PING",
    "settings-flood": "flood; the last: SETTINGS",
    "endless-answer": "a second gRPC message in a unary call's answer",
    "huge-message": f"a gRPC message of {(1 << 32) - 1} bytes .this side takes {MAX_MESSAGE}",
    "huffman": f"a header block of more than {MAX_HEADER_BLOCK} bytes",
    "empty-data": "flood; the last: an empty DATA frame",
}


@pytest.mark.parametrize("mode", list(CASES))
async def test_a_hostile_server_neither_bloats_nor_blocks_a_node(mode: str) -> None:
    with HostileServer(mode) as server:
        client = EtcdClient(parse_endpoint(server.endpoint, {}), read_timeout=READ_TIMEOUT)
        gc.collect()
        base = _status("VmRSS")
        exact = _reset_peak()
        try:
            async with Ticker() as ticker:
                started = time.monotonic()
                with pytest.raises(RendezvousConnectionError) as info:
                    await client.call("/v3/kv/range", {"key": b64("k")}, "a range")
                took = time.monotonic() - started
                cpu = time.thread_time()
                await asyncio.sleep(1.0)
                after = time.thread_time() - cpu
            peak = (_status("VmHWM") if exact else ticker.peak_rss) - base
        finally:
            await client.aclose()
    said = str(info.value)
    print(
        f"{mode}: failed in {took:.2f} s, peak +{peak / 2**20:.1f} MiB, loop busy "
        f"{ticker.busy * 1000:.0f} ms at most (wall gap {ticker.gap * 1000:.0f} ms), "
        f"{after * 1000:.0f} ms of CPU in the second after: {said}"
    )
    assert server.endpoint in said and "broke etcd's protocol" in said, said
    assert re.search(CASES[mode], said), said
    assert took < READ_TIMEOUT, took
    assert peak < MEMORY, peak
    assert ticker.busy < BLOCK, ticker.busy
    assert after < CPU_AFTER, after


async def test_the_message_cap_is_far_above_a_1024_node_snapshot() -> None:
    """The largest answer aelastic asks for in a run, a status snapshot (the header, every
    participant's key and value, the other lists' keys), at 1,024 participants with long
    host names, on a real etcd: the cap is 50 times its size and more."""
    from aelastic.backends.etcd._layout import RunKeys, member_value, prefix_end
    from aelastic.backends.etcd._pool import Pool
    from aelastic.backends.etcd._proto import METHODS, encode
    from aelastic.backends.etcd._reads import range_op
    from aelastic.core.state import NodeDesc
    from tests._etcd_server import EtcdServer

    keys = RunKeys("/aelastic", "a-training-job-of-1024-nodes")
    with EtcdServer() as etcd:
        client = EtcdClient(parse_endpoint(etcd.endpoint, {}))
        try:
            lease = (await client.call("/v3/lease/grant", {"TTL": 60}, "grant"))["ID"]
            nodes = [NodeDesc(f"gpu-node-{i:04d}.cluster.example.com", 40000 + i, 0)
                     for i in range(1024)]  # fmt: skip
            for start in range(0, len(nodes), 100):  # etcd takes 128 operations a txn
                puts = [
                    {"request_put": {"key": b64(keys.member("p", n)), "lease": lease,
                                     "value": b64(member_value(29500, "f" * 32))}}
                    for n in nodes[start : start + 100]
                ]  # fmt: skip
                await client.call("/v3/kv/txn", {"success": puts}, "put")
            every = [
                range_op(p, prefix_end(p), keys_only=p != keys.participants)
                for p in (keys.participants, keys.waiting, keys.redundant)
            ]
            body = {"success": [range_op(keys.header), *every]}
            pool = Pool()
            try:
                [answer] = await pool.exchange(
                    "127.0.0.1", etcd.client_port,
                    [(METHODS["/v3/kv/txn"].path, encode(METHODS["/v3/kv/txn"].request, body))],
                    (), 10.0, 10.0,
                )  # fmt: skip
            finally:
                await pool.aclose()
        finally:
            await client.aclose()
    size = len(answer.messages[0])
    print(f"a 1,024-node snapshot's answer: {size} bytes ({size / 1024:.0f} bytes a node)")
    assert answer.code == 0 and 1024 * 100 < size < MAX_MESSAGE / 50, size


# -- a member that takes the connection and never answers -----------------------------------


async def test_a_silent_member_fails_a_request_within_its_read_timeout() -> None:
    with HostileServer("silent") as server:
        client = EtcdClient(parse_endpoint(server.endpoint, {}), read_timeout=3)
        started = time.monotonic()
        try:
            with pytest.raises(RendezvousConnectionError) as info:
                await client.call("/v3/kv/range", {"key": b64("k")}, "a range")
        finally:
            await client.aclose()
    took = time.monotonic() - started
    assert 2.5 < took < 3 + 3, took
    said = str(info.value)
    assert "could not be reached within 3 s (a range)" in said and server.endpoint in said


async def test_a_join_to_a_silent_member_ends_within_the_join_timeout(run_id: str) -> None:
    """Whatever the read timeout (60 s here), the join gives up once its own timeout ran
    out, naming the endpoint; meanwhile the client tried again (and said so) each time the
    member said nothing for 10 s."""
    from aelastic import RendezvousParameters
    from aelastic.core.events import BackendRetry
    from aelastic.rendezvous import create_handler

    with HostileServer("silent") as server:
        params = RendezvousParameters(
            "etcd", server.endpoint, run_id, 1, 1, join_timeout=12, read_timeout=60
        )
        handler = create_handler(params)
        retries: list[tuple[float, BackendRetry]] = []
        handler.hub.add_listener(
            lambda e: retries.append((time.monotonic(), e)) if isinstance(e, BackendRetry) else 0
        )
        started = time.monotonic()
        try:
            with pytest.raises(RendezvousConnectionError) as info:
                await handler.next_rendezvous()
        finally:
            await handler.aclose()
    took = time.monotonic() - started
    assert 12 < took < 12 + 5, took
    said = str(info.value)
    assert server.endpoint in said and "within its join timeout (12 s)" in said, said
    assert retries and 9 < retries[0][0] - started < 12, retries
    assert "said nothing for 10 s" in retries[0][1].error, retries
