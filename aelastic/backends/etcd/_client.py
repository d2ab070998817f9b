"""A lean client of etcd's v3 API over gRPC.

How it works: every etcd member serves its v3 API over gRPC on its client port. The
backend's modules build requests and read answers in the shape of etcd's JSON API (paths
such as ``/v3/kv/txn``; keys and values in base64, 64-bit numbers as strings), which
:mod:`._proto` carries to and from etcd's protobuf messages. A :class:`EtcdClient` holds
one HTTP/2 connection to each member it talks to (:mod:`._pool`, :mod:`._h2`), which
carries its calls, its watch and its leases' renewals (one keep-alive stream,
:mod:`._renewals`), and talks to one member at a time, starting at a random one (the
nodes of a job spread over the members), and moves to the next at once when a member is
gone, has no leader or times out. A call is retried with backoff (after every member was
tried) until ``read_timeout`` runs out, then fails with ``RendezvousConnectionError``
naming the endpoint; the time counts from the first failure since etcd last answered, so a
call made during an outage gets what is left (at least one attempt). What retrying cannot
mend fails at once with one clear line: a server that does not answer etcd's API (another
program on that port), a refused login, a permission etcd denies. With a user and password
(from the environment) the client logs in (``Authenticate``) and sends the token with
every call, logging in again when etcd says the token is no longer valid.

Why not a maintained asyncio etcd client: the ones published (``aetcd``) bring grpcio and
protobuf (tens of MB, a C core with threads and fork handlers of its own) to every node,
while the rendezvous needs a dozen calls. Why gRPC and not etcd's JSON gateway, which an
HTTP/1.1 client can speak (aelastic did): the gateway translates every request into a
gRPC call to its own member, and that cost etcd 2.5-3 times the CPU of the same call over
gRPC (measured: 0.43-0.75 ms against 0.15-0.2 ms a request, docs/benchmarks.md), and a
node's watch and keep-alive stream each took a connection of their own.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from ...core.errors import RendezvousConnectionError
from ...core.events import BackendRetry, report
from ._answers import (
    DEADLINE,
    PERMISSION,
    UNAUTHENTICATED,
    UNAVAILABLE,
    Compacted,
    EtcdError,
    Hangup,
    LeaseNotFound,
    Misbehaved,
    NotEtcd,
    TlsFailure,
    Transient,
    auth_error,
    b64,
    etcd_error,
    retryable,
    unb64,
)
from ._endpoint import EtcdEndpoint
from ._failures import (
    auth_failure,
    misbehaved,
    not_etcd,
    refused_by_member,
    tls_refused,
    unreachable,
)
from ._h2 import Metadata
from ._pool import Pool
from ._probe import CONNECT_TIMEOUT, LAST_ATTEMPT, SLOW, Terms
from ._proto import METHODS, ProtoError, decode, encode
from ._renewals import Renewals

__all__ = [
    "SLOW",
    "Compacted",
    "EtcdClient",
    "EtcdError",
    "LeaseNotFound",
    "b64",
    "unb64",
]


class EtcdClient:
    """One session with the members of an etcd cluster (see the module docstring).

    Args:
        endpoint: The members, TLS files and login.
        read_timeout: Seconds a call keeps retrying before ``RendezvousConnectionError``.
    """

    def __init__(self, endpoint: EtcdEndpoint, read_timeout: float = 60.0) -> None:
        self.endpoint = endpoint
        self.read_timeout = float(read_timeout)
        self._urls = endpoint.urls
        self._members = dict(zip(self._urls, endpoint.members, strict=True))
        self._current = random.randrange(len(self._urls))
        self._pool: Pool | None = None
        self._renewals: Renewals | None = None  # the keep-alive stream, once a lease beats
        self._token: str | None = None
        self._auth_lock: asyncio.Lock | None = None
        self._closed = False
        #: Requests sent (tests and benchmarks read it).
        self.requests = 0
        self._terms = Terms(tuple(sorted(self._urls)))  # the Raft terms heard
        self._failing_since: float | None = None  # when the current outage began

    @property
    def display(self) -> str:
        """The endpoint for messages (no credentials)."""
        return self.endpoint.display

    @property
    def member(self) -> str:
        """The member this client talks to now."""
        return self._urls[self._current]

    def _pool_now(self) -> Pool:
        if self._closed:
            raise RendezvousConnectionError(f"The etcd client for {self.display} is closed.")
        if self._pool is None:
            self._pool = Pool(self.endpoint.ssl_context())
        return self._pool

    def next_member(self, after: str | None = None) -> None:
        """Talk to the next member (if the current one is still ``after``)."""
        if after is None or self._urls[self._current] == after:
            self._current = (self._current + 1) % len(self._urls)

    # -- one request ----------------------------------------------------------------------

    def _connect_within(self, timeout: float) -> float:
        """How long connecting to a member may take (see :data:`CONNECT_TIMEOUT`)."""
        return min(timeout, CONNECT_TIMEOUT) if len(self._urls) > 1 else timeout

    async def _post(
        self,
        url: str,
        requests: list[tuple[str, dict[str, Any]]],
        timeout: float,
        ordered: bool = True,
    ) -> list[dict[str, Any] | EtcdError]:
        """One attempt at member ``url`` (see :data:`SLOW` for one that takes long)."""
        sent = self._send(url, requests, timeout, ordered)
        return await self._terms.patiently(url, sent, self._term_of)

    async def _term_of(self, base: str) -> int:
        answer = (await self._send(base, [("/v3/maintenance/status", {})], SLOW))[0]
        if isinstance(answer, EtcdError):
            raise answer
        return 0 if not answer.get("leader") else int(answer["header"].get("raft_term", 0))

    async def _send(
        self,
        url: str,
        requests: list[tuple[str, dict[str, Any]]],
        timeout: float,
        ordered: bool = True,
    ) -> list[dict[str, Any] | EtcdError]:
        """``requests`` (by their JSON API path) to member ``url``, one after the other
        (``ordered``) or at once: each one's answer, or etcd's error (raised: what the
        connection or a non-etcd server did)."""
        pool = self._pool_now()
        host, port = self._members[url]
        methods = [METHODS[path] for path, _ in requests]
        calls = [
            (m.path, encode(m.request, body))
            for m, (_, body) in zip(methods, requests, strict=True)
        ]
        self.requests += len(requests)
        responses = await pool.exchange(
            host, port, calls, self._metadata(), timeout, self._connect_within(timeout), ordered
        )
        answers: list[dict[str, Any] | EtcdError] = []
        for method, response in zip(methods, responses, strict=True):
            if response.code:
                answers.append(etcd_error(response.text, response.code))
                continue
            if not response.messages:
                raise NotEtcd(f"no answer to {method.path}")
            try:
                answer = decode(method.answer, response.messages[0])
            except ProtoError as exc:
                raise NotEtcd(f"an answer to {method.path} not understood ({exc})") from None
            self._terms.saw(answer)
            answers.append(answer)
        return answers

    def _metadata(self) -> Metadata:
        """The gRPC metadata of every call: etcd's auth token, once logged in."""
        return ((b"token", self._token.encode()),) if self._token else ()

    async def call(
        self, path: str, body: dict[str, Any], what: str, within: float | None = None
    ) -> dict[str, Any]:
        """POST ``body`` to ``path`` on a member, with failover and retries.

        Args:
            path: The API path (``/v3/kv/txn``...).
            body: The request (JSON).
            what: What the call does, for messages.
            within: Seconds to keep trying (default: ``read_timeout``).

        Raises:
            RendezvousConnectionError: No member answered in time, the server is not etcd,
                or etcd refused the login or the permission.
            EtcdError: etcd refused the request itself (``Compacted``, ``LeaseNotFound``...).
        """
        answer = (await self.call_many(lambda: [(path, body)], what, within))[0]
        if isinstance(answer, EtcdError):
            raise answer
        return answer

    async def call_many(
        self,
        make: Callable[[], list[tuple[str, dict[str, Any]]]],
        what: str,
        within: float | None = None,
        ordered: bool = True,
    ) -> list[dict[str, Any] | EtcdError]:
        """The requests ``make()`` gives, to one member: each sent once the one before was
        answered (``ordered``), or all at once; with failover and retries as :meth:`call`
        (each attempt asks ``make`` again); their answers, or etcd's refusals, in order.

        Raises:
            RendezvousConnectionError: As :meth:`call`.
        """
        return await self._retrying(
            lambda url, remaining: self._post(url, make(), remaining, ordered), what, within
        )

    async def keep_alive(self, lease: int, within: float | None = None) -> dict[str, Any]:
        """Renew ``lease`` on this client's keep-alive stream (:mod:`._renewals`), with
        failover and retries as :meth:`call`: etcd's answer (``TTL``: the time to live
        left; none, the lease is gone).

        Raises:
            RendezvousConnectionError: As :meth:`call`.
        """

        async def one(url: str, remaining: float) -> list[dict[str, Any] | EtcdError]:
            self.requests += 1
            answer = await self._renewals_now().renew(
                url, self._members[url], self._metadata(), lease,
                self._connect_within(remaining), remaining,
            )  # fmt: skip
            self._terms.saw(answer)
            return [answer]

        async def renew(url: str, remaining: float) -> list[dict[str, Any] | EtcdError]:
            return await self._terms.patiently(url, one(url, remaining), self._term_of)

        answer = (await self._retrying(renew, "keep-alive", within))[0]
        assert not isinstance(answer, EtcdError)  # the stream's refusals are raised
        return answer

    @property
    def streaming(self) -> bool:
        """Whether the keep-alive stream to the current member is open."""
        return self._renewals is not None and self._renewals.ready(self.member)

    def open_keep_alive(self) -> None:
        """Open the keep-alive stream now, in the background: a node about to hold a lease
        then finds it open at its first renewal (opening one is an HTTP upgrade and a gRPC
        stream in etcd, which a busy etcd took seconds over at 1,024 nodes)."""
        if not self._closed:
            url, within = self._urls[self._current], self.read_timeout
            self._renewals_now().warm(
                url, self._members[url], self._metadata(), self._connect_within(within), within
            )

    def _renewals_now(self) -> Renewals:
        if self._renewals is None:
            self._renewals = Renewals(self._pool_now)
        return self._renewals

    async def _retrying(
        self,
        attempt: Callable[[str, float], Awaitable[list[dict[str, Any] | EtcdError]]],
        what: str,
        within: float | None,
    ) -> list[dict[str, Any] | EtcdError]:
        """``attempt(member, seconds)`` until it answers, with failover and retries as
        :meth:`call`."""
        loop = asyncio.get_running_loop()
        budget = self.read_timeout if within is None else within
        delay, tried, relogged, hangups = 0.05, 0, False, 0
        first_failure: float | None = None  # this call's budget counts from here, or before
        while True:
            url = self._urls[self._current]
            started = loop.time()
            # The budget counts from the first failure since etcd last answered (an outage's
            # countdown never starts again for a call made during it), and never from later
            # than this call's own first failure (others' answers do not renew it).
            since = min(t for t in (started, first_failure, self._failing_since) if t is not None)
            deadline = since + budget
            remaining = max(deadline - started, min(budget, LAST_ATTEMPT))
            try:
                if self.endpoint.username and self._token is None:
                    await self._login(url, remaining)
                answers = await attempt(url, remaining)
                for answer in answers:
                    if isinstance(answer, EtcdError) and refused_by_member(answer):
                        raise answer
                self._failing_since = None
                return answers
            except Misbehaved as exc:
                raise misbehaved(url, what, exc) from None
            except NotEtcd as exc:
                raise not_etcd(self.endpoint, url, what, exc) from None
            except TlsFailure as exc:
                raise tls_refused(self.endpoint, url, what, exc) from None
            except EtcdError as exc:
                if exc.code == UNAUTHENTICATED and self.endpoint.username and not relogged:
                    self._token, relogged = None, True  # expired token: log in again
                    continue
                if exc.code in (UNAUTHENTICATED, PERMISSION) or auth_error(exc):
                    raise auth_failure(self.endpoint, what, exc) from None
                if exc.code not in (UNAVAILABLE, DEADLINE) and not retryable(exc):
                    raise
                error: Exception = exc
            except Transient as exc:
                error = exc
                # A server that keeps taking connections and closing them unanswered is not
                # an etcd member (an etcd member that dies refuses connections afterwards).
                hangups = hangups + 1 if isinstance(exc, Hangup) else 0
                if hangups >= 3 * len(self._urls):
                    raise not_etcd(self.endpoint, self.display, what, exc) from None
            self.next_member(url)
            tried += 1
            if self._failing_since is None:
                self._failing_since = since
            first_failure = since
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise unreachable(self.endpoint, budget, what, error, url) from None
            report(
                BackendRetry(
                    backend="etcd",
                    endpoint=self.display,
                    what=what,
                    error=f"{url}: {error}",
                    retry_for=remaining,
                )
            )
            if tried % len(self._urls) == 0:  # every member tried: back off
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    async def _login(self, url: str, within: float) -> None:
        if self._auth_lock is None:
            self._auth_lock = asyncio.Lock()
        async with self._auth_lock:
            if self._token is not None:
                return
            body = {"name": self.endpoint.username, "password": self.endpoint.password or ""}
            answer = (await self._post(url, [("/v3/auth/authenticate", body)], within))[0]
            if isinstance(answer, EtcdError):
                if "not enabled" not in str(answer):
                    raise answer
                self._token = ""  # etcd does not check logins: none is sent
                return
            token = answer.get("token")
            if not isinstance(token, str) or not token:
                raise EtcdError("etcd did not give an auth token (is auth enabled?)", 0)
            self._token = token

    # -- streams --------------------------------------------------------------------------

    @asynccontextmanager
    async def stream(
        self, path: str, body: dict[str, Any] | list[dict[str, Any]], timeout: float | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streamed call to the current member (a watch): its requests ``body`` (one, or
        several in order), then etcd's answers one by one (for ``timeout`` seconds at most,
        when given).

        Raises:
            RendezvousConnectionError: The server is not etcd.
            Transient-like errors surface as ``ConnectionError``; etcd's as ``EtcdError``.
        """
        pool = self._pool_now()
        url = self._urls[self._current]
        if self.endpoint.username and self._token is None:
            await self._login(url, self.read_timeout)
        method = METHODS[path]
        host, port = self._members[url]
        connect = self._connect_within(timeout or self.read_timeout)
        self.requests += 1
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        requests = [
            encode(method.request, one) for one in (body if isinstance(body, list) else [body])
        ]
        try:
            async with pool.stream(
                host, port, method, requests, self._metadata(), connect, deadline
            ) as docs:
                yield self._noting(docs)
        except Misbehaved as exc:
            raise misbehaved(url, "watch", exc) from None
        except NotEtcd as exc:
            raise not_etcd(self.endpoint, url, "watch", exc) from None
        except TlsFailure as exc:
            raise tls_refused(self.endpoint, url, "watch", exc) from None
        except Transient as exc:
            raise ConnectionError(f"{url}: {exc}") from None

    async def _noting(self, docs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """``docs``, each one's Raft term noted (a watch's answers tell it too)."""
        async for doc in docs:
            self._terms.saw(doc)
            yield doc

    async def aclose(self) -> None:
        """Close the connections. Idempotent."""
        self._closed = True
        if self._renewals is not None:
            self._renewals.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()
