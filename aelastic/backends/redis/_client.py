"""The Redis client of one event loop and endpoint: commands, and notifications of runs.

How it works: the backends of one ``(event loop, endpoint)`` share a :class:`RedisClient`
(see :mod:`aelastic.backends._shared`): a bounded pool for commands and one pub/sub
connection. Commands issued in the same loop iteration go out as one pipeline (identical
reads run once). The listener task subscribes to the channel of every run in use and feeds
each run's :class:`~aelastic.backends._watch.RunWatch`: ``s<status JSON>`` messages become
status news, ``k<key>`` messages wake the waiters of a store key. So a round transition costs
one message per process however many nodes wait, and a heartbeat costs none. The listener
pings the server when idle, reconnects with backoff, resubscribes, and tells every watch
when notifications were lost (their waiters re-check with the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import Iterable
from typing import Any

import anyio
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from ...core.state import Status
from ...core.wire import WireError, status_from_json
from .._watch import RunWatch
from ._endpoint import RedisEndpoint

__all__ = ["RedisClient"]

log = logging.getLogger("aelastic.backends.redis")

#: Seconds to open a connection (TCP, TLS, AUTH) before that attempt counts as failed.
CONNECT_TIMEOUT = 10.0


class RedisClient:
    """Command pool and pub/sub listener of one endpoint on one event loop.

    Args:
        endpoint: Where Redis is.
        max_connections: Size of the command pool (config key ``max_connections``).
        health_interval: Idle seconds after which the listener pings the server.
    """

    def __init__(self, endpoint: RedisEndpoint, max_connections: int, health_interval: float):
        self.endpoint = endpoint
        self._health_interval = health_interval
        self._connection_kwargs = _connection_kwargs(endpoint)
        self.pool = BlockingConnectionPool(
            max_connections=max_connections, timeout=None, **self._connection_kwargs
        )
        self.redis = Redis(connection_pool=self.pool)
        self._watches: dict[bytes, tuple[RunWatch, int]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._conn: Connection | None = None
        self._sent: set[bytes] = set()
        self._unacked: dict[bytes, int] = {}  # (UN)SUBSCRIBEs sent, not yet confirmed
        self._send_lock = asyncio.Lock()
        self.listener_failing = False
        self._loading: asyncio.Future[None] | None = None
        self._pending: list[tuple[tuple[Any, ...], bool, asyncio.Future[Any]]] = []
        self._batches: set[asyncio.Task[None]] = set()

    # -- commands -------------------------------------------------------------------------

    async def command(self, *args: Any, within: float, shareable: bool = False) -> Any:
        """Run one command, pipelined with the others issued in the same loop iteration.

        Args:
            *args: The command and its arguments.
            within: Seconds to wait for the reply (``asyncio.TimeoutError`` after).
            shareable: The command only reads: identical ones of one batch run once.

        Returns:
            Its reply. A reply that is an error is raised; so is a connection failure.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((args, shareable, future))
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

    async def _run_batch(
        self, batch: list[tuple[tuple[Any, ...], bool, asyncio.Future[Any]]]
    ) -> None:
        groups: dict[Any, list[asyncio.Future[Any]]] = {}
        commands: list[tuple[Any, ...]] = []
        for args, shareable, future in batch:
            if future.done():  # its caller gave up
                continue
            key: Any = args if shareable else future
            if key not in groups:
                groups[key] = []
                commands.append(args)
            groups[key].append(future)
        if not commands:
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

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Replies (or reply errors) of ``commands``, in one round trip."""
        if len(commands) == 1:
            try:
                return [await self.redis.execute_command(*commands[0])]  # type: ignore[no-untyped-call]
            except ResponseError as exc:
                return [exc]
        async with self.redis.pipeline(transaction=False) as pipe:
            for args in commands:
                pipe.execute_command(*args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            return replies

    async def load_scripts(self, scripts: Iterable[str]) -> None:
        """Load ``scripts`` into the server's script cache (one load at a time per client)."""
        loading = self._loading
        if loading is None or loading.done():
            loading = self._loading = asyncio.ensure_future(self._load(list(scripts)))
        await asyncio.shield(loading)

    async def _load(self, scripts: list[str]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for src in scripts:
                pipe.script_load(src)
            await pipe.execute()

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
        async with self._send_lock:
            conn = self._conn
            subscribing = command == "SUBSCRIBE"
            if conn is None or (channel in self._sent) == subscribing:
                return  # not connected (the listener subscribes on connect) or nothing to do
            (self._sent.add if subscribing else self._sent.discard)(channel)
            self._unacked[channel] = self._unacked.get(channel, 0) + 1
            try:
                await conn.send_command(command, channel, check_health=False)
            except (RedisError, OSError) as exc:
                log.debug("pub/sub %s at %s failed: %s", command, self.endpoint.display, exc)

    # -- the listener ---------------------------------------------------------------------

    def _new_connection(self) -> Connection:
        kwargs = dict(self._connection_kwargs)
        kwargs["socket_timeout"] = None  # idle reads wait for messages; pings detect loss
        cls: type[Connection] = kwargs.pop("connection_class")
        return cls(**kwargs)

    async def _listen(self) -> None:
        delay = 0.05
        while True:
            conn = self._new_connection()
            try:
                with anyio.fail_after(CONNECT_TIMEOUT):  # never swallows a cancellation
                    await conn.connect()  # type: ignore[no-untyped-call]
                async with self._send_lock:
                    self._sent = set(self._watches)
                    self._unacked = dict.fromkeys(self._sent, 1)
                    if self._sent:
                        await conn.send_command("SUBSCRIBE", *self._sent, check_health=False)
                    self._conn = conn
                if self.listener_failing:
                    log.info("pub/sub at %s is back", self.endpoint.display)
                self.listener_failing = False
                delay = 0.05
                await self._read(conn)
            except Exception as exc:
                if not isinstance(exc, RedisError | OSError | asyncio.TimeoutError):
                    log.exception("pub/sub listener at %s failed", self.endpoint.display)
                elif not self.listener_failing:
                    log.warning(
                        "pub/sub at %s failed (%s); waiters re-read on the safety-net period "
                        "until it is back",
                        self.endpoint.display,
                        exc,
                    )
                self.listener_failing = True
            finally:
                self._conn = None
                self._sent = set()
                self._unacked = {}
                for watch, _ in list(self._watches.values()):
                    watch.on_lost()
                with contextlib.suppress(Exception):
                    await conn.disconnect(nowait=True)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _read(self, conn: Connection) -> None:
        pinged = False
        while True:
            response = await conn.read_response(
                timeout=self._health_interval, disconnect_on_error=False, push_request=True
            )
            if response is None:  # idle for a whole interval
                if pinged:
                    raise asyncio.TimeoutError("no answer to PING")
                pinged = True
                async with self._send_lock:
                    await conn.send_command("PING", check_health=False)
                continue
            pinged = False
            self._dispatch(response)

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
        await self.redis.aclose()
        await self.pool.disconnect()


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


def _quiet_handshake() -> dict[str, Any]:
    """Options that spare a new connection's optional round trips, where redis-py has them."""
    # The options are taken by a base class's __init__ (Connection's own takes **kwargs).
    accepted: set[str] = set()
    for cls in Connection.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            accepted.update(inspect.signature(init).parameters)
    quiet: dict[str, Any] = {}
    if "driver_info" in accepted:  # no CLIENT SETINFO lib-name/lib-ver
        quiet["driver_info"] = None
    if "maint_notifications_config" in accepted:
        from redis.maint_notifications import MaintNotificationsConfig

        quiet["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return quiet


_QUIET = _quiet_handshake()


def _connection_kwargs(endpoint: RedisEndpoint) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "host": endpoint.host,
        "port": endpoint.port,
        "db": endpoint.db,
        "username": endpoint.username,
        "password": endpoint.password,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": CONNECT_TIMEOUT,
        "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 0),
        "connection_class": Connection,
        "protocol": 2,  # RESP2: no HELLO round trip on connect
    }
    kwargs.update(_QUIET)
    if endpoint.tls:
        kwargs.update(
            connection_class=SSLConnection,
            ssl_ca_certs=endpoint.ssl_ca_certs,
            ssl_certfile=endpoint.ssl_certfile,
            ssl_keyfile=endpoint.ssl_keyfile,
            ssl_cert_reqs=endpoint.ssl_cert_reqs,
        )
    return kwargs
