"""The Redis backend: one run's rendezvous state and members' store on a Redis server.

How it works: a request is one Lua script (:mod:`._lua`, the state machine's port) that
applies it to the run's keys atomically, answers with a constant-size reply, and publishes
the run's status when a round transition changed it (or when a failover may have lost
versions of the state: it then takes a new epoch). Waiting for a change uses the
process's pub/sub listener (:mod:`._client`) through the run's
:class:`~aelastic.backends._watch.RunWatch`: a waiter sleeps until a message says the
status moved, and asks the server only when it cannot tell. The members' store is one
string per key, written by scripts that refresh the expiry and publish the key's name.
Requests that change membership (join, leave, close) and store writes are *durable*: with
``wait_replicas`` their replies come once that many replicas hold them (``WAIT``), so a
failover right after does not lose them; heartbeats are not (a lost one is sent again).
See :mod:`._calls` for connections, retries and errors, :mod:`._answers` for the scripts'
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from ...core.brief import beat_key, brief_reply
from ...core.errors import RendezvousConnectionError, RendezvousStateError
from ...core.health import JobHealth
from ...core.race import uncancellable, wait_within
from ...core.state import Op, Reply, Request, Snapshot, Status, Transition
from ...core.token import Token, new_epoch
from ...core.wire import (
    WireError,
    reply_from_json,
    snapshot_from_json,
    status_from_json,
    status_to_json,
)
from . import _scripts as lua
from ._answers import decode_answer
from ._argv import op_args
from ._calls import RedisCalls
from ._departures import NamedConnections
from ._endpoint import RedisEndpoint
from ._health import health_from_fields

__all__ = ["RedisBackend"]

#: How long the result of a ``kv_add`` is kept so that a retried add does not count twice.
_OP_TTL_MS = 10 * 60 * 1000

#: Requests whose replies replicas should hold before they are given (``wait_replicas``):
#: membership changes, and what the job's control state keeps (a failure, the exit barrier).
_DURABLE = frozenset({Op.JOIN, Op.LEAVE, Op.CLOSE, Op.REPORT, Op.DONE})


class RedisBackend(RedisCalls, NamedConnections):
    """Rendezvous state and store of one run on a Redis server.

    Backends of one event loop and endpoint share connections (unless
    ``share_connections`` is false), so creating one per node is cheap. Use it from one
    event loop; :meth:`aclose` releases it.

    Args:
        run_id: The run whose state this backend holds.
        endpoint: Where Redis is, with credentials (see :func:`parse_endpoint`).
        read_timeout: Seconds a call keeps retrying before ``RendezvousConnectionError``.
        key_ttl: Seconds the run's keys live after their last write.
        recheck_interval: Seconds between re-checks of a store wait (and of a status wait
            while notifications are down).
        max_connections: Size of the command pool of the shared client.
        key_prefix: Namespace of the keys.
        share_connections: Share the loop's client with the other backends of the endpoint.
        wait_replicas: Replicas that must hold a membership change or a store write before
            its reply is given (``WAIT``); 0 waits for none.
    """

    name = "redis"

    def __init__(
        self,
        run_id: str,
        endpoint: RedisEndpoint,
        *,
        read_timeout: float = 60.0,
        key_ttl: float = 24 * 3600.0,
        recheck_interval: float = 5.0,
        max_connections: int = 16,
        key_prefix: str = "aelastic",
        share_connections: bool = True,
        wait_replicas: int = 0,
    ) -> None:
        if not 0 <= wait_replicas <= 16:
            raise ValueError(
                f"The Redis backend option 'wait_replicas' ({wait_replicas}) must be between 0 "
                "and 16 (0: do not wait for replicas)."
            )
        for what, value in (
            ("read_timeout", read_timeout),
            ("key_ttl", key_ttl),
            ("recheck_interval", recheck_interval),
            ("max_connections", max_connections),
        ):
            if not value > 0:
                raise ValueError(f"The Redis backend option '{what}' ({value}) must be positive.")
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(
                f"The Redis backend option 'key_prefix' ({key_prefix!r}) must be non-empty "
                "and without braces (they delimit the run's hash tag)."
            )
        super().__init__(
            run_id,
            endpoint,
            lua.RunKeys(key_prefix, run_id),
            read_timeout=read_timeout,
            max_connections=max_connections,
            share_connections=share_connections,
            wait_replicas=wait_replicas,
        )
        self._ttl_ms = str(max(1, round(key_ttl * 1000)))
        self._recheck = float(recheck_interval)
        #: The status of this backend's last answer: a keep-alive sends its beat key, so
        #: that the script may answer briefly when nothing else moved (``core/brief.py``).
        self._last: Status | None = None

    def __repr__(self) -> str:
        return f"RedisBackend(run_id={self._run_id!r}, endpoint={self.endpoint!r})"

    @property
    def keys(self) -> lua.RunKeys:
        """The names of this run's keys and channel in Redis."""
        return self._keys

    # -- the rendezvous -------------------------------------------------------------------

    def _decode(self, raw: Any, what: str) -> dict[str, Any]:
        return decode_answer(raw, what, self.endpoint, self._run_id)

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        """Carry out ``request`` atomically (one script) and answer at once (no ``hold``).

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
            RendezvousStateError: The run's keys hold something this aelastic did not write.
        """
        client, watch = await self._bind()
        # The reply is news only if the request follows the subscription: once the listener
        # is up (the request then goes on its connection, after the subscription).
        await client.server.settled(self._budget_left())
        mark = watch.mark
        base = self._last if request.op is Op.KEEP_ALIVE else None
        key = beat_key(base)
        args = op_args(
            request,
            now_ms=None,
            epoch=new_epoch(),
            ttl_ms=self._ttl_ms,
            channel=self._keys.channel,
            follow_primary=True,  # a new epoch after a failover
            beat_key=key,
        )
        raw = await self._script(
            request.op.value,
            lua.OP,
            self._keys.rendezvous,
            args,
            durable=request.op in _DURABLE,
        )
        try:
            if key and base is not None and raw[:1] in (b"[", "["):
                reply = brief_reply(json.loads(raw), base)
            else:
                reply = reply_from_json(self._decode(raw, request.op.value))
        except ValueError as exc:  # WireError included
            raise RendezvousStateError(f"Redis at {self.endpoint} answered {exc}") from None
        self._last = reply.status
        watch.on_reply(reply.status, mark)
        self._after_reply(request, reply)
        return reply

    async def _status_now(self) -> Status:
        raw = await self._script("status", lua.STATUS, self._keys.rendezvous, [""])
        doc = self._decode(raw, "status")
        if doc.get("absent"):
            return Status()
        try:
            return status_from_json(doc)
        except WireError as exc:
            raise RendezvousStateError(f"Redis at {self.endpoint} answered {exc}") from None

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        """The run's status once its token differs from ``token`` (``None`` on timeout).

        Woken by the change's pub/sub message; asks the server only when it cannot tell.

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
        """
        _, watch = await self._bind()
        status = await watch.wait_status(token, timeout, self._status_now, self._recheck)
        if status is not None:
            self._last = status
        return status

    async def snapshot(self) -> Snapshot | None:
        """The run's whole membership, or ``None`` when it has no state."""
        raw = await self._script("snapshot", lua.SNAPSHOT, self._keys.rendezvous, [""])
        doc = self._decode(raw, "snapshot")
        if doc.get("absent"):
            return None
        try:
            return snapshot_from_json(doc)
        except WireError as exc:
            raise RendezvousStateError(f"Redis at {self.endpoint} answered {exc}") from None

    async def health(self) -> JobHealth | None:
        """The job's health as the run keeps it (written by the rendezvous script only, in a
        key of its own: never in the members' store), or ``None`` when the run has no state.

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
            RendezvousStateError: The run's keys hold something this aelastic did not write.
        """
        raw = await self._script("health", lua.HEALTH, self._keys.rendezvous, [])
        if isinstance(raw, bytes | str):
            if self._decode(raw, "health").get("absent"):
                return None
            raw = []  # not reached: an error raised, or the script answered the fields
        try:
            return health_from_fields(list(raw))
        except ValueError as exc:
            raise RendezvousStateError(
                f"The job's health of run '{self._run_id}' at {self.endpoint}: {exc}"
            ) from None

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        """The runs under this backend's ``key_prefix`` (found by ``SCAN``, on every primary
        of a cluster) and their statuses, sorted by id, at most ``limit`` (when there are
        more, which ones is not defined). A run whose id has braces is named by its tag,
        ``sha1-<hex>``, which reads the same run."""
        client, _ = await self._bind()
        prefix = self._keys.prefix
        pattern = lua.RunKeys.state_pattern(prefix)

        async def scan(within: float) -> list[str]:
            keys = await wait_within(client.scan(pattern, limit), within)
            tags = {lua.RunKeys.tag_of_state(k.decode(errors="replace"), prefix) for k in keys}
            return sorted(t for t in tags if t is not None)[:limit]

        tags = await self._call("list", scan)
        statuses = await asyncio.gather(*(self._status_of(lua.RunKeys(prefix, t)) for t in tags))
        return [(t, s) for t, s in zip(tags, statuses, strict=True) if s is not None]

    async def _status_of(self, keys: lua.RunKeys) -> Status | None:
        """The status of the run with ``keys``; ``None`` if it is gone or foreign."""
        raw = await self._script("status", lua.STATUS, keys.rendezvous, [""])
        try:
            doc = self._decode(raw, "status")
            return None if doc.get("absent") else status_from_json(doc)
        except (RendezvousStateError, WireError):
            return None

    async def close_run(self) -> bool:
        """Close the run as its operator (whoever holds this Redis' credentials is one);
        whether it was open."""
        reply = await self.apply(Request.operator_close())
        return reply.transition is Transition.MARK_CLOSED

    async def reset(self) -> bool:
        """Delete every key of the run (state, store, records); whether there were any."""
        client, _ = await self._bind()
        pattern = lua.glob_escape(self._keys.base) + ":*"
        state = self._keys.state  # a cluster scans the node holding the run's slot

        async def scan(within: float) -> int:
            count, cursor = 0, b"0"
            while True:
                cursor, found = await client.command(
                    "SCAN", cursor, "MATCH", pattern, "COUNT", 1000, within=within, route=state
                )
                if found:
                    count += await client.command("UNLINK", *found, within=within)
                if cursor in (b"0", 0, "0"):
                    break
            # Waiting nodes learn that the run is gone (an empty status: a new epoch next).
            empty = json.dumps(status_to_json(Status()), separators=(",", ":")).encode()
            with contextlib.suppress(ResponseError):  # a user without the channel: no news
                await client.command(
                    "PUBLISH", self._keys.channel, b"s" + empty, within=within, route=state
                )
            return count

        deleted = await self._call("reset", scan)
        return deleted > 0

    # -- the members' key-value store -----------------------------------------------------

    async def kv_set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value`` (and refresh its expiry)."""
        full = self._keys.kv(key)
        args = [value, self._ttl_ms, self._keys.channel, b"k" + key.encode()]
        self._check(await self._script("kv_set", lua.KV_SET, [full], args, durable=True), full)

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in order, ``None`` for each missing key."""
        if not keys:
            return []
        full = [self._keys.kv(k) for k in keys]
        values: list[bytes | None] = await self._script("kv_get", lua.KV_GET, full, [self._ttl_ms])
        return list(values)

    async def kv_add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0) and return the new value.

        Raises:
            ValueError: The stored value is not an integer, or the sum leaves the signed
                64-bit range.
        """
        full, op = self._keys.kv(key), self._keys.op(secrets.token_hex(12))
        args = [
            int(amount),
            self._ttl_ms,
            self._keys.channel,
            b"k" + key.encode(),
            min(_OP_TTL_MS, int(self._ttl_ms)),
        ]
        try:
            reply = await self._script("kv_add", lua.KV_ADD, [full, op], args, durable=True)
        except RendezvousConnectionError as exc:
            if "overflow" in str(exc) or "not an integer" in str(exc):
                raise ValueError(f"Adding {amount} to key {key!r} overflows.") from None
            raise
        if reply[0] == lua.NOT_INTEGER:
            raise ValueError(f"The value of key {key!r} is not an integer.")
        return int(self._check(reply, full)[1])

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if it is missing).

        Returns:
            The value stored afterwards, or ``expected`` when the key is missing.
        """
        full = self._keys.kv(key)
        args = [
            "0" if expected is None else "1",
            b"" if expected is None else expected,
            desired,
            self._ttl_ms,
            self._keys.channel,
            b"k" + key.encode(),
        ]
        reply = self._check(
            await self._script("kv_compare_set", lua.KV_COMPARE_SET, [full], args, durable=True),
            full,
        )
        return bytes(reply[1])

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        full = self._keys.kv(key)
        args = [self._keys.channel, b"k" + key.encode()]
        reply = self._check(
            await self._script("kv_delete", lua.KV_DELETE, [full], args, durable=True), full
        )
        return bool(reply[1])

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""
        if not keys:
            return True
        client, watch = await self._bind()
        full = [self._keys.kv(k) for k in keys]
        names = [k.encode() for k in keys]

        async def all_exist(within: float) -> bool:
            found = await client.command("EXISTS", *full, within=within, shareable=True)
            return bool(found == len(full))

        async def check() -> bool:
            return await self._call("kv_wait", all_exist)

        return await watch.wait_keys(names, timeout, check, self._recheck)

    async def aclose(self) -> None:
        """Release this backend's share of the connections. Idempotent. Cancelling the
        caller lets the release finish first."""
        if not self._closed:
            await uncancellable(self._stop_presence())
            await uncancellable(self._unbind())
