"""Connections shared by every Redis backend of one event loop, and change notifications.

How it works: many handlers in one process (the benchmark runs hundreds as tasks of one
loop) each create a backend, but the backends of one ``(event loop, endpoint)`` share a
:class:`SharedClient`: one bounded connection pool for commands and one pub/sub connection.
Its listener task subscribes to the channel of every run in use (a :class:`RunWatch` each,
reference counted) and turns each message into local wake-ups, so a change costs one
message per process however many nodes wait. The listener pings the server when idle,
reconnects with backoff, resubscribes, and wakes every waiter after a reconnection (a
message may have been lost meanwhile: waiters re-read).

A :class:`RunWatch` also keeps what the process knows about the run: the token of the last
change notified (``latest``), a counter of everything that made local knowledge newer
(``seq``, which keeps a shared in-flight read from answering for a later caller), the last
compare-and-set answer (``cached``), and the in-process order of compare-and-set calls
(:class:`Turn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from ._endpoint import RedisEndpoint

__all__ = ["Order", "RunWatch", "SharedClient", "Turn", "acquire_client", "compare_tokens"]

log = logging.getLogger("aelastic.backends.redis")

#: Longest delay of a wake-up while writes of this process to the same run are queued
#: (their notifications follow at once: waking the waiters for each would waste CPU).
MAX_HOLD = 0.05

#: Seconds to open a connection (TCP, TLS, AUTH) before that attempt counts as failed.
CONNECT_TIMEOUT = 10.0


class Order(enum.Enum):
    """How a token relates to a newer piece of knowledge about the run."""

    SAME = "same"  # equal, or known to be newer: nothing to report yet
    CHANGED = "changed"  # known to be older: the stored token differs
    UNKNOWN = "unknown"  # cannot tell without asking the server


def _parse(token: str) -> tuple[str, int] | None:
    epoch, dot, version = token.partition(".")
    if not dot or not version.isdigit():
        return None
    return epoch, int(version)


def compare_tokens(token: str, known: str | None) -> Order:
    """Relate ``token`` (what a caller holds) to ``known`` (a token the server had later).

    Tokens of one epoch are ordered by version; anything else is :attr:`Order.UNKNOWN`.
    """
    if known is None:
        return Order.UNKNOWN
    if token == known:
        return Order.SAME
    mine, theirs = _parse(token), _parse(known)
    if mine is None or theirs is None or mine[0] != theirs[0]:
        return Order.UNKNOWN
    return Order.CHANGED if mine[1] < theirs[1] else Order.SAME


class Turn:
    """The in-process order of compare-and-set calls on one run.

    One call at a time goes to the server. A caller that lost keeps the turn for its
    immediate retry (made in the same loop iteration, since deciding again is pure
    computation) and loses it at the next iteration otherwise. So N nodes of one process
    joining at once cost about N writes, not N² lost races.

    Args:
        on_idle: Called when the turn becomes free with nobody queued for it.
    """

    def __init__(self, on_idle: Callable[[], None]) -> None:
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None
        self._lease = 0
        self._queued = 0
        self._on_idle = on_idle

    @property
    def busy(self) -> bool:
        """Whether a write of this process is under way or queued."""
        return self._lock.locked() or self._queued > 0

    async def acquire(self) -> None:
        """Take the turn (at once if this task kept it)."""
        task = asyncio.current_task()
        if task is not None and self._owner is task:
            self._lease += 1
            return
        self._queued += 1
        try:
            await self._lock.acquire()
        finally:
            self._queued -= 1
        self._owner = task
        self._lease += 1

    def release(self) -> None:
        """Give the turn to the next caller."""
        self._owner = None
        self._lease += 1
        self._lock.release()
        if not self._queued:
            self._on_idle()

    def keep(self) -> None:
        """Keep the turn for the owner's retry; release it at the next loop iteration."""
        lease = self._lease
        asyncio.get_running_loop().call_soon(self._expire, lease)

    def _expire(self, lease: int) -> None:
        if self._lease == lease and self._lock.locked():
            self.release()


class _Waiter:
    __slots__ = ("future", "keys", "token")

    def __init__(self, future: asyncio.Future[bool], token: str, keys: frozenset[bytes]) -> None:
        self.future = future
        self.token = token
        self.keys = keys

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(True)

    def expire(self) -> None:
        if not self.future.done():
            self.future.set_result(False)


