"""The rendezvous channel: rendezvous requests as messages on one WebSocket per client.

How it works: ``GET /v1/channel`` upgrades to a WebSocket (behind the same token check as
every route, once per connection). Each text message the client sends is one rendezvous
request: ``{"id": <int>, "run": <run id>, "request": {...}, "hold": <s>, "seen": <token>,
"beat": <key>}`` (``hold`` and ``seen`` optional, as the query of ``POST .../rendezvous``;
``beat``, a keep-alive's beat key, ``core/brief.py``); ``{"id": <int>, "cancel": true}``
withdraws a request still held (its node gave up on it, as a client closing its HTTP
connection: a held join is never applied again); a keep-alive with ``"broken": true`` says
that the node's workers' collective broke (answered ``{"id": <same>, "departed": <n>}``,
the nodes that made lost: :mod:`._departures`). The server answers each request with
``{"id": <same>, "reply": {...}}`` (a plain heartbeat whose beat key is the status's:
``{"id": <same>, "brief": [<now>, <oldest beat>]}``), or ``{"id": <same>, "status": <int>,
"error": <text>}`` when it cannot (400 for a request that does not fit the schema, 503 at
the limit of runs or when the journal cannot be written); answers may come in any order. The
request is answered exactly as over HTTP (:func:`._answer.answer`): a held keep-alive waits
until the status moves or the next beat is due, so one message per beat is both the node's
heartbeat and its news; it is held without a task of its own (:mod:`._held`). A message that
is not a JSON object with a valid ``id``, or a binary one, closes the channel (code 1003 or
1007, the reason in the close frame). At most :data:`MAX_IN_FLIGHT` requests are held per
channel (beyond: 503); a join that would add a node past its client's quota is answered 429
(:mod:`._quota`); a request for a run its channel's scoped token may not use is answered 403,
one that would make a run past its client's or token's quota of runs 429 (:mod:`._tenancy`).
A channel that carried nothing and holds no request for the server's
keep-alive timeout (``aelastic serve --keepalive-timeout``, as an idle connection between
requests) is closed with code 1000 and the reason ``idle`` (the client opens a new one when
it needs it); at shutdown every channel is closed with code 1001 once its held answers are
sent. A channel that ends without a close frame, not closed by the server (its client's
process exited, or the connection was cut), is reported as the departure of the nodes whose
requests it carried (:mod:`._departures`): a node not heard from again within the machine's
grace is lost then, not after the heartbeat window.

Why: clients send their rendezvous requests here (a held heartbeat per node and interval,
held joins). A held keep-alive as an HTTP request cost the server about 250 us of CPU and
the node about 350 us (aiohttp's request parsing, request and response objects, routing,
the middlewares, a connection from the pool; the rendezvous work itself is small); as a
message on an open WebSocket about 160 us on each side (measured, 2,048 nodes beating every
second), which is what lets one server and 4,096 simulated nodes on this project's 2-core
machine beat every second (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from ....core.state import NodeDesc, Op, Reply, Request
from ..wire import CHANNEL_PATH, MAX_BODY, SchemaError
from ._answer import answer, failure
from ._departures import Departures
from ._guard import DEFAULT_KEEPALIVE_TIMEOUT
from ._held import Held, HeldBeats, encode, start
from ._message import Closed, parse, read_message
from ._quota import QUOTA, NodeQuotaError
from ._repeat import repeat_id, tail
from ._runs import RunLimitError, RunStore
from ._tenancy import RUN_QUOTA, Refused, check_run, scope_of

__all__ = ["MAX_IN_FLIGHT", "TAPS", "add_channel"]

log = logging.getLogger("aelastic.backends.http.server")

#: Requests held on one channel at most; more are answered 503.
MAX_IN_FLIGHT = 4096
#: Seconds the held answers get to go out at shutdown before the channels close.
_SHUTDOWN_GRACE = 2.0
_TOO_MANY = f"more than {MAX_IN_FLIGHT} requests held"

#: Called with the status (200 or the error's) and the bytes of each answer sent on a
#: channel (the metrics count them).
Tap = Callable[[int, int], None]
TAPS: web.AppKey[list[Tap]] = web.AppKey("aelastic_channel_taps", list)


class _Channel:
    """One client's WebSocket: its held requests and its answers."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        upgrade: web.Request,
        store: RunStore,
        idle: float,
        held_beats: HeldBeats,
        departures: Departures,
    ) -> None:
        self.ws = ws
        self.departures = departures
        self.upgrade = upgrade  # the channel's HTTP request: who its client is
        self.store = store
        self.taps = upgrade.app[TAPS]
        self.idle_timeout = idle
        self.held: set[asyncio.Task[None]] = set()
        self.beats: dict[int, Held] = {}  # keep-alives held without a task
        self._held_beats = held_beats
        self._by_id: dict[int, asyncio.Task[None]] = {}  # requests being answered
        # The last keep-alive taken, checked: its text after the id, and its fields.
        self._repeat: tuple[str, str, Request, float, str | None, str] | None = None
        self._loop = asyncio.get_running_loop()
        # Idle: one timer a channel, pushed back lazily (a timeout on every receive cost
        # a tenth of the server's time per message, measured).
        self.last = self._loop.time()
        self._idle = self._loop.call_later(idle, self._check_idle)
        self._closer: asyncio.Task[bool] | None = None
        #: The nodes whose requests it carried, and their secrets (for a departure).
        self.nodes: dict[tuple[str, NodeDesc], str] = {}
        #: The server closed it (idle, shutdown, a broken rule): no departure.
        self.closed_here = False

    def _check_idle(self) -> None:
        due = self.last + self.idle_timeout
        if self.held or self.beats or self._loop.time() < due:
            self._idle = self._loop.call_at(max(due, self._loop.time() + 1.0), self._check_idle)
            return
        self.closed_here = True
        self._closer = self._loop.create_task(self.ws.close(code=WSCloseCode.OK, message=b"idle"))

    def take_text(self, data: str) -> None:
        """Take one text message (see :meth:`take`).

        A keep-alive whose text is the channel's last keep-alive's but for its id (a node's
        every beat, until its status moves) is taken with that one's checked fields, not
        parsed nor checked again (:mod:`._repeat`).

        Raises:
            Closed: The message breaks the channel's rules.
        """
        repeat = self._repeat
        if repeat is not None:
            msg_id = repeat_id(data, repeat[0])
            if msg_id is not None:
                if len(self.held) + len(self.beats) >= MAX_IN_FLIGHT:
                    self._later(self._error(msg_id, 503, _TOO_MANY))
                else:
                    self._dispatch(msg_id, *repeat[1:])
                return
        msg_id, doc = parse(data)
        self.take(msg_id, doc, data)

    def take(self, msg_id: int, doc: dict[str, Any], data: str | None = None) -> None:
        """Answer the request in ``doc`` (in a task of its own: it may be held), or cancel
        request ``msg_id`` (``{"id", "cancel": true}``: its node gave up on it); ``data``:
        the message's text, kept for its repeats when it is a keep-alive."""
        if doc.get("cancel") is True and len(doc) == 2:
            task = self._by_id.get(msg_id)
            if task is not None:
                task.cancel()  # a held join is never applied again; no answer
            beat = self.beats.get(msg_id)
            if beat is not None:
                self._held_beats.drop(beat)
            return
        if len(self.held) + len(self.beats) >= MAX_IN_FLIGHT:
            self._later(self._error(msg_id, 503, _TOO_MANY))
            return
        try:
            message = read_message(doc)
            check_run(scope_of(self.upgrade), message.run_id)
            self.upgrade.app[RUN_QUOTA].admit(self.upgrade, message.run_id)
            self.upgrade.app[QUOTA].admit(self.upgrade, message.run_id, message.request)
        except SchemaError as exc:
            self._later(self._error(msg_id, 400, str(exc)))
            return
        except NodeQuotaError as exc:
            self._later(self._error(msg_id, 429, str(exc)))
            return
        except (Refused, RunLimitError) as exc:
            refusal = failure(exc)
            assert refusal is not None
            self._later(self._error(msg_id, *refusal))
            return
        run_id, request, hold, seen, key, broken = message
        if broken:
            self.nodes[(run_id, request.node)] = request.secret
            self._later(self._broken(msg_id, run_id, request))
            return
        if request.op is Op.KEEP_ALIVE and data is not None:  # (only joins count in quotas)
            known = tail(data, msg_id)
            if known is not None:
                self._repeat = (known, run_id, request, hold, seen, key)
        self._dispatch(msg_id, run_id, request, hold, seen, key)

    def _dispatch(
        self, msg_id: int, run_id: str, request: Request, hold: float, seen: str | None, key: str
    ) -> None:
        if request.op is Op.LEAVE:
            self.nodes.pop((run_id, request.node), None)
        else:
            self.nodes[(run_id, request.node)] = request.secret
        if request.op is Op.KEEP_ALIVE and self._held_beats.take(
            self, msg_id, run_id, request, hold, seen, key
        ):
            return
        task = self._later(self._answer(msg_id, run_id, request, hold, seen, key))
        self._by_id[msg_id] = task
        task.add_done_callback(lambda _: self._by_id.pop(msg_id, None))

    def _later(self, coro: Any) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self.held.add(task)
        task.add_done_callback(self.held.discard)
        return task

    @property
    def closed(self) -> bool:
        """Whether the socket is closed (nobody reads answers any more)."""
        return self.ws.closed

    def send_text(self, text: str, status: int) -> None:
        """Send an answer now (finished in a task only if the socket's buffer is full)."""
        if self.ws.closed:
            return
        self.last = self._loop.time()
        for tap in self.taps:
            tap(status, len(text))
        start(self.ws.send_str(text), self.held)

    def deliver(self, msg_id: int, reply: Reply, key: str) -> None:
        """Answer request ``msg_id`` with ``reply`` once the changes are durable."""
        if self.store.settled:
            self.send_text(encode(msg_id, reply, key), 200)
        else:
            self._later(self._durable(msg_id, reply, key))

    async def _durable(self, msg_id: int, reply: Reply, key: str) -> None:
        try:
            await self.store.durable()
        except Exception as exc:  # told to the client, as over HTTP
            await self._failed(msg_id, exc)
            return
        self.send_text(encode(msg_id, reply, key), 200)

    async def _failed(self, msg_id: int, exc: Exception) -> None:
        known = failure(exc)
        if known is None:
            log.exception("internal error answering a request on a channel")
            known = 500, "internal server error"
        await self._error(msg_id, *known)

    async def _answer(
        self, msg_id: int, run_id: str, request: Any, hold: float, seen: Any, key: str
    ) -> None:
        try:
            reply = await answer(self.store, run_id, request, hold, seen, lambda: self.ws.closed)
        except Exception as exc:  # told to the client, as over HTTP
            await self._failed(msg_id, exc)
            return
        self.send_text(encode(msg_id, reply, key), 200)

    async def _broken(self, msg_id: int, run_id: str, request: Request) -> None:
        """The node's keep-alive, saying its workers' collective broke: applied (its secret
        proves it a member), then the run's waiting departures are confirmed."""
        try:
            reply = await answer(self.store, run_id, request, 0, None, lambda: self.ws.closed)
        except Exception as exc:  # told to the client, as over HTTP
            await self._failed(msg_id, exc)
            return
        lost = self.departures.confirm(run_id, request.node) if reply.known else 0
        await self._send({"id": msg_id, "departed": lost}, 200)

    async def _error(self, msg_id: int, status: int, message: str) -> None:
        await self._send({"id": msg_id, "status": status, "error": message}, status)

    async def _send(self, doc: dict[str, Any], status: int) -> None:
        text = json.dumps(doc, separators=(",", ":"))
        if self.ws.closed:
            return
        self.last = self._loop.time()
        for tap in self.taps:
            tap(status, len(text))
        with contextlib.suppress(ConnectionError, RuntimeError):  # the client went away
            await self.ws.send_str(text)

    async def finish(self) -> None:
        """Stop the held requests (the channel is closed: nobody reads their answers)."""
        self._idle.cancel()
        for beat in list(self.beats.values()):
            self._held_beats.drop(beat)
        for task in list(self.held):
            task.cancel()
        if self.held:
            await asyncio.wait(self.held)


