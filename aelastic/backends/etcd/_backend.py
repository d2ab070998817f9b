"""The etcd backend: one run's rendezvous state and members' store in an etcd cluster.

How it works: a request is carried out by :class:`~._apply.RunPort` (one read, at most one
compared write: the state machine's port, :mod:`._port`); news comes from the run's one
watch in this process (:class:`~._changes.RunStream`). Backends of one event loop and
endpoint share a client and the run's watch (``share_connections=false`` gives each its
own, what separate hosts have). A heartbeat renews the node's lease and nothing else, and
a node whose join would only wait again, as far as its watch tells, asks no more than that
either (:mod:`._waits`): an idle member costs etcd one keep-alive per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ...core.errors import RendezvousConnectionError
from ...core.health import JobHealth
from ...core.race import uncancellable
from ...core.state import NodeDesc, Op, Outcome, Reply, Request, Snapshot, Status, Transition
from ...core.token import Token, make
from .. import _shared
from ._apply import RunPort
from ._changes import RunStream, now_ms
from ._client import EtcdClient, LeaseNotFound, b64, unb64
from ._endpoint import EtcdEndpoint
from ._layout import RunKeys, prefix_end
from ._leases import Leases
from ._store import KeyValue
from ._waits import Known, join_waits

__all__ = ["EtcdBackend", "Shared"]

#: Members of a complete round whose process watches for lost members (ranks 0..2).
SENTINELS = 3

_private = itertools.count()


class Shared:
    """A client and the watches of the runs its backends use (shared per loop)."""

    def __init__(self, endpoint: EtcdEndpoint, read_timeout: float) -> None:
        self.client = EtcdClient(endpoint, read_timeout)
        self._streams: dict[str, tuple[RunStream, int]] = {}

    def stream(self, keys: RunKeys) -> RunStream:
        entry = self._streams.get(keys.base)
        stream = RunStream(self.client, keys) if entry is None else entry[0]
        self._streams[keys.base] = (stream, 1 if entry is None else entry[1] + 1)
        stream.start()
        return stream

    async def release(self, keys: RunKeys) -> None:
        entry = self._streams.get(keys.base)
        if entry is None:
            return
        if entry[1] > 1:
            self._streams[keys.base] = (entry[0], entry[1] - 1)
            return
        del self._streams[keys.base]
        await entry[0].aclose()

    async def aclose(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream, _ in streams:
            await stream.aclose()
        await self.client.aclose()


class EtcdBackend:
    """Rendezvous state and store of one run on etcd.

    Args:
        run_id: The run.
        endpoint: The members, TLS files, prefix and login.
        read_timeout: Seconds a call keeps retrying before ``RendezvousConnectionError``.
        recheck_interval: Seconds between re-checks of a store wait (and of a status wait
            while the watch is down).
        share_connections: Share the loop's client and watch with the other backends of
            the endpoint.
        lease_ttl: A node's lease time to live (default: the heartbeat window in whole
            seconds, plus a second for etcd's own delay, ``._leases.SLACK``; tests that
            drive time themselves set a long one).
    """

    name = "etcd"

    def __init__(
        self,
        run_id: str,
        endpoint: EtcdEndpoint,
        *,
        read_timeout: float = 60.0,
        recheck_interval: float = 5.0,
        share_connections: bool = True,
        lease_ttl: int | None = None,
    ) -> None:
        for what, value in (("read_timeout", read_timeout), ("recheck_interval", recheck_interval)):
            if not value > 0:
                raise ValueError(f"The etcd backend option '{what}' ({value}) must be positive.")
        self._run_id = run_id
        self._endpoint = endpoint
        self._keys = RunKeys(endpoint.prefix, run_id)
        self._read_timeout = float(read_timeout)
        self._recheck = float(recheck_interval)
        key: Any = ("etcd", endpoint.identity, self._read_timeout)
        self._share_key = key if share_connections else (key, next(_private))
        self._lease_ttl = lease_ttl
        self._shared: Shared | None = None
        self._stream: RunStream | None = None
        self._port: RunPort | None = None
        self._leases: Leases | None = None
        self._store: KeyValue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        #: Where each node of this backend is after its last request (:mod:`._waits`).
        self._where: dict[NodeDesc, Known] = {}

    def __repr__(self) -> str:
        return f"EtcdBackend(run_id={self._run_id!r}, endpoint={self.endpoint!r})"

    @property
    def endpoint(self) -> str:
        """The members as one line (no credentials)."""
        return self._endpoint.display

    @property
    def keys(self) -> RunKeys:
        """The names of this run's keys."""
        return self._keys

    async def _bind(self) -> tuple[RunPort, RunStream]:
        if self._closed:
            raise RendezvousConnectionError(f"The etcd backend for {self.endpoint} is closed.")
        if self._port is None or self._stream is None:
            endpoint, timeout = self._endpoint, self._read_timeout
            shared = _shared.acquire(self._share_key, lambda: Shared(endpoint, timeout))
            self._loop, self._shared = asyncio.get_running_loop(), shared
            stream = self._stream = shared.stream(self._keys)
            self._leases = Leases(shared.client, self._lease_ttl)
            self._port = RunPort(
                shared.client, self._keys, self._leases, stream.deadlines, lambda: stream.cut
            )
            self._store = KeyValue(shared.client, self._keys)
        elif asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("An EtcdBackend is bound to the event loop it first ran on.")
        return self._port, self._stream

    # -- the rendezvous -------------------------------------------------------------------

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        """Carry out ``request`` (one read and at most one compared write; a heartbeat is
        a lease renewal) and answer at once.

        Raises:
            RendezvousConnectionError: etcd could not be reached within ``read_timeout``.
            RendezvousStateError: The run's keys hold values aelastic did not write.
        """
        port, stream = await self._bind()
        now = request.now_ms if request.now_ms is not None else now_ms()
        quick = await self._quick(request, stream, now)
        if quick is not None:
            return quick
        watch = stream.watch
        mark = watch.mark
        reply = await port.apply(request, now)
        watch.on_reply(reply.status, mark)
        live_from, revision = stream.live_from, port.revision_of.get(request.node, 0)
        if watch.live and live_from is not None and revision >= live_from:
            # Read at or after the revision from which the watch tells every change:
            # nothing newer can be missed (the watch went live during the request).
            watch.on_status(reply.status)
        self._after(request, reply, stream)
        return reply

    def _after(self, request: Request, reply: Reply, stream: RunStream) -> None:
        """Remember where the node is; a member of ranks 0..2 watches for lost members."""
        node = request.node
        if request.operator or reply.outcome is Outcome.ERROR_FORBIDDEN:
            return  # acts for no node of this backend
        where = None if self._port is None else self._port.where_of(node)
        self._where[node] = Known(where, reply.status.token, reply.status.round, request.secret)
        if request.op is Op.JOIN and reply.outcome is Outcome.FINISH:
            sentinel = reply.rank is not None and reply.rank < SENTINELS
            stream.sentinel(self, self._ask(node, request) if sentinel else None)
        elif request.op is Op.LEAVE or where != "p":
            stream.sentinel(self, None)

    def _ask(self, node: NodeDesc, request: Request) -> Any:
        async def ask() -> object:
            return await self.apply(Request(Op.STATUS, node, request.rules))

        return ask

    async def _quick(self, request: Request, stream: RunStream, now: int) -> Reply | None:
        """A heartbeat, or a join that would only wait again (:mod:`._waits`), answered with
        a lease renewal and what the watch knows (``None``: carry it out in full)."""
        op, node = request.op, request.node
        known = self._where.get(node)
        if known is None or not hmac.compare_digest(known.secret.encode(), request.secret.encode()):
            return None  # unknown here, or another client's request: carried out in full
        latest = stream.watch.latest
        if latest is None or not stream.watch.live or latest.token != known.token:
            if op is Op.KEEP_ALIVE and self._leases is not None:
                # The lease first: the full request after it reads (and may write) while
                # every node whose round just changed does too, which a busy etcd took
                # seconds over at 1,024 nodes; renewed only after that, leases ran out and
                # each loss changed the round again (docs/benchmarks.md, the etcd section).
                # So too while the watch is down (a round's first members open theirs
                # again when it completes, to hear of lost members).
                with contextlib.suppress(LeaseNotFound):
                    await self._leases.renew(node, at_once=True)
            if latest is None or not stream.watch.live or known.where is None:
                return None
            finished = await self._finish(request, stream, known.where, latest, now)
            if finished is not None or op is not Op.JOIN:
                return finished
        if known.where is None:
            return None
        wake_at = None
        if op is Op.JOIN:
            header = stream.header
            ends = header is None or header.deadline is None or (
                self._port is not None
                and self._port.last_calls.get(node) == (header.epoch, header.deadline[0])
            )  # fmt: skip
            waits, wake_at = join_waits(request, known, latest, header, now, ends)
            if not waits:
                return None
        elif op is not Op.KEEP_ALIVE:
            return None
        assert self._leases is not None
        # The renewal goes in the background: the beat (or the wait) is answered now, in
        # its own time, not in the time a busy etcd takes over the renewal (see ._leases).
        alive = self._leases.renew_soon(node, at_once=op is Op.KEEP_ALIVE)
        if not alive:
            return None if op is Op.JOIN else self._lost(node, latest, now)
        status = Status(**{**latest.__dict__, "now_ms": now})
        if op is Op.KEEP_ALIVE:
            return Reply(Outcome.FINISH, status, Transition.KEEP_ALIVE, known=True)
        self._where[node] = replace(known, token=latest.token)
        return Reply(Outcome.WAIT, status, Transition.KEEP_ALIVE, wake_at_ms=wake_at, known=True)

    async def _finish(
        self, request: Request, stream: RunStream, where: str | None, latest: Status, now: int
    ) -> Reply | None:
        """The join of a participant whose round the watch says completed: answered from
        the watched header and a read of its rank at the round's cut (``None``: carried out
        in full)."""
        header, cut = stream.header, stream.cut
        if (
            request.op is not Op.JOIN
            or request.expired
            or where != "p"
            or header is None
            or cut is None
            or not header.complete
            or header.closed
            or latest.closed
            or make(header.epoch, header.gen) != latest.token
        ):
            return None
        assert self._port is not None
        status = Status(**{**latest.__dict__, "now_ms": now})
        reply = await self._port.finish(request.node, header, cut, status)
        if reply is not None:
            self._after(request, reply, stream)
        return reply

    def _lost(self, node: NodeDesc, latest: Status, now: int) -> Reply:
        self._where.pop(node, None)
        status = Status(**{**latest.__dict__, "now_ms": now})
        return Reply(Outcome.FINISH, status, Transition.NONE, known=False)

    async def _status_now(self) -> Status:
        port, _ = await self._bind()
        status = await port.status(now_ms())
        assert status is not None
        return status

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        """The run's status once its token differs from ``token`` (``None`` on timeout).

        Woken by the run's watch; asks etcd only when it cannot tell.
        """
        _, stream = await self._bind()
        return await stream.watch.wait_status(token, timeout, self._status_now, self._recheck)

    async def snapshot(self) -> Snapshot | None:
        """The run's whole membership, or ``None`` when it has no state."""
        port, _ = await self._bind()
        return await port.snapshot(now_ms())

    async def health(self) -> JobHealth | None:
        """The job's health as the run keeps it, or ``None`` when it has no state (only
        the port's requests change it: :mod:`._control`)."""
        port, _ = await self._bind()
        return await port.health()

    async def close_run(self) -> bool:
        """Close the run as its operator (whoever holds the etcd credentials the nodes use
        is one); whether it was open.

        Raises:
            RendezvousConnectionError: etcd could not be reached within ``read_timeout``.
        """
        reply = await self.apply(Request.operator_close())
        return reply.transition is Transition.MARK_CLOSED

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        """The runs under this backend's prefix and their statuses, sorted by id, at most
        ``limit`` (one range per run: the first key after the last run found; when there are
        more, which ones is not defined)."""
        port, _ = await self._bind()
        client = port.client
        prefix = self._endpoint.prefix + "/"
        start, end = prefix.encode(), prefix_end(prefix)
        found: list[tuple[str, Status]] = []
        now = now_ms()
        while len(found) < limit:
            body = {"key": b64(start), "range_end": b64(end), "limit": 1, "keys_only": True}
            kvs = (await client.call("/v3/kv/range", body, "list")).get("kvs", [])
            if not kvs:
                break
            key = unb64(kvs[0].get("key")).decode(errors="replace")
            encoded = key[len(prefix) :].partition("/")[0]
            base = prefix + encoded + "/"
            run = RunKeys.run_of_header(base + "h", self._endpoint.prefix)
            if run is not None:
                status = await RunPort(
                    client, RunKeys(self._endpoint.prefix, run), port.leases, port.deadlines
                ).status(now, missing_ok=True)
                if status is not None:
                    found.append((run, status))
            start = prefix_end(base)
        return sorted(found, key=lambda item: item[0])

    async def reset(self) -> bool:
        """Delete every key of the run (state, store, records); whether there were any."""
        port, _ = await self._bind()
        base = self._keys.base
        body = {"key": b64(base), "range_end": b64(prefix_end(base))}
        answer = await port.client.call("/v3/kv/deleterange", body, "reset")
        self._where.clear()
        return int(answer.get("deleted", 0)) > 0

    # -- the members' key-value store -----------------------------------------------------

    async def _kv(self) -> KeyValue:
        await self._bind()
        assert self._store is not None
        return self._store

    async def kv_set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``."""
        await (await self._kv()).set(key, value)

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in order, ``None`` for each missing key."""
        return await (await self._kv()).get(keys)

    async def kv_add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0); the new value.

        Raises:
            ValueError: The stored value is not an integer, or the sum overflows.
        """
        return await (await self._kv()).add(key, int(amount))

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if missing)."""
        return await (await self._kv()).compare_set(key, expected, desired)

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return await (await self._kv()).delete(key)

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""
        if not keys:
            return True
        store = await self._kv()
        assert self._stream is not None
        wanted = list(keys)

        async def check() -> bool:
            return await store.count_present(wanted) == len(wanted)

        names = [k.encode() for k in keys]
        return await self._stream.watch.wait_keys(names, timeout, check, self._recheck)

    async def aclose(self) -> None:
        """Release this backend's share of the client and watch. Idempotent. Cancelling
        the caller lets the release finish first."""
        if not self._closed:
            await uncancellable(self._unbind())

    async def _unbind(self) -> None:
        self._closed = True
        if self._leases is not None:
            self._leases.close()
        shared, stream, self._shared, self._stream = self._shared, self._stream, None, None
        if stream is not None:
            stream.sentinel(self, None)
        if shared is not None:
            await shared.release(self._keys)
            await _shared.release(self._share_key, shared)
