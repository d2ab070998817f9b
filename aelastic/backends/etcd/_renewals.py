"""The lease renewals of one client on one long-lived stream: etcd's ``LeaseKeepAlive``.

How it works: a client (the backends of one event loop share it; with
``share_connections=false`` each backend has its own) keeps one ``LeaseKeepAlive`` call
open on its connection to its current member (:mod:`._pool`: a stream of the connection
its other calls use); renewing a lease is one message on it (``{"ID": ...}``) and etcd
answers each in the order sent, with the lease's id and its time to live left (none: the
lease is gone). The leases stay the nodes' own: a node's lease is renewed only when that
node beats, so a node that stops beating, or is closed, loses its lease alone. A process
that dies takes its stream with it, and every lease it renewed runs out after its time to
live: they would anyway, the nodes died with it.

Measured on the 2-core machine (1,024 leases renewed once a second, one etcd 3.4.23,
through etcd's JSON gateway): etcd spent 0.37-0.46 ms of CPU on a keep-alive request and
0.15-0.2 ms on a keep-alive message on a stream; the client 0.3-0.4 ms against 0.05-0.1 ms
(docs/benchmarks.md, the etcd section).

A stream that breaks, that etcd ends (with an error: a member that lost its leader, or a
leader that could not apply in time), or that is left for another member fails every
renewal waiting on it; the client's retry loop sends them again, on a new stream
(:meth:`._client.EtcdClient.keep_alive`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from ...core.race import retrieve, wait_within
from ._answers import Transient, etcd_error
from ._h2 import Call, Metadata
from ._pool import Pool
from ._proto import METHODS, ProtoError, decode, encode

__all__ = ["Renewals"]

METHOD = METHODS["/v3/lease/keepalive"]


class _Stream:
    """One ``LeaseKeepAlive`` call to a member and the renewals waiting for its answers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.call: Call | None = None
        self.pending: dict[int, deque[asyncio.Future[dict[str, Any]]]] = {}
        self.ended = False

    def message(self, raw: bytes) -> None:
        try:
            doc = decode(METHOD.answer, raw)
        except ProtoError as exc:
            self.end(Transient(f"a keep-alive answer not understood ({exc})"))
            return
        waiting = self.pending.get(int(doc.get("ID", 0) or 0))
        if not waiting:
            return  # a renewal nobody waits for any more (its caller gave up)
        future = waiting.popleft()
        if not future.done():
            future.set_result(doc)

    def done(self, done: asyncio.Future[tuple[int, str]]) -> None:
        if done.cancelled():
            self.end(None)
            return
        exc = done.exception()
        if exc is None:
            code, text = done.result()
            exc = etcd_error(text, code) if code else None
        self.end(exc)

    def end(self, exc: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        if self.call is not None:
            self.call.cancel()
        error = exc or Transient("the keep-alive stream ended")
        pending, self.pending = self.pending, {}
        for waiting in pending.values():
            for future in waiting:
                if not future.done():
                    future.set_exception(error)
                    future.exception()  # retrieved: its waiter may be gone


class Renewals:
    """The keep-alive stream of one client (see the module docstring).

    Args:
        pool: The client's connections (TLS as its members').
    """

    def __init__(self, pool: Callable[[], Pool]) -> None:
        self._pool = pool
        self._stream: _Stream | None = None
        self._opening: asyncio.Future[_Stream] | None = None

    async def _open(
        self, url: str, member: tuple[str, int], metadata: Metadata, connect: float, within: float
    ) -> _Stream:
        stream = _Stream(url)
        connection = await self._pool().connection(*member, min(connect, within))
        stream.call = connection.call(METHOD.path, None, metadata, False, stream.message)
        stream.call.done.add_done_callback(stream.done)
        return stream

    async def _stream_to(
        self, url: str, member: tuple[str, int], metadata: Metadata, connect: float, within: float
    ) -> _Stream:
        stream = self._stream
        if stream is not None and stream.url == url and not stream.ended:
            return stream
        opening = self._opening
        if opening is None or opening.done():
            if stream is not None:  # another member now, or ended: left for a new one
                stream.end(Transient(f"the keep-alive stream moved from {stream.url}"))
                self._stream = None
            opening = self._opening = asyncio.ensure_future(
                self._open(url, member, metadata, connect, within)
            )
            opening.add_done_callback(self._opened)
        stream = await asyncio.shield(opening)
        if stream.url != url or stream.ended:
            raise Transient("the keep-alive stream ended while it opened")
        return stream

    def _opened(self, opening: asyncio.Future[_Stream]) -> None:
        if self._opening is opening:
            self._opening = None
        if opening.cancelled() or opening.exception() is not None:
            return
        self._stream = opening.result()

    async def renew(
        self,
        url: str,
        member: tuple[str, int],
        metadata: Metadata,
        lease: int,
        connect: float,
        timeout: float,
    ) -> dict[str, Any]:
        """Renew ``lease`` on the stream to member ``url``: etcd's answer (``TTL`` left;
        none: the lease is gone).

        Raises:
            Transient: The stream could not be opened, broke, or gave no answer within
                ``timeout`` s.
            EtcdError: etcd ended the stream with an error.
            NotEtcd, TlsFailure: As the client's requests.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stream = await self._stream_to(url, member, metadata, connect, timeout)
        assert stream.call is not None
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        stream.pending.setdefault(lease, deque()).append(future)
        stream.call.send(encode(METHOD.request, {"ID": lease}))
        try:
            return await wait_within(asyncio.shield(future), deadline - loop.time())
        except TimeoutError:
            raise Transient(f"no keep-alive answer within {timeout:g} s") from None

    def ready(self, url: str) -> bool:
        """Whether the stream to member ``url`` is open."""
        stream = self._stream
        return stream is not None and stream.url == url and not stream.ended

    def warm(
        self, url: str, member: tuple[str, int], metadata: Metadata, connect: float, within: float
    ) -> None:
        """Start opening the stream to member ``url`` (in the background; a failure is left
        for the first renewal to meet again), unless it is open or opening."""
        if self.ready(url) or self._opening is not None:
            return
        opening = asyncio.ensure_future(self._stream_to(url, member, metadata, connect, within))
        opening.add_done_callback(retrieve)  # the renewal that needs it meets it again

    def close(self) -> None:
        """End the stream (every renewal waiting on it fails). Idempotent."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.end(Transient("the client is closed"))
        if self._opening is not None:
            self._opening.cancel()