async def _serve(
    request: web.Request,
    store: RunStore,
    max_msg: int,
    idle: float,
    channels: set[_Channel],
    held_beats: HeldBeats,
    departures: Departures,
) -> web.StreamResponse:
    ws = web.WebSocketResponse(compress=False, max_msg_size=max_msg, timeout=1.0)
    await ws.prepare(request)
    channel = _Channel(ws, request, store, idle, held_beats, departures)
    channels.add(channel)
    loop = asyncio.get_running_loop()
    abrupt = False
    try:
        while True:
            msg = await ws.receive()
            channel.last = loop.time()
            if msg.type is WSMsgType.TEXT:
                try:
                    channel.take_text(msg.data)
                except Closed as exc:
                    channel.closed_here = True
                    await ws.close(code=exc.code, message=str(exc).encode())
                    break
            elif msg.type is WSMsgType.BINARY:
                channel.closed_here = True
                await ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"text messages only")
                break
            else:  # closing, closed, or an error: the channel is over
                # No close frame (the socket ended, or failed): the client did not say
                # goodbye. A close frame is a client that chose to go (it leaves, or
                # goes on over HTTP).
                abrupt = msg.type in (WSMsgType.CLOSED, WSMsgType.ERROR)
                break
    finally:
        channels.discard(channel)
        await channel.finish()  # its held keep-alives gone: they prove nothing now
        if abrupt and not channel.closed_here and channel.nodes:
            departures.report(channel.nodes)
    return ws


