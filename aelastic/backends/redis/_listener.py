"""The pub/sub listener of one Redis client: the runs' channels, and their watches.

How it works: the listener task keeps one subscriber connection (:mod:`._resp`) to the
server (the primary the sentinels name now, or a cluster node) subscribed to the channel of
every run in use (on RESP3 the client's commands use it too: ``Standalone.adopt`` in
:mod:`._servers`), and feeds each run's :class:`~aelastic.backends._watch.RunWatch`:
``s<status JSON>`` messages become status news, ``k<key>`` messages wake the waiters of a
store key. So a round transition costs one message per process however many nodes wait,
and a heartbeat costs none. Messages are handled as the connection parses them (no task per
message). On RESP3 a refused subscription is a reply, not a push: the first ones are
confirmed before the connection takes commands, and later ones are followed by a ``PING``
that marks where their replies end. The listener pings the server after an idle interval (a
timer checks; no task wakes), reconnects with backoff (to the primary the sentinels name
now, or to another cluster node), resubscribes, and tells every watch when notifications
were lost (their waiters re-check with the server once resubscribed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from ...core.race import cancel_and_wait, fail_after
from ...core.state import Status
from ...core.wire import WireError, status_from_json
from .._watch import RunWatch
from ._endpoint import STANDALONE
from ._resp import CONNECT_TIMEOUT, RespConnection, pack
from ._servers import Standalone

__all__ = ["Listener"]

log = logging.getLogger("aelastic.backends.redis")

#: After (un)subscribing on a RESP3 connection: its answer marks the end of the replies.
_MARK = b"aelastic:subscribed"
_SYNC = pack(("PING", _MARK))


class Listener:
    """The channels one client listens to (see the module docstring).

    Args:
        server: Where to subscribe.
        health_interval: Idle seconds after which the listener pings the server.
    """

    def __init__(self, server: Standalone, health_interval: float) -> None:
        self._server = server
        self._endpoint = server.endpoint
        self._health_interval = health_interval
        #: Where the listener is subscribed (host, port), while it is.
        self.subscribed_at: tuple[str, int] | None = None
        #: Whether the last attempt to subscribe failed (and no later one succeeded).
        self.failing = False
        #: The subscriber connection, while there is one.
        self.conn: RespConnection | None = None
        self._watches: dict[bytes, tuple[RunWatch, int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._sent: set[bytes] = set()
        self._unacked: dict[bytes, int] = {}  # (UN)SUBSCRIBEs sent, not yet confirmed
        self._confirmed: asyncio.Future[None] | None = None  # every channel subscribed

    def watch(self, channel: str) -> RunWatch:
        """The watch of ``channel``, subscribed (or being subscribed) by the listener."""
        key = channel.encode()
        entry = self._watches.get(key)
        watch = RunWatch() if entry is None else entry[0]
        self._watches[key] = (watch, 1 if entry is None else entry[1] + 1)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._listen(), name=f"aelastic-redis-listener-{self._endpoint.display}"
            )
        self._send("SUBSCRIBE", key)
        return watch

    def unwatch(self, channel: str, watch: RunWatch) -> None:
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
        self._send("UNSUBSCRIBE", key)

    def _send(self, command: str, channel: bytes) -> None:
        conn = self.conn
        subscribing = command == "SUBSCRIBE"
        if conn is None or (channel in self._sent) == subscribing:
            return  # not connected (the listener subscribes on connect) or nothing to do
        (self._sent.add if subscribing else self._sent.discard)(channel)
        self._unacked[channel] = self._unacked.get(channel, 0) + 1
        if conn.protocol == 2:
            conn.send(pack((command, channel)))
            return
        # RESP3: confirmed by a push, refused by a reply: a PING marks where it ends.

        def confirmed(replies: list[Any] | None, error: BaseException | None) -> None:
            refused = [reply for reply in replies or () if isinstance(reply, Exception)]
            if refused:  # (its commands are retried elsewhere; the listener starts again)
                conn.close(RedisConnectionError(f"pub/sub refused: {refused[0]}"))

        with contextlib.suppress(RedisConnectionError):
            conn.call(pack((command, channel)) + _SYNC, 0, confirmed, _MARK)

    async def aclose(self) -> None:
        """Stop listening; every watch is told that notifications stopped."""
        for watch, _ in list(self._watches.values()):
            watch.on_lost()
        self._watches.clear()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    # -- the task -------------------------------------------------------------------------

    async def _listen(self) -> None:
        delay = 0.05
        while True:
            conn: RespConnection | None = None
            try:
                if self._endpoint.kind == STANDALONE:
                    address = await self._server.pubsub_address()
                else:
                    # asyncio's deadline, not anyio's: anyio's cancels again at every await
                    # until the block is left, which cuts short redis-py's clean-up of the
                    # Sentinel connection it was using (left open, to warn when collected)
                    async with fail_after(CONNECT_TIMEOUT):
                        address = await self._server.pubsub_address()
                self._server.expect()
                try:
                    conn = await self._server.dial(address, self._dispatch, self._server.combines)
                    await self._subscribe(conn)
                except BaseException:
                    self._server.adopt(None)
                    raise
                self._server.adopt(conn)  # for commands too, if RESP3
                self.conn = conn
                self.subscribed_at = address
                if self.failing:
                    log.info("pub/sub at %s is back", self._where(address))
                self.failing = False
                delay = 0.05
                await self._read(conn)
            except Exception as exc:
                trouble = RedisError | RedisClusterException | OSError | asyncio.TimeoutError
                if not isinstance(exc, trouble):
                    log.exception("pub/sub listener at %s failed", self._endpoint.display)
                elif not self.failing:
                    log.warning(
                        "pub/sub at %s failed (%s); waiters re-read on the safety-net period "
                        "until it is back",
                        self._endpoint.display,
                        self._server.describe(exc),  # (redis-py's Sentinel errors: a page)
                    )
                self.failing = True
            finally:
                self.conn = None
                self.subscribed_at = None
                self._sent = set()
                self._unacked = {}
                for watch, _ in list(self._watches.values()):
                    watch.on_lost()
                if conn is not None:
                    conn.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _subscribe(self, conn: RespConnection) -> None:
        """Subscribe ``conn`` to every channel in use; RESP3: until each is confirmed (a
        refusal, a reply when nothing else was asked, ends the connection)."""
        self._sent = set(self._watches)
        self._unacked = dict.fromkeys(self._sent, 1)
        if not self._sent:
            return
        conn.send(pack(("SUBSCRIBE", *self._sent)))
        if conn.protocol == 2:
            return  # refused: the connection ends with the error reply
        confirmed = self._confirmed = asyncio.get_running_loop().create_future()

        def lost(reason: BaseException) -> None:
            if not confirmed.done():
                confirmed.set_exception(reason)

        conn.on_lost(lost)
        try:
            async with fail_after(CONNECT_TIMEOUT):
                await confirmed
        finally:
            self._confirmed = None

    def _where(self, address: tuple[str, int]) -> str:
        if self._endpoint.kind == STANDALONE:
            return self._endpoint.display
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        return f"{self._endpoint.display} (node {host}:{address[1]})"

    async def _read(self, conn: RespConnection) -> None:
        """Until ``conn`` is lost (its messages go to :meth:`_dispatch` as they come), or
        silent: a ``PING`` after an idle interval, and the connection counts as lost when
        nothing answers it within another. A timer checks (no task wakes meanwhile)."""
        ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

        def end(reason: BaseException) -> None:
            if not ended.done():
                ended.set_result(reason)

        conn.on_lost(end)
        liveness = _Liveness(conn, self._health_interval, end)
        try:
            raise await ended
        finally:
            liveness.stop()

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
            confirmed = self._confirmed
            if confirmed is not None and not self._unacked and not confirmed.done():
                confirmed.set_result(None)
        entry = self._watches.get(channel)
        if entry is None:
            return
        watch = entry[0]
        if kind == b"message" and len(response) == 3:
            _deliver(watch, response[2])
        elif kind == b"subscribe":
            watch.on_live()


class _Liveness:
    """Pings ``conn`` after ``interval`` idle seconds; ``end`` when no answer came within
    another interval."""

    def __init__(
        self, conn: RespConnection, interval: float, end: Callable[[BaseException], None]
    ) -> None:
        self._conn = conn
        self._interval = interval
        self._end = end
        self._loop = asyncio.get_running_loop()
        self._pinged_at: float | None = None
        self._timer = self._loop.call_at(conn.received_at + interval, self._check)

    def _check(self) -> None:
        conn, pinged_at = self._conn, self._pinged_at
        if pinged_at is not None and conn.received_at >= pinged_at:
            pinged_at = self._pinged_at = None  # answered
        due = (conn.received_at if pinged_at is None else pinged_at) + self._interval
        now = self._loop.time()
        if now < due:
            self._timer = self._loop.call_at(due, self._check)
        elif pinged_at is not None:
            self._end(asyncio.TimeoutError("no answer to PING"))
        else:
            self._pinged_at = now
            conn.ping()
            self._timer = self._loop.call_at(now + self._interval, self._check)

    def stop(self) -> None:
        self._timer.cancel()


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
