"""The Redis client of one event loop and endpoint: commands, and notifications of runs.

How it works: the backends of one ``(event loop, endpoint)`` share a :class:`RedisClient`
(see :mod:`aelastic.backends._shared`): at most ``max_connections`` commands connections
and one pub/sub connection, to a standalone server, a Sentinel-managed primary or a Cluster
(:mod:`._servers`). Commands issued in the same loop iteration go out as one pipeline
(identical reads run once); a batch with writes that replicas should hold (``wait_replicas``)
ends with one ``WAIT``. The listener task subscribes to the channel of every run in use and
feeds each run's :class:`~aelastic.backends._watch.RunWatch`: ``s<status JSON>`` messages
become status news, ``k<key>`` messages wake the waiters of a store key. So a round
transition costs one message per process however many nodes wait, and a heartbeat costs
none. The listener pings the server when idle, reconnects with backoff (to the primary the
sentinels name now, or to another cluster node), resubscribes, and tells every watch when
notifications were lost (their waiters re-check with the server once resubscribed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import anyio
from redis.exceptions import RedisClusterException, RedisError

from ...core.state import Status
from ...core.wire import WireError, status_from_json
from .._watch import RunWatch
from ._endpoint import RedisEndpoint
from ._resp import RespConnection, pack
from ._servers import CONNECT_TIMEOUT, Batch, make_server

__all__ = ["CONNECT_TIMEOUT", "RedisClient"]

log = logging.getLogger("aelastic.backends.redis")

#: How long ``WAIT`` waits for the replicas (ms); when they do not all answer in time,
#: batches stop waiting for :data:`WAIT_PAUSE` seconds (the store stays available).
WAIT_TIMEOUT_MS = 1000
WAIT_PAUSE = 10.0


class _Pending(NamedTuple):
    args: tuple[Any, ...]
    shareable: bool
    route: str | None
    durable: str | None
    future: asyncio.Future[Any]


class RedisClient:
    """Command pool and pub/sub listener of one endpoint on one event loop.

    Args:
        endpoint: Where Redis is.
        max_connections: Size of the command pool (config key ``max_connections``).
        health_interval: Idle seconds after which the listener pings the server.
        wait_replicas: Replicas that must acknowledge a batch's durable writes before its
            replies are given (``WAIT``; 0: none).
    """

    def __init__(
        self,
        endpoint: RedisEndpoint,
        max_connections: int,
        health_interval: float,
        wait_replicas: int = 0,
    ):
        self.endpoint = endpoint
        self._health_interval = health_interval
        self.server = make_server(endpoint, max_connections)
        self._slots = asyncio.Semaphore(max_connections)
        self.wait_replicas = wait_replicas
        self._wait_paused_until = 0.0
        self._replicas_short = False
        #: Where the listener is subscribed (host, port), while it is.
        self.subscribed_at: tuple[str, int] | None = None
        self._watches: dict[bytes, tuple[RunWatch, int]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._conn: RespConnection | None = None
        self._sent: set[bytes] = set()
        self._unacked: dict[bytes, int] = {}  # (UN)SUBSCRIBEs sent, not yet confirmed
        self.listener_failing = False
        self._loading: asyncio.Future[None] | None = None
        self._pending: list[_Pending] = []
        self._batches: set[asyncio.Task[None]] = set()

    # -- commands -------------------------------------------------------------------------

    async def command(
        self,
        *args: Any,
        within: float,
        shareable: bool = False,
        route: str | None = None,
        durable: str | None = None,
    ) -> Any:
        """Run one command, pipelined with the others issued in the same loop iteration.

        Args:
            *args: The command and its arguments.
            within: Seconds to wait for the reply (``asyncio.TimeoutError`` after).
            shareable: The command only reads: identical ones of one batch run once.
            route: A key whose cluster node runs the command (for commands without keys).
            durable: The command writes this key, and the reply should come once the
                replicas hold the write (``wait_replicas``).

        Returns:
            Its reply. A reply that is an error is raised; so is a connection failure.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append(_Pending(args, shareable, route, durable, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        timer = loop.call_later(within, _time_out, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        groups: dict[Any, list[asyncio.Future[Any]]] = {}
        commands = Batch([], [], [])
        for item in batch:
            if item.future.done():  # its caller gave up
                continue
            key: Any = (item.args, item.route) if item.shareable else item.future
            if key not in groups:
                groups[key] = []
                commands.commands.append(item.args)
                commands.routes.append(item.route)
                if item.durable is not None:
                    commands.durable.append(item.durable)
            groups[key].append(item.future)
        if not commands.commands:
            return
        try:
            replies = await self._execute(commands)
        except BaseException as exc:
            for futures in groups.values():
                for future in futures:
                    if future.done():
                        continue
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for futures, reply in zip(groups.values(), replies, strict=True):
            for future in futures:
                if future.done():
                    continue
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    async def _execute(self, batch: Batch) -> list[Any]:
        """Replies (or reply errors) of ``batch``, in one round trip (``WAIT`` included)."""
        loop = asyncio.get_running_loop()
        wait = None
        if self.wait_replicas > 0 and batch.durable and loop.time() >= self._wait_paused_until:
            wait = (self.wait_replicas, WAIT_TIMEOUT_MS)
        async with self._slots:
            replies, acked = await self.server.execute(batch, wait)
        if wait is not None:
            self._replicas_acked(acked, loop.time())
        return replies

    def _replicas_acked(self, acked: int, now: float) -> None:
        if acked >= self.wait_replicas:
            if self._replicas_short:
                log.info("replicas of %s acknowledge writes again", self.endpoint.display)
            self._replicas_short = False
            return
        self._wait_paused_until = now + WAIT_PAUSE
        if not self._replicas_short:
            log.warning(
                "only %d of %d replica(s) of %s acknowledged a round transition within %d ms: "
                "a failover now could lose it (the round would then form again); not waiting "
                "for replicas for %g s",
                acked,
                self.wait_replicas,
                self.endpoint.display,
                WAIT_TIMEOUT_MS,
                WAIT_PAUSE,
            )
        self._replicas_short = True

    async def load_scripts(self, scripts: Iterable[str]) -> None:
        """Load ``scripts`` into the server's script cache (one load at a time per client)."""
        loading = self._loading
        if loading is None or loading.done():
            loading = self._loading = asyncio.ensure_future(self._load(list(scripts)))
        await asyncio.shield(loading)

    async def _load(self, scripts: list[str]) -> None:
        async with self._slots:
            await self.server.load_scripts(scripts)

    # -- runs -----------------------------------------------------------------------------

    async def watch(self, channel: str) -> RunWatch:
        """The watch of ``channel``, subscribed (or being subscribed) by the listener."""
        key = channel.encode()
        entry = self._watches.get(key)
        watch = RunWatch() if entry is None else entry[0]
        self._watches[key] = (watch, 1 if entry is None else entry[1] + 1)
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(
                self._listen(), name=f"aelastic-redis-listener-{self.endpoint.display}"
            )
        await self._send("SUBSCRIBE", key)
        return watch

    async def unwatch(self, channel: str, watch: RunWatch) -> None:
        """Drop one user of ``watch``; unsubscribe when it was the last."""
        key = channel.encode()
        entry = self._watches.get(key)
        if entry is None or entry[0] is not watch:
            return
        if entry[1] > 1:
            self._watches[key] = (watch, entry[1] - 1)
            return
        del self._watches[key]
        watch.on_lost()
        await self._send("UNSUBSCRIBE", key)

    async def _send(self, command: str, channel: bytes) -> None:
        conn = self._conn
        subscribing = command == "SUBSCRIBE"
        if conn is None or (channel in self._sent) == subscribing:
            return  # not connected (the listener subscribes on connect) or nothing to do
        (self._sent.add if subscribing else self._sent.discard)(channel)
        self._unacked[channel] = self._unacked.get(channel, 0) + 1
        conn.send(pack((command, channel)))

    # -- the listener ---------------------------------------------------------------------

    async def _listen(self) -> None:
        delay = 0.05
        while True:
            conn: RespConnection | None = None
            try:
                if self.endpoint.kind == "standalone":
                    address = await self.server.pubsub_address()
                else:
                    with anyio.fail_after(CONNECT_TIMEOUT):  # never swallows a cancellation
                        address = await self.server.pubsub_address()
                conn = await self.server.dial(address, self._dispatch)
                self._sent = set(self._watches)
                self._unacked = dict.fromkeys(self._sent, 1)
                if self._sent:
                    conn.send(pack(("SUBSCRIBE", *self._sent)))
                self._conn = conn
                self.subscribed_at = address
                if self.listener_failing:
                    log.info("pub/sub at %s is back", self._where(address))
                self.listener_failing = False
                delay = 0.05
                await self._read(conn)
            except Exception as exc:
                trouble = RedisError | RedisClusterException | OSError | asyncio.TimeoutError
                if not isinstance(exc, trouble):
                    log.exception("pub/sub listener at %s failed", self.endpoint.display)
                elif not self.listener_failing:
                    log.warning(
                        "pub/sub at %s failed (%s); waiters re-read on the safety-net period "
                        "until it is back",
                        self.endpoint.display,
                        self.server.describe(exc),  # (redis-py's Sentinel errors: a page)
                    )
                self.listener_failing = True
            finally:
                self._conn = None
                self.subscribed_at = None
                self._sent = set()
                self._unacked = {}
                for watch, _ in list(self._watches.values()):
                    watch.on_lost()
                if conn is not None:
                    conn.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _where(self, address: tuple[str, int]) -> str:
        if self.endpoint.kind == "standalone":
            return self.endpoint.display
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        return f"{self.endpoint.display} (node {host}:{address[1]})"

    async def _read(self, conn: RespConnection) -> None:
        """Until ``conn`` is lost (its messages go to :meth:`_dispatch` as they come); a
        ``PING`` after an idle interval, and the connection counts as lost when nothing
        answers it within another."""
        loop = asyncio.get_running_loop()
        interval = self._health_interval
        pinged_at: float | None = None
        while True:
            if pinged_at is not None and conn.received_at >= pinged_at:
                pinged_at = None  # answered
            due = (conn.received_at if pinged_at is None else pinged_at) + interval
            now = loop.time()
            if now < due:
                done, _ = await asyncio.wait({conn.lost}, timeout=due - now)
                if done:
                    raise conn.lost.result()
                continue
            if pinged_at is not None:
                raise asyncio.TimeoutError("no answer to PING")
            pinged_at = now
            conn.ping()

    def _dispatch(self, response: Any) -> None:
        if not isinstance(response, list) or len(response) < 2:
            return
        kind, channel = response[0], response[1]
        if kind in (b"subscribe", b"unsubscribe"):
            # Only the confirmation of the last (un)subscription sent counts: an old
            # "subscribe" must not mark a channel live that was unsubscribed since.
            left = self._unacked.get(channel, 0) - 1
            if left > 0:
                self._unacked[channel] = left
                return
            self._unacked.pop(channel, None)
        entry = self._watches.get(channel)
        if entry is None:
            return
        watch = entry[0]
        if kind == b"message" and len(response) == 3:
            _deliver(watch, response[2])
        elif kind == b"subscribe":
            watch.on_live()

    async def aclose(self) -> None:
        """Stop the listener and close every connection."""
        for watch, _ in list(self._watches.values()):
            watch.on_lost()
        self._watches.clear()
        tasks = list(self._batches)
        if self._listener is not None:
            tasks.append(self._listener)
        self._listener = None
        loading, self._loading = self._loading, None
        if loading is not None:
            tasks.append(loading)  # type: ignore[arg-type]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.server.aclose()


def _deliver(watch: RunWatch, payload: bytes) -> None:
    """One message of a run's channel: a status change, or a store key written."""
    kind, body = payload[:1], payload[1:]
    if kind == b"k":
        watch.on_key(body)
    elif kind == b"s":
        try:
            status: Status = status_from_json(json.loads(body))
        except (ValueError, WireError):
            log.warning("ignored a malformed notification on a run's channel")
            return
        watch.on_status(status)


def _time_out(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())