def add_channel(
    app: web.Application,
    store: RunStore,
    max_body: int = MAX_BODY,
    idle_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
) -> None:
    """Serve the channel (``GET /v1/channel``) on ``app``, closed at its shutdown (call
    after the store's own shutdown, which answers the held requests).

    Args:
        app: The server's application.
        store: Its runs.
        max_body: Largest message accepted, in bytes (as a request body).
        idle_timeout: Seconds a channel that carries nothing and holds no request stays
            open.
    """
    app[TAPS] = []
    channels: set[_Channel] = set()
    held_beats = HeldBeats(store)
    departures = Departures(store)

    async def channel(request: web.Request) -> web.StreamResponse:
        return await _serve(
            request, store, max_body, idle_timeout, channels, held_beats, departures
        )

    async def close_all(app: web.Application) -> None:
        departures.close()
        for c in channels:
            c.closed_here = True
        held_beats.flush()  # the held beats: answered now (the store is closing)
        held = set().union(*(c.held for c in channels))
        if held:  # answered at once now that the store is closing: let them go out
            await asyncio.wait(held, timeout=_SHUTDOWN_GRACE)
        # All at once (a close may wait up to a second for its client's answer).
        going = b"the server is shutting down"
        await asyncio.gather(
            *(c.ws.close(code=WSCloseCode.GOING_AWAY, message=going) for c in list(channels)),
            return_exceptions=True,
        )

    app.router.add_get(CHANNEL_PATH, channel)
    app.on_shutdown.append(close_all)