class RunWatch:
    """What this process knows about one run's changes; shared by the run's backends."""

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.refs = 0
        self.subscribed = False
        self.ready = asyncio.Event()
        self.latest: str | None = None
        self.seq = 0
        self.cached: tuple[bytes | None, str] | None = None
        self.turn = Turn(self._turn_idle)
        self._held: asyncio.TimerHandle | None = None
        self.inflight_read: tuple[int, asyncio.Task[tuple[bytes | None, str]]] | None = None
        self._state_waiters: set[_Waiter] = set()
        self._key_waiters: set[_Waiter] = set()

    def waiter(self, token: str = "", keys: Iterable[bytes] = ()) -> _Waiter:
        """Register a waiter for a state change from ``token`` or for ``keys`` to change."""
        key_set = frozenset(keys)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), token, key_set)
        (self._key_waiters if key_set else self._state_waiters).add(waiter)
        return waiter

    @property
    def holding(self) -> bool:
        """Whether wake-ups wait for this process's queued writes to the run."""
        return self._held is not None

    async def sleep(self, waiter: _Waiter, timeout: float) -> bool:
        """Wait until ``waiter`` is woken (``True``) or ``timeout`` passes (``False``)."""
        if waiter.future.done():
            return True
        timer = asyncio.get_running_loop().call_later(timeout, waiter.expire)
        try:
            return await waiter.future
        finally:
            timer.cancel()

    def discard(self, waiter: _Waiter) -> None:
        """Forget ``waiter`` (it was woken or gave up)."""
        self._state_waiters.discard(waiter)
        self._key_waiters.discard(waiter)
        waiter.future.cancel()

    def wake_all(self) -> None:
        """Wake every waiter (it may have missed a change: it re-reads)."""
        if self._held is not None:
            self._held.cancel()
            self._held = None
        for waiter in (*self._state_waiters, *self._key_waiters):
            waiter.wake()

    def on_message(self, payload: bytes) -> None:
        """A write of the run was published: wake who it concerns."""
        kind, body = payload[:1], payload[1:]
        if kind == b"s":
            self.latest = body.decode("ascii", "replace")
            self.seq += 1
            if not self.turn.busy:
                self._wake_state_waiters()
            elif self._held is None:  # more writes of this process are coming: wake after
                loop = asyncio.get_running_loop()
                self._held = loop.call_later(MAX_HOLD, self._wake_state_waiters)
        elif kind == b"k":
            for waiter in self._key_waiters:
                if body in waiter.keys:
                    waiter.wake()

    def _wake_state_waiters(self) -> None:
        if self._held is not None:
            self._held.cancel()
            self._held = None
        latest = self.latest
        for waiter in self._state_waiters:
            if compare_tokens(waiter.token, latest) is not Order.SAME:
                waiter.wake()

    def _turn_idle(self) -> None:
        if self._held is not None:
            self._wake_state_waiters()

    def on_subscribed(self) -> None:
        """The channel is (again) subscribed: messages from now on arrive."""
        self.subscribed = True
        self.latest = None
        self.seq += 1
        self.ready.set()
        self.wake_all()

    def on_lost(self) -> None:
        """The pub/sub connection is gone: messages may be lost until resubscribed."""
        if self.subscribed:
            self.subscribed = False
            self.latest = None
            self.seq += 1
            self.ready.clear()
        self.wake_all()


class SharedClient:
    """Command pool and pub/sub listener of one endpoint on one event loop.

    Args:
        endpoint: Where Redis is.
        max_connections: Size of the command pool (config key ``max_connections``).
        health_interval: Idle seconds after which the listener pings the server.
    """

    def __init__(self, endpoint: RedisEndpoint, max_connections: int, health_interval: float):
        self.endpoint = endpoint
        self.refs = 0
        self._health_interval = health_interval
        self._connection_kwargs = _connection_kwargs(endpoint)
        self.pool = BlockingConnectionPool(
            max_connections=max_connections, timeout=None, **self._connection_kwargs
        )
        self.redis = Redis(connection_pool=self.pool)
        self._watches: dict[bytes, RunWatch] = {}
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

    async def command(self, *args: Any, timeout: float, shareable: bool = False) -> Any:
        """Run one command, pipelined with the others issued in the same loop iteration.

        Args:
            *args: The command and its arguments.
            timeout: Seconds to wait for the reply (``asyncio.TimeoutError`` after).
            shareable: The command only reads: identical ones of one batch run once.

        Returns:
            Its reply. A reply that is an error is raised; so is a connection failure.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((args, shareable, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        timer = loop.call_later(timeout, _time_out, future)
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
        watch = self._watches.get(key)
        if watch is None:
            watch = self._watches[key] = RunWatch(key)
        watch.refs += 1
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(
                self._listen(), name=f"aelastic-redis-listener-{self.endpoint.display}"
            )
        await self._send("SUBSCRIBE", key)
        return watch

    async def unwatch(self, watch: RunWatch) -> None:
        """Drop one reference to ``watch``; unsubscribe when it was the last."""
        watch.refs -= 1
        if watch.refs > 0 or self._watches.get(watch.channel) is not watch:
            return
        del self._watches[watch.channel]
        watch.on_lost()
        task = watch.inflight_read
        if task is not None and not task[1].done():
            task[1].cancel()
        await self._send("UNSUBSCRIBE", watch.channel)

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
                await asyncio.wait_for(conn.connect(), CONNECT_TIMEOUT)  # type: ignore[no-untyped-call]
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
                for watch in list(self._watches.values()):
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
        watch = self._watches.get(channel)
        if watch is None:
            return
        if kind == b"message" and len(response) == 3:
            watch.on_message(response[2])
        elif kind == b"subscribe":
            watch.on_subscribed()

    async def aclose(self) -> None:
        """Stop the listener and close every connection."""
        for watch in list(self._watches.values()):
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


def _time_out(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())


def _quiet_handshake() -> dict[str, Any]:
    """Options that spare a new connection's optional round trips, where redis-py has them."""
    accepted = inspect.signature(Connection.__init__).parameters
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


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, SharedClient]] = (
    weakref.WeakKeyDictionary()
)


def acquire_client(
    endpoint: RedisEndpoint, max_connections: int, health_interval: float
) -> SharedClient:
    """The shared client of ``endpoint`` on the running loop (one more reference)."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(endpoint.identity)
    if client is None:
        client = per_loop[endpoint.identity] = SharedClient(
            endpoint, max_connections, health_interval
        )
    client.refs += 1
    return client


async def release_client(client: SharedClient) -> None:
    """Drop one reference to ``client``; close it when it was the last."""
    client.refs -= 1
    if client.refs > 0:
        return
    per_loop = _clients.get(asyncio.get_running_loop(), {})
    if per_loop.get(client.endpoint.identity) is client:
        del per_loop[client.endpoint.identity]
    await client.aclose()
