"""The Redis client of one event loop and endpoint: commands, and notifications of runs.

How it works: the backends of one ``(event loop, endpoint)`` share a :class:`RedisClient`
(see :mod:`aelastic.backends._shared`), to a standalone server, a Sentinel-managed primary or
a Cluster (:mod:`._servers`). Its listener's connection (:mod:`._listener`) is subscribed to
the runs' channels and, where the server speaks RESP3, carries the commands too: one
connection per client (``share_connections=false``: per node). Batches that must wait for
replicas, and a server without RESP3, use up to ``max_connections`` more. Commands issued in
the same loop iteration go out as one pipeline (identical reads run once); a batch with
writes that replicas should hold (``wait_replicas``) ends with one ``WAIT``. A batch goes
out from the loop's callback at once when a connection is up and its replies are handed
out as they are parsed; only a batch that must wait (for a connection to open, a free slot,
or replicas) runs as a task.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any, NamedTuple

from ...core.race import cancel_and_wait
from .._watch import RunWatch
from ._cluster import Cluster
from ._endpoint import CLUSTER, SENTINEL, RedisEndpoint
from ._listener import Listener
from ._servers import CONNECT_TIMEOUT, Batch, SentinelPrimary, Standalone

__all__ = ["CONNECT_TIMEOUT", "RedisClient", "make_server"]

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
        self.server = make_server(endpoint, max_connections)
        self._slots = _Slots(max_connections)
        self.wait_replicas = wait_replicas
        self._wait_paused_until = 0.0
        self._replicas_short = False
        self.listener = Listener(self.server, health_interval)
        self._pending: list[_Pending] = []
        self._batches: set[asyncio.Task[None]] = set()

    @property
    def subscribed_at(self) -> tuple[str, int] | None:
        """Where the listener is subscribed (host, port), while it is."""
        return self.listener.subscribed_at

    @property
    def listener_failing(self) -> bool:
        """Whether the listener's last attempt to subscribe failed."""
        return self.listener.failing

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

    async def scan(self, pattern: str, limit: int) -> list[bytes]:
        """Keys matching ``pattern`` (``SCAN``, on every primary of a cluster), stopping
        after about ``limit`` of them."""
        async with self._slots:
            return await self.server.scan(pattern, limit)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
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
        wait = self._wait_for(commands)
        if wait is None and self._slots.take_now():
            groups_ = list(groups.values())

            def answered(result: Any) -> None:
                self._slots.give()
                _answer(groups_, result)

            if self.server.send_now(commands, answered):
                return
            self._slots.give()
        task = asyncio.get_running_loop().create_task(self._run_batch(groups, commands, wait))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    def _wait_for(self, batch: Batch) -> tuple[int, int] | None:
        """``WAIT``'s arguments when ``batch`` has writes that replicas should hold."""
        if self.wait_replicas <= 0 or not batch.durable:
            return None
        if asyncio.get_running_loop().time() < self._wait_paused_until:
            return None
        return self.wait_replicas, WAIT_TIMEOUT_MS

    async def _run_batch(
        self,
        groups: dict[Any, list[asyncio.Future[Any]]],
        batch: Batch,
        wait: tuple[int, int] | None,
    ) -> None:
        try:
            async with self._slots:
                replies, acked = await self.server.execute(batch, wait)
        except BaseException as exc:
            _answer(list(groups.values()), exc)
            if not isinstance(exc, Exception):
                raise
            return
        if wait is not None:
            self._replicas_acked(acked, asyncio.get_running_loop().time())
        _answer(list(groups.values()), (replies, acked))

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

    # -- runs -----------------------------------------------------------------------------

    async def watch(self, channel: str) -> RunWatch:
        """The watch of ``channel``, subscribed (or being subscribed) by the listener."""
        return self.listener.watch(channel)

    async def unwatch(self, channel: str, watch: RunWatch) -> None:
        """Drop one user of ``watch``; unsubscribe when it was the last."""
        self.listener.unwatch(channel, watch)

    async def aclose(self) -> None:
        """Stop the listener and close every connection."""
        await self.listener.aclose()
        tasks = list(self._batches)
        await cancel_and_wait(tasks)
        await self.server.aclose()


def _answer(groups: list[list[asyncio.Future[Any]]], result: Any) -> None:
    """Hand each group of callers its reply (a reply error raised), or the batch's failure."""
    if isinstance(result, BaseException):
        for futures in groups:
            for future in futures:
                if future.done():
                    continue
                if isinstance(result, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(result)
        return
    replies = result[0]
    for futures, reply in zip(groups, replies, strict=True):
        for future in futures:
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)


class _Slots:
    """At most ``size`` batches in flight: a semaphore that can also be taken from a
    callback, without waiting (:meth:`take_now`)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take_now(self) -> bool:
        """Take a slot if one is free and nobody waits for one."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    def give(self) -> None:
        """Give a slot back (to the first waiter, if any)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    async def __aenter__(self) -> None:
        if self.take_now():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed a slot as the caller was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.give()


def _time_out(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())


def make_server(endpoint: RedisEndpoint, max_connections: int) -> Standalone:
    """The server object of ``endpoint``'s kind (:mod:`._servers`, :mod:`._cluster`)."""
    if endpoint.kind == SENTINEL:
        return SentinelPrimary(endpoint, max_connections)
    if endpoint.kind == CLUSTER:
        return Cluster(endpoint, max_connections)
    return Standalone(endpoint, max_connections)
