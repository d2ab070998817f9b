"""The HTTP client's transport: one session per event loop and server, with retries.

How it works: the backends of one event loop that talk to the same server (base URL and
token) share a :class:`Connection` (see :mod:`aelastic.backends._shared`): one aiohttp
``ClientSession`` whose connector keeps connections alive and sets no limit on their number
(long-polls hold theirs), and the feeds of the runs in use. :meth:`Connection.call` sends one
request and retries what may be transient (connection refused or reset, timeouts, 5xx
answers) with a jittered exponential backoff, for as long as the server has failed for less
than ``read_timeout`` seconds; then it raises ``RendezvousConnectionError`` naming the
server. The time counts from the first failure of the outage, not of the call
(:attr:`Connection.failing_since`, cleared by any answer), or of the call if that came
first: a call made while the server has been failing for a while gets what is left of the
budget (at least one attempt), so the countdown of "retrying for N s more" never starts
again while nothing answers (heartbeats, a watch and the leave of a stopping node are so
many calls), and the answers other calls get never renew it. A ``401`` is never retried: it
raises at once, saying the server refused the token. A ``429`` with ``Retry-After`` (the
server throttles token checks from this client's address, which a neighbour sending wrong
tokens may have caused) is waited out, within the same budget.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from yarl import URL

from ....core.errors import RendezvousConnectionError
from ....core.events import BackendRetry, report
from ..wire import TOKEN_ENV
from ._channel import Channel

if TYPE_CHECKING:
    from ._feed import RunFeed

__all__ = ["Connection"]

_RETRY_STATUSES = frozenset({500, 502, 503, 504})
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 1.0
#: Extra seconds a long-poll attempt may take beyond what the server was asked to hold it.
_HOLD_MARGIN = 10.0
#: Seconds the one attempt of a call made after the outage's budget ran out may take.
_LAST_ATTEMPT = 2.0


class Connection:
    """A shared session to one rendezvous server, from one event loop.

    Args:
        base: The server's base URL (scheme, host, port and optional path prefix).
        token: Bearer token to send (``None``: none).
        endpoint: How to name the server in messages (no credentials).
        label: How to name the backend in progress events.
    """

    def __init__(self, base: URL, token: str | None, endpoint: str, label: str = "http") -> None:
        self.base = base
        self.endpoint = endpoint
        self.label = label
        self.loop = asyncio.get_running_loop()
        self.feeds: dict[str, tuple[RunFeed, int]] = {}  # run id -> (feed, users)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60)
        self.session = aiohttp.ClientSession(connector=connector, headers=headers)
        #: The rendezvous channel (keep-alives as WebSocket messages), opened on first use.
        self.channel = Channel(self.session, base, endpoint)
        #: Loop time of the first failure since the server last answered (``None``: it does).
        self.failing_since: float | None = None

    async def call(
        self,
        method: str,
        path: str,
        read_timeout: float,
        *,
        body: Mapping[str, Any] | None = None,
        query: Mapping[str, str] | None = None,
        hold: float = 0.0,
        accept: frozenset[int] = frozenset({200}),
        idempotent: bool = True,
        give_up_at: float | None = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """Send a request, retrying transient failures; the answer's status and JSON body.

        Args:
            method: HTTP method.
            path: Path below the base URL, already URL-encoded.
            read_timeout: Seconds the server may keep failing before this gives up.
            body: JSON body.
            query: Query parameters.
            hold: Seconds the server may hold the request (long-polls).
            accept: Statuses handed back to the caller; any other fails the call.
            idempotent: If not, an ``Idempotency-Key`` makes retries safe.
            give_up_at: Loop time after which to stop retrying and return ``None``.

        Raises:
            RendezvousConnectionError: The server refused the request (401, 4xx), answered
                something that is not the rendezvous API, or could not be reached for
                ``read_timeout`` seconds.
        """
        url = self.base.with_path(self.base.path.rstrip("/") + path, encoded=True)
        if query:
            url = url.with_query(query)
        headers = {} if idempotent else {"Idempotency-Key": uuid.uuid4().hex}
        loop = asyncio.get_running_loop()
        answered: str | None = None  # the first failure the server itself reported
        first_failure: float | None = None  # this call's budget counts from here, or before
        backoff = _FIRST_BACKOFF
        while True:
            started = loop.time()
            since = min(t for t in (started, first_failure, self.failing_since) if t is not None)
            remaining = max(since + read_timeout - started, min(read_timeout, _LAST_ATTEMPT))
            if hold:
                remaining = min(remaining, _HOLD_MARGIN)
            try:
                timeout = aiohttp.ClientTimeout(total=hold + max(remaining, 0.001))
                async with self.session.request(
                    method, url, json=body, headers=headers, timeout=timeout
                ) as response:
                    status = response.status
                    wait = _retry_after(response) if status == 429 else None
                    if status not in _RETRY_STATUSES and wait is None:
                        self.failing_since = None
                        return status, await self._answer(response, method, accept)
                    problem = f"it answered {status} ({await _error_text(response)})"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                problem = _describe(exc)
                wait = None
            if answered is None and problem.startswith("it answered"):
                answered = problem
            if self.failing_since is None:
                self.failing_since = since
            first_failure = since  # never later: others' answers do not renew this call's
            now = loop.time()
            if now - first_failure >= read_timeout:
                if answered is not None and answered != problem:
                    problem = f"{problem}; before that {answered}"
                raise RendezvousConnectionError(
                    f"The rendezvous server at {self.endpoint} could not be reached for "
                    f"{now - first_failure:.3g} s (read_timeout {read_timeout:g} s): {problem}."
                )
            if give_up_at is not None and now >= give_up_at:
                return None
            retry_for = first_failure + read_timeout - now
            report(
                BackendRetry(
                    backend=self.label,
                    endpoint=self.endpoint,
                    what=f"{method} {path}",
                    error=problem,
                    retry_for=retry_for,
                )
            )
            delay = backoff * random.uniform(0.5, 1.0) if wait is None else wait
            delay = min(delay, first_failure + read_timeout - now)
            if give_up_at is not None:
                delay = min(delay, max(give_up_at - now, 0.0))
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def _answer(
        self, response: aiohttp.ClientResponse, method: str, accept: frozenset[int]
    ) -> dict[str, Any]:
        status = response.status
        if status == 401:
            raise RendezvousConnectionError(
                f"The rendezvous server at {self.endpoint} refused the request (401 "
                f"Unauthorized): give it the right token (config key 'token' or {TOKEN_ENV})."
            )
        if status not in accept:
            raise RendezvousConnectionError(
                f"The rendezvous server at {self.endpoint} refused {method} "
                f"{response.url.path} ({status}: {await _error_text(response)})."
            )
        try:
            doc = await response.json(content_type=None)
        except (ValueError, aiohttp.ClientPayloadError) as exc:
            raise RendezvousConnectionError(
                f"The server at {self.endpoint} answered {status} with a body that is not "
                f"JSON ({exc}): is it an aelastic rendezvous server?"
            ) from None
        if not isinstance(doc, dict):
            raise RendezvousConnectionError(
                f"The server at {self.endpoint} answered {status} with unexpected JSON: "
                "is it an aelastic rendezvous server?"
            )
        return doc

    async def aclose(self) -> None:
        """Stop the run feeds and close the session."""
        feeds = [feed for feed, _ in self.feeds.values()]
        self.feeds.clear()
        for feed in feeds:
            await feed.aclose()
        await self.channel.aclose()
        await self.session.close()

    def protocol_error(self, what: str) -> RendezvousConnectionError:
        """The error for an answer that does not fit the API."""
        return RendezvousConnectionError(
            f"The server at {self.endpoint} answered {what}: is it an aelastic rendezvous "
            "server of the same version?"
        )


async def _error_text(response: aiohttp.ClientResponse) -> str:
    try:
        doc = await response.json(content_type=None)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return str(doc["error"])
    except (ValueError, aiohttp.ClientError):
        pass
    return response.reason or "no reason given"


def _retry_after(response: aiohttp.ClientResponse) -> float | None:
    """Seconds a ``429`` asks to wait (``Retry-After`` in seconds), or ``None`` if it does not
    say: a 429 without it (a client past its limit of nodes) is a refusal, not a wait."""
    try:
        seconds = float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds < 3600 else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "the request timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
