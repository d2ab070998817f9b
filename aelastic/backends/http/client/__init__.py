"""The ``http`` rendezvous backend: a client of the aelastic HTTP rendezvous server.

How it works: :class:`HttpBackend` implements the backend protocol over the server's API
(see :mod:`aelastic.backends.http.server`): a rendezvous request is one message on the
connection's channel (a WebSocket, :mod:`._channel`; a held heartbeat or join waits there)
or, when the channel cannot carry it, one ``POST``; the server applies it atomically.
Waiting for a change uses the run's :class:`~._feed.RunFeed` (one long-poll while somebody
waits, answered when a round transition moves the status's token, never on a heartbeat).
On first use inside an event loop it takes the loop's connection to the server (one aiohttp
session, shared through :mod:`aelastic.backends._shared`, or its own with
``share_connections=false``); :meth:`HttpBackend.aclose` gives it back. Failures that may
be transient are retried with backoff for ``read_timeout`` seconds (config key, default
60), then raise ``RendezvousConnectionError`` naming the server; a refused token (401)
raises at once. The members' key-value store (the ``kv_*`` methods) is :mod:`._store`.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from ....core.brief import beat_key, brief_reply
from ....core.errors import RendezvousConnectionError, RendezvousStateError
from ....core.health import JobHealth
from ....core.params import RendezvousParameters
from ....core.race import uncancellable
from ....core.state import FORMAT_VERSION, NodeDesc, Op, Reply, Request, Snapshot, Status
from ....core.token import Token
from ....core.wire import (
    WireError,
    health_from_json,
    reply_from_json,
    request_to_json,
    snapshot_from_json,
    status_from_json,
)
from ... import _shared
from ..._watch import RunWatch
from ..wire import DEFAULT_PORT, MAX_LISTED_RUNS
from ._endpoint import parse_endpoint, resolve_token
from ._feed import LONG_POLL, RunFeed
from ._store import HttpStore
from ._transport import Connection

__all__ = ["DEFAULT_PORT", "HttpBackend", "create_backend", "parse_endpoint"]

#: Seconds between a waiter's own checks while the long-poll is down.
_RECHECK = 5.0

_private = itertools.count()


class HttpBackend(HttpStore):
    """Rendezvous state and store of one run on an aelastic HTTP rendezvous server.

    Args:
        run_id: The run.
        endpoint: ``host:port``, ``http://host:port[/prefix]`` or ``https://...``.
        token: Bearer token (default: ``AELASTIC_HTTP_TOKEN`` from the environment).
        read_timeout: Seconds the server may keep failing before a call raises.
        share_connections: Share the loop's session with the other backends of the server.
        channel: Send rendezvous requests on the connection's channel (one WebSocket).
        label: The backend's name in progress events (a node hosting torch's ``c10d``
            rendezvous reports ``c10d``, as the user asked for it).

    Raises:
        ValueError: The endpoint, the token or ``read_timeout`` is invalid.
    """

    name = "http"
    #: A keep-alive may be held until the status changes or the next beat is due: the
    #: heartbeat is then also the node's notification channel (one request a beat).
    holds_keep_alive = True

    def __init__(
        self,
        run_id: str,
        endpoint: str,
        *,
        token: str | None = None,
        read_timeout: float = 60.0,
        share_connections: bool = True,
        channel: bool = True,
        label: str = "http",
    ) -> None:
        if not read_timeout > 0:
            raise ValueError(f"The read timeout ({read_timeout}) must be positive.")
        self._base = parse_endpoint(endpoint)
        self._endpoint = str(self._base).rstrip("/")
        self._run_id = run_id
        self._path = "/v1/runs/" + quote(run_id, safe="").replace(".", "%2E")
        self._token = resolve_token(token)
        self._read_timeout = float(read_timeout)
        key: Any = (str(self._base), self._token)
        self._share_key = ("http", key if share_connections else (key, next(_private)))
        self._channel = channel
        self._last: Status | None = None  # of the last reply (a keep-alive's beat key)
        self._beat: Request | None = None  # the last keep-alive (a broken collective's report)
        self._label = label
        self._conn: Connection | None = None
        self._feed: RunFeed | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"HttpBackend(run_id={self._run_id!r}, endpoint={self._endpoint!r})"

    @property
    def endpoint(self) -> str:
        """The server's URL (never with credentials)."""
        return self._endpoint

    @property
    def read_timeout(self) -> float:
        """Seconds the server may keep failing before a call raises (settable)."""
        return self._read_timeout

    @read_timeout.setter
    def read_timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"The read timeout ({seconds}) must be positive.")
        self._read_timeout = float(seconds)

    @property
    def failing(self) -> bool:
        """Whether the server has failed since it last answered (an outage under way)."""
        return self._conn is not None and self._conn.failing_since is not None

    def _open(self) -> tuple[Connection, RunFeed]:
        conn, feed = self._conn, self._feed
        if conn is not None and feed is not None:
            if conn.loop is not asyncio.get_running_loop():
                raise RuntimeError(f"{self!r} is used from another event loop than its first")
            return conn, feed
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        base, token, endpoint = self._base, self._token, self._endpoint
        label = self._label
        conn = _shared.acquire(self._share_key, lambda: Connection(base, token, endpoint, label))
        entry = conn.feeds.get(self._run_id)
        feed = RunFeed(self._poll) if entry is None else entry[0]
        conn.feeds[self._run_id] = (feed, 1 if entry is None else entry[1] + 1)
        self._conn, self._feed = conn, feed
        return conn, feed

    async def _get(self, sub: str, query: dict[str, str] | None = None, hold: float = 0.0) -> Any:
        conn, _ = self._open()
        answer = await conn.call(
            "GET", self._path + sub, self._read_timeout, query=query, hold=hold,
            accept=frozenset({200, 404}),
        )  # fmt: skip
        assert answer is not None
        return answer

    def _fits(self, what: str, exc: WireError) -> RendezvousConnectionError:
        return self._open()[0].protocol_error(f"{what} that does not fit the API ({exc})")

    # -- the rendezvous -------------------------------------------------------------------

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        """Carry out ``request`` on the server (one request, applied atomically).

        With ``hold``, the server keeps a *wait* answer up to that long, until the status
        changes, and applies the request again: a join is then one request per round. A
        keep-alive is held until the status changes, or answered at once when it is past
        ``seen`` already.

        Raises:
            RendezvousConnectionError: The server refused the request or was unreachable.
        """
        try:
            return await self._apply(request, hold, seen)
        except RendezvousConnectionError as exc:
            if "unknown field(s): 'secret'" not in str(exc):
                raise
            raise self._older() from None

    def _older(self) -> RendezvousStateError:
        return RendezvousStateError(
            f"The server at {self._endpoint} does not serve rendezvous state format "
            f"{FORMAT_VERSION} (an older aelastic serve?): run the same aelastic version "
            "on the server and the nodes."
        )

    async def _apply(self, request: Request, hold: float, seen: Token | None) -> Reply:
        conn, feed = self._open()
        hold = min(max(hold, 0.0), LONG_POLL)
        body = request_to_json(request)
        # On the connection's channel, a message on an open WebSocket (a held heartbeat a
        # beat per node, a held join); over HTTP when the channel cannot carry it.
        # A keep-alive sends the beat key of the last status: a plain beat is then answered
        # briefly (``core/brief.py``), on the channel.
        base = None
        if request.op is Op.KEEP_ALIVE:
            base, self._beat = self._last, request
        doc: dict[str, Any] | list[Any] | None = None
        if self._channel:
            tried = asyncio.get_running_loop().time()
            doc = await conn.channel.send(
                self._run_id, body, hold, seen, beat_key(base), read_timeout=self._read_timeout
            )
            if doc is None and asyncio.get_running_loop().time() - tried > hold + 1.0:
                # The channel waited on a server that said nothing: its time counts in the
                # request's read timeout over HTTP (an outage since then).
                conn.failing_since = conn.failing_since or tried
        if doc is None:
            answer = await conn.call(
                "POST", self._path + "/rendezvous", self._read_timeout,
                body=body, accept=frozenset({200, 404, 405}),
                query=_hold_query(hold, seen), hold=hold,
            )  # fmt: skip
            assert answer is not None
            status, doc = answer
        else:
            status, conn.failing_since = 200, None  # the server answers (an outage is over)
        if status != 200:
            raise self._older()
        try:
            if isinstance(doc, list) and base is not None:
                reply = brief_reply(doc, base)
            else:
                reply = reply_from_json(doc)
        except ValueError as exc:  # WireError included
            raise self._fits("a reply", WireError(str(exc))) from None
        self._last = reply.status
        if request.op is Op.JOIN and reply.known:
            # Its keep-alive, before the first one is sent (a broken collective's report).
            self._beat = replace(request, op=Op.KEEP_ALIVE, expired=False, port=0)
        feed.watch.on_status(reply.status)
        return reply

    async def report_departures(self, me: NodeDesc) -> int:
        """Say on the channel that ``me``'s workers' collective broke (its last keep-alive,
        marked): the server then loses the members whose channels it saw end, without the
        rest of their grace (``server/_departures.py``). Nothing without a channel (plain
        HTTP requests are not tied to a connection: the heartbeat window decides).

        Returns:
            How many members the server lost on it.
        """
        beat = self._beat
        if not self._channel or beat is None or beat.node != me:
            return 0
        conn, _ = self._open()
        doc = await conn.channel.send(
            self._run_id,
            request_to_json(beat),
            0,
            None,
            broken=True,
            read_timeout=self._read_timeout,
        )
        departed = doc.get("departed") if isinstance(doc, dict) else None
        return departed if type(departed) is int else 0

    async def _poll(self, token: str, hold: float) -> Status:
        query = {"token": token, "wait": f"{hold:g}"} if hold else None
        _, doc = await self._get("/status", query, hold)
        try:
            return status_from_json(doc)
        except WireError as exc:
            raise self._fits("a status", exc) from None

    async def _status_now(self) -> Status:
        return await self._poll("", 0.0)

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        """The run's status once its token differs from ``token`` (``None`` on timeout).

        Raises:
            RendezvousConnectionError: The server was unreachable for ``read_timeout``.
        """
        _, feed = self._open()
        watch: RunWatch = feed.watch
        return await watch.wait_status(token, timeout, self._status_now, _RECHECK)

    async def snapshot(self) -> Snapshot | None:
        """The run's whole membership, or ``None`` when the server has no such run."""
        status, doc = await self._get("")
        if status == 404:
            return None
        try:
            return snapshot_from_json(doc)
        except WireError as exc:
            raise self._fits("a snapshot", exc) from None

    async def health(self) -> JobHealth | None:
        """The job's health as the server keeps it, or ``None`` when it has no such run."""
        status, doc = await self._get("/health")
        if status == 404:
            return None
        try:
            return health_from_json(doc)
        except WireError as exc:
            raise self._fits("the job's health", exc) from None

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        """The runs with a rendezvous state on the server (sorted by id, at most ``limit``).

        Raises:
            RendezvousConnectionError: The server was unreachable, or does not list runs.
        """
        conn, _ = self._open()
        limit = min(max(limit, 1), MAX_LISTED_RUNS)
        answer = await conn.call(
            "GET", "/v1/runs", self._read_timeout, query={"limit": str(limit)},
            accept=frozenset({200, 404, 405}),
        )  # fmt: skip
        assert answer is not None
        if answer[0] != 200:
            raise conn.protocol_error(f"{answer[0]} to GET /v1/runs (an older aelastic serve?)")
        runs = answer[1].get("runs")
        if not isinstance(runs, list):
            raise conn.protocol_error("a run list without 'runs'")
        found: list[tuple[str, Status]] = []
        for entry in runs:
            run_id = entry.get("run_id") if isinstance(entry, dict) else None
            if not isinstance(run_id, str):
                raise conn.protocol_error("a run list entry without a 'run_id'")
            try:
                found.append((run_id, status_from_json(entry.get("status"))))
            except WireError as exc:
                raise self._fits("a run list", exc) from None
        return found

    async def close_run(self) -> bool:
        """Close the run as its operator (``POST .../close``: the server's token, or its own
        machine when it has none); whether it was open.

        Raises:
            RendezvousConnectionError: The server refused (403: no token and not on its
                machine) or could not be reached.
        """
        conn, _ = self._open()
        answer = await conn.call("POST", self._path + "/close", self._read_timeout, body={})
        assert answer is not None
        return answer[1].get("closed") is True

    async def reset(self) -> bool:
        """Delete the run's state and store on the server; whether there was anything."""
        conn, _ = self._open()
        answer = await conn.call("DELETE", self._path, self._read_timeout, idempotent=False)
        assert answer is not None
        return answer[1].get("deleted") is True

    async def aclose(self) -> None:
        """Release this backend's share of the session and feed. Idempotent. Cancelling
        the caller lets the release finish first."""
        await uncancellable(self._release())

    async def _release(self) -> None:
        self._closed = True
        conn, feed, self._conn, self._feed = self._conn, self._feed, None, None
        if conn is None or feed is None:
            return
        entry = conn.feeds.get(self._run_id)
        if entry is not None and entry[0] is feed:
            if entry[1] > 1:
                conn.feeds[self._run_id] = (feed, entry[1] - 1)
            else:
                del conn.feeds[self._run_id]
                await feed.aclose()
        await _shared.release(self._share_key, conn)


def create_backend(params: RendezvousParameters) -> HttpBackend:
    """Create the HTTP backend for ``params.run_id`` at ``params.endpoint``.

    Config keys: ``token`` (default: ``AELASTIC_HTTP_TOKEN``), ``read_timeout`` (seconds,
    default 60), ``share_connections`` (default true), ``channel`` (default true).

    Raises:
        ValueError: The endpoint or a config value is invalid.
    """
    read_timeout = params.get_as_float("read_timeout", 60.0)
    assert read_timeout is not None
    token = params.get("token")
    return HttpBackend(
        params.run_id,
        params.endpoint,
        token=None if token is None else str(token),
        read_timeout=read_timeout,
        share_connections=bool(params.get_as_bool("share_connections", True)),
        channel=bool(params.get_as_bool("channel", True)),
    )


def _hold_query(hold: float, seen: Token | None) -> dict[str, str] | None:
    if hold <= 0:
        return None
    return {"hold": f"{hold:.3f}"} if seen is None else {"hold": f"{hold:.3f}", "seen": seen}
