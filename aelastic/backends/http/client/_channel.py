"""The client's end of the rendezvous channel: rendezvous requests as WebSocket messages.

How it works: a :class:`~._transport.Connection` has one :class:`Channel`. The first
rendezvous request opens a WebSocket to the server (``GET /v1/channel``, see
:mod:`aelastic.backends.http.server._channel`); it stays open while the connection lives and
carries the requests of every node of the connection: joins, leaves and, once a round is
complete, a held heartbeat a beat. :meth:`Channel.send` writes one message with a fresh id
and awaits the answer with that id (one reader task hands the answers out); held requests
are answered when the status moves or the hold ends, as over HTTP, and a cancelled send
withdraws its request (as closing an HTTP connection would). Whatever goes wrong (the
server has no channel: an older ``aelastic serve``, or a proxy refusing WebSockets; the
socket closes or fails; a 5xx answer) makes :meth:`Channel.send` return ``None``: the
caller then sends that request over HTTP, which has the retries and the error messages
(rendezvous requests are idempotent). A server that takes the connection but answers
neither the opening handshake nor a message within ten seconds (beyond the message's hold)
sends the request over HTTP too; within the call's ``read_timeout``, when that is shorter,
it is not reachable: that raises at once, as HTTP would after its own wait (so a call with
a short read timeout never takes two of them, nor ten seconds). After a failed
open the channel is tried again after a backoff (1 s doubling to 30 s; no channel there,
an older server or a proxy that does not pass WebSockets on: 10 minutes). A 4xx answer
raises, as over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from ....core.errors import RendezvousConnectionError
from ....core.race import cancel_and_wait, fail_after, retrieve
from ..wire import CHANNEL_PATH

__all__ = ["Channel"]

#: Seconds an open may take, and an answer beyond its hold, at most (the call's read
#: timeout, when shorter, bounds both).
_OPEN_TIMEOUT = 10.0
_ANSWER_MARGIN = 10.0
_FIRST_BACKOFF = 1.0
_MAX_BACKOFF = 30.0
#: Seconds before an older server (no channel route) is asked again.
_NO_CHANNEL_BACKOFF = 600.0


@dataclass(eq=False)
class _Socket:
    ws: aiohttp.ClientWebSocketResponse[bool]
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    notes: set[asyncio.Task[None]] = field(default_factory=set)  # withdrawals being sent


class Channel:
    """The rendezvous channel of one connection (see the module docstring).

    Args:
        session: The connection's aiohttp session (its headers carry the token).
        base: The server's base URL.
        endpoint: How to name the server in messages.
    """

    def __init__(self, session: aiohttp.ClientSession, base: URL, endpoint: str) -> None:
        self._session = session
        self._url = base.with_path(base.path.rstrip("/") + CHANNEL_PATH, encoded=True)
        self._endpoint = endpoint
        self._socket: _Socket | None = None
        self._opening: asyncio.Lock | None = None
        self._ids = itertools.count()
        self._retry_at = -float("inf")
        self._backoff = _FIRST_BACKOFF
        self._closed = False

    async def send(
        self,
        run_id: str,
        request: dict[str, Any],
        hold: float,
        seen: str | None,
        beat: str = "",
        broken: bool = False,
        read_timeout: float = _OPEN_TIMEOUT,
    ) -> dict[str, Any] | list[Any] | None:
        """Send one rendezvous request; its reply's JSON (a list: the brief answer to a
        keep-alive sent with its beat key ``beat``; the whole answer, ``{"departed": n}``,
        to a keep-alive saying the node's collective ``broken``), or ``None`` to send it
        over HTTP.

        Raises:
            RendezvousConnectionError: The server refused the request (4xx), or took the
                connection but answered nothing within ``read_timeout`` (beyond the hold).
        """
        socket = self._socket
        if socket is None or socket.ws.closed:
            socket = await self._open(read_timeout)
            if socket is None:
                return None
        msg_id = next(self._ids)
        message: dict[str, Any] = {"id": msg_id, "run": run_id, "request": request}
        if hold > 0:
            message["hold"] = round(hold, 3)
            if seen is not None:
                message["seen"] = seen
        if beat:
            message["beat"] = beat
        if broken:
            message["broken"] = True
        if socket.reader is None or socket.reader.done():
            return None  # closed meanwhile: nobody would hand the answer out
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        socket.pending[msg_id] = future
        margin = min(_ANSWER_MARGIN, read_timeout)
        try:
            async with fail_after(hold + margin):
                await socket.ws.send_str(json.dumps(message, separators=(",", ":")))
                doc = await future
        except (ConnectionError, aiohttp.ClientError, RuntimeError):
            return None  # the socket is gone: this one goes over HTTP
        except TimeoutError:  # a server that does not answer: a new socket next time
            with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                await socket.ws.close()
            if margin < _ANSWER_MARGIN:  # the whole read timeout went by
                raise self._unanswered(f"a message within {margin:g} s beyond its hold") from None
            return None
        except asyncio.CancelledError:
            # (Cancelling this task cancels the future it awaits.) No answer yet: withdraw
            # the request, a held join must not be applied again.
            if future.cancelled() or not future.done():
                self._withdraw(socket, msg_id)
            raise
        finally:
            socket.pending.pop(msg_id, None)
        reply = doc.get("reply")
        if isinstance(reply, dict):
            return reply
        if broken and type(doc.get("departed")) is int:
            return doc
        brief = doc.get("brief")
        if beat and isinstance(brief, list):
            return brief
        status, error = doc.get("status"), doc.get("error")
        if type(status) is int and 400 <= status < 500:
            raise RendezvousConnectionError(
                f"The rendezvous server at {self._endpoint} refused a request on its "
                f"channel ({status}: {error})."
            )
        return None  # 5xx or an answer that does not fit: over HTTP, with its retries

    def _withdraw(self, socket: _Socket, msg_id: int) -> None:
        if socket.ws.closed or socket.reader is None or socket.reader.done():
            return
        note = json.dumps({"id": msg_id, "cancel": True}, separators=(",", ":"))
        task = asyncio.get_running_loop().create_task(socket.ws.send_str(note))
        socket.notes.add(task)  # kept until sent; cancelled if the socket closes first
        task.add_done_callback(socket.notes.discard)
        task.add_done_callback(retrieve)  # a withdrawal the closing socket refused

    def _unanswered(self, what: str) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"The rendezvous server at {self._endpoint} took the connection but answered "
            f"nothing: not {what} (read_timeout)."
        )

    async def _open(self, read_timeout: float) -> _Socket | None:
        loop = asyncio.get_running_loop()
        if self._closed or loop.time() < self._retry_at:
            return None
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # the nodes of a connection open it once
            socket = self._socket
            if socket is not None and not socket.ws.closed:
                return socket
            if self._closed or loop.time() < self._retry_at:
                return None
            limit = min(_OPEN_TIMEOUT, read_timeout)
            try:
                async with fail_after(limit):
                    ws = await self._session.ws_connect(self._url, autoping=True)
            except TimeoutError:
                self._failed(None)
                if limit < _OPEN_TIMEOUT:  # the whole read timeout went by
                    raise self._unanswered(f"the channel's opening within {limit:g} s") from None
                return None
            except aiohttp.WSServerHandshakeError as exc:
                # No channel there: an older server (404, 405), or a proxy on the way that
                # does not pass WebSockets on (the server sees a plain GET: 400).
                self._failed(_NO_CHANNEL_BACKOFF if exc.status in (400, 404, 405) else None)
                return None
            except (aiohttp.ClientError, OSError):
                self._failed(None)
                return None
            if self._closed:
                await ws.close()
                return None
            self._backoff = _FIRST_BACKOFF
            socket = self._socket = _Socket(ws)
            socket.reader = loop.create_task(self._read(socket))
            return socket

    def _failed(self, retry_in: float | None) -> None:
        if retry_in is None:
            retry_in = self._backoff * random.uniform(0.5, 1.0)
            self._backoff = min(self._backoff * 2, _MAX_BACKOFF)
        self._retry_at = asyncio.get_running_loop().time() + retry_in

    async def _read(self, socket: _Socket) -> None:
        try:
            async for msg in socket.ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                try:
                    doc = json.loads(msg.data)
                except ValueError:
                    break  # not the channel's protocol: over HTTP from now
                msg_id = doc.get("id") if isinstance(doc, dict) else None
                future = socket.pending.get(msg_id) if type(msg_id) is int else None
                if future is not None and not future.done():
                    future.set_result(doc)
        except (aiohttp.ClientError, ConnectionError):
            pass
        finally:
            if self._socket is socket:
                self._socket = None
            for future in socket.pending.values():
                if not future.done():
                    future.set_exception(ConnectionResetError("the channel closed"))
            if not socket.ws.closed:
                with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                    await socket.ws.close()

    async def aclose(self) -> None:
        """Close the WebSocket; requests still out go over HTTP (or are cancelled)."""
        self._closed = True
        socket, self._socket = self._socket, None
        if socket is None:
            return
        with contextlib.suppress(aiohttp.ClientError, ConnectionError):
            await socket.ws.close()
        if socket.reader is not None:
            await cancel_and_wait(socket.reader)
        if socket.notes:
            await cancel_and_wait(socket.notes)
