"""The Redis backend: one run's state cell and members' store on a Redis server.

How it works: every write is one Lua script (see :mod:`._scripts`) that checks what it
finds, writes, refreshes the expiry and publishes the change, atomically. Reads of the
state by many nodes of one process share one in-flight request; compare-and-set calls of
one process take turns (:class:`._watch.Turn`), and one that carries a token older than
an answer this process already has fails at once with that answer. Waiting registers with
the process's pub/sub listener (:mod:`._shared`, :mod:`._watch`) and returns when a message says the
token moved; the server is asked only when the process cannot tell (first wait after a
subscription, a token of another epoch) and on the safety-net period ``recheck_interval``.

Every server call is retried with backoff on connection trouble until ``read_timeout``
runs out, then fails with ``RendezvousConnectionError`` naming the endpoint (never the
password). A refused login fails at once. A value that aelastic did not write raises
``RendezvousStateError`` and is left as it is.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    InvalidResponse,
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...rendezvous.api import RendezvousConnectionError, RendezvousStateError
from ..base import NO_STATE, Token
from . import _scripts as lua
from ._endpoint import RedisEndpoint
from ._shared import SharedClient, acquire_client, release_client
from ._watch import Order, RunWatch, compare_tokens

__all__ = ["RedisBackend"]

T = TypeVar("T")

_SHA = {src: sha for sha, src in lua.SCRIPTS.items()}
_READ_ONLY = frozenset({lua.READ, lua.KV_GET})

#: Errors after which a call is retried (the server may be back a moment later).
_TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    TryAgainError,
    asyncio.TimeoutError,
    OSError,
)

#: Longest idle time of the pub/sub connection before the listener checks it with a PING.
_HEALTH_INTERVAL = 5.0

#: How long the result of a ``kv_add`` is kept so that a retried add does not count twice.
_OP_TTL_MS = 10 * 60 * 1000


class RedisBackend:
    """State and store of one run on a Redis server.

    Backends of one event loop and endpoint share connections, so creating one per node
    is cheap. Use it from one event loop; :meth:`aclose` releases it.

    Args:
        run_id: The run whose state this backend holds.
        endpoint: Where Redis is, with credentials (see :func:`parse_endpoint`).
        read_timeout: Seconds a call keeps retrying before ``RendezvousConnectionError``.
        key_ttl: Seconds the run's keys live after their last write.
        recheck_interval: Seconds between safety-net re-reads while waiting.
        max_connections: Size of the command pool shared per endpoint and loop.
        key_prefix: Namespace of the keys.
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
    ) -> None:
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
        self._run_id = run_id
        self._endpoint = endpoint
        self._keys = lua.RunKeys(key_prefix, run_id)
        self._read_timeout = float(read_timeout)
        self._ttl_ms = str(max(1, round(key_ttl * 1000)))
        self._recheck = float(recheck_interval)
        self._max_connections = int(max_connections)
        self._client: SharedClient | None = None
        self._watch: RunWatch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bind_lock: asyncio.Lock | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisBackend(run_id={self._run_id!r}, endpoint={self.endpoint!r})"

    @property
    def endpoint(self) -> str:
        """The endpoint as a URL without the password."""
        return self._endpoint.display

    @property
    def keys(self) -> lua.RunKeys:
        """The names of this run's keys and channel in Redis."""
        return self._keys

    # -- plumbing -------------------------------------------------------------------------

    async def _bind(self) -> tuple[SharedClient, RunWatch]:
        """The shared client and run watch of this backend (acquired on first use)."""
        if self._closed:
            raise RendezvousConnectionError(f"The Redis backend for {self.endpoint} is closed.")
        loop = asyncio.get_running_loop()
        if self._client is not None and self._watch is not None:
            if loop is not self._loop:
                raise RuntimeError("A RedisBackend is bound to the event loop it first ran on.")
            return self._client, self._watch
        if self._bind_lock is None:
            self._bind_lock = asyncio.Lock()
        async with self._bind_lock:
            if self._client is None:
                health = min(self._recheck, _HEALTH_INTERVAL)
                client = acquire_client(self._endpoint, self._max_connections, health)
                self._loop, self._client = loop, client
                self._watch = await client.watch(self._keys.channel)
        assert self._client is not None and self._watch is not None
        return self._client, self._watch

    async def _call(self, what: str, attempt: Callable[[float], Awaitable[T]]) -> T:
        """Run ``attempt(timeout)`` with retries on transient failures, within ``read_timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._read_timeout
        delay = 0.05
        while True:
            try:
                return await attempt(max(deadline - loop.time(), 0.001))
            except AuthenticationError as exc:
                raise RendezvousConnectionError(
                    f"Authentication to Redis at {self.endpoint} failed ({what}): {exc} "
                    "Check the username/password (config keys or AELASTIC_REDIS_* variables)."
                ) from None
            except NoPermissionError as exc:
                raise RendezvousConnectionError(
                    f"Redis at {self.endpoint} refused {what}: {exc}"
                ) from None
            except InvalidResponse as exc:  # another protocol: retrying cannot help
                said = str(exc).removeprefix("Protocol Error: ")
                said = said if len(said) <= 60 else said[:57] + "..."
                raise RendezvousConnectionError(
                    f"The server at {self.endpoint} does not speak the Redis protocol (it "
                    f"answered {what} with {said}): is it a Redis server? Check the host and port."
                ) from None
            except _TRANSIENT as exc:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise RendezvousConnectionError(
                        f"Redis at {self.endpoint} could not be reached within "
                        f"{self._read_timeout:g} s ({what}): {exc or type(exc).__name__}"
                    ) from None
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    async def _script(
        self,
        what: str,
        src: str,
        keys: Sequence[str],
        args: Sequence[Any],
        client: SharedClient | None = None,
    ) -> Any:
        shared = client or (await self._bind())[0]
        command = ("EVALSHA", _SHA[src], len(keys), *keys, *args)
        shareable = src in _READ_ONLY

        async def run(timeout: float) -> Any:
            try:
                return await shared.command(*command, timeout=timeout, shareable=shareable)
            except NoScriptError:  # a new or restarted server: load them all, then run
                await asyncio.wait_for(shared.load_scripts(lua.SCRIPTS.values()), timeout)
                return await shared.command(*command, timeout=timeout, shareable=shareable)

        try:
            return await self._call(what, run)
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise RendezvousStateError(
                    f"A key of run '{self._run_id}' at {self.endpoint} holds a value of the "
                    f"wrong Redis type ({what}); it was left as it is."
                ) from None
            raise RendezvousConnectionError(
                f"Redis at {self.endpoint} failed {what}: {exc}"
            ) from None

    def _check(self, reply: list[Any], key: str) -> list[Any]:
        status = reply[0]
        if status == lua.WRONG_TYPE:
            kind = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise RendezvousStateError(
                f"The key '{key}' of run '{self._run_id}' at {self.endpoint} is a Redis "
                f"{kind}, not a value aelastic wrote; it was left as it is."
            )
        if status == lua.BAD_SHAPE:
            raise RendezvousStateError(
                f"The rendezvous state '{key}' of run '{self._run_id}' at {self.endpoint} has "
                "no valid epoch, version and data fields (foreign or corrupt); it was left "
                "as it is."
            )
        return reply

    # -- the state cell -------------------------------------------------------------------

    async def _read_now(
        self, with_data: bool, client: SharedClient | None = None
    ) -> tuple[bytes | None, Token]:
        key = self._keys.state
        flag = "1" if with_data else "0"
        reply = self._check(await self._script("read", lua.READ, [key], [flag], client), key)
        if reply[0] == 0:
            return None, NO_STATE
        return (reply[2] if with_data else None), reply[1].decode()

    async def read(self) -> tuple[bytes | None, Token]:
        """The stored state and its token (``(None, NO_STATE)`` when there is none).

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
            RendezvousStateError: The state key holds something aelastic did not write.
        """
        client, watch = await self._bind()
        inflight = watch.inflight_read
        if inflight is None or inflight[0] != watch.seq or inflight[1].done():
            task = asyncio.get_running_loop().create_task(self._read_now(True, client))
            task.add_done_callback(_retrieve)
            inflight = watch.inflight_read = (watch.seq, task)
        return await asyncio.shield(inflight[1])

    async def compare_and_set(self, state: bytes, token: Token) -> tuple[bool, bytes | None, Token]:
        """Store ``state`` if the stored token is ``token``.

        Returns:
            ``(written, current_state, current_token)``: on success the state just written
            and its new token; otherwise what is stored now.

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
            RendezvousStateError: The state key holds something aelastic did not write.
        """
        _, watch = await self._bind()
        turn = watch.turn
        await turn.acquire()
        keep = False
        try:
            cached = watch.cached
            if cached is not None and compare_tokens(token, cached[1]) is Order.CHANGED:
                keep = True
                return False, cached[0], cached[1]
            key = self._keys.state
            args = [token, state, secrets.token_hex(8), self._ttl_ms, self._keys.channel]
            reply = self._check(await self._script("compare-and-set", lua.CAS, [key], args), key)
            watch.seq += 1
            if reply[0] == 1:
                new_token = reply[1].decode()
                watch.cached = (state, new_token)
                return True, state, new_token
            current = (reply[2], reply[1].decode() or NO_STATE)
            watch.cached = current
            keep = True
            return False, current[0], current[1]
        finally:
            if keep:
                turn.keep()
            else:
                turn.release()

    async def wait_for_change(self, token: Token, timeout: float | None) -> None:
        """Return once the stored token differs from ``token``, or after ``timeout`` seconds.

        Woken by the change's pub/sub message; asks the server only when it cannot tell
        and every ``recheck_interval`` seconds. May return early (callers re-read).

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
            RendezvousStateError: The state key holds something aelastic did not write.
        """
        client, watch = await self._bind()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(timeout, 0.0)
        ask_server = False
        while True:
            remaining = self._recheck if deadline is None else deadline - loop.time()
            if remaining <= 0:
                return
            period = min(remaining, self._recheck)
            if not watch.subscribed:  # connecting, or reconnecting after a loss
                if await self._wait_unsubscribed(client, watch, token, period):
                    return
                continue
            waiter = watch.waiter(token)
            try:
                order = compare_tokens(token, watch.latest)
                if order is Order.CHANGED and not watch.holding:
                    return
                if order is Order.UNKNOWN or ask_server:
                    _, current = await self._read_now(False)
                    if current != token:
                        return
                if await watch.sleep(waiter, period):
                    return
                ask_server = True  # the safety net: nothing heard for a whole period
            finally:
                watch.discard(waiter)

    async def _wait_unsubscribed(
        self, client: SharedClient, watch: RunWatch, token: Token, period: float
    ) -> bool:
        """Wait while notifications are off; whether the token is known to have moved.

        Gives the listener a moment to subscribe (it wakes the waiter when it does, or when
        it fails); if it cannot, asks the server, which fails within ``read_timeout`` when
        Redis is unreachable, and otherwise waits for the listener up to ``period``.
        """
        waiter = watch.waiter(token)
        try:
            if not client.listener_failing:
                await watch.sleep(waiter, period)
            if watch.subscribed:
                return False
            _, current = await self._read_now(False)
            if current != token:
                return True
            await watch.sleep(waiter, period)
            return False
        finally:
            watch.discard(waiter)

    # -- the members' key-value store -----------------------------------------------------

    async def kv_set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value`` (and refresh its expiry)."""
        full = self._keys.kv(key)
        args = [value, self._ttl_ms, self._keys.channel, b"k" + key.encode()]
        self._check(await self._script("kv_set", lua.KV_SET, [full], args), full)

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
            ValueError: The stored value is not an integer.
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
            reply = await self._script("kv_add", lua.KV_ADD, [full, op], args)
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
            await self._script("kv_compare_set", lua.KV_COMPARE_SET, [full], args), full
        )
        return bytes(reply[1])

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        full = self._keys.kv(key)
        args = [self._keys.channel, b"k" + key.encode()]
        reply = self._check(await self._script("kv_delete", lua.KV_DELETE, [full], args), full)
        return bool(reply[1])

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""
        if not keys:
            return True
        client, watch = await self._bind()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        full = [self._keys.kv(k) for k in keys]
        names = [k.encode() for k in keys]

        async def all_exist(timeout: float) -> bool:
            found = await client.command("EXISTS", *full, timeout=timeout, shareable=True)
            return bool(found == len(full))

        while True:
            period = min(deadline - loop.time(), self._recheck)
            if not watch.subscribed and not client.listener_failing and period > 0:
                waiter = watch.waiter(keys=names)  # woken when the listener subscribes
                try:
                    await watch.sleep(waiter, period)
                finally:
                    watch.discard(waiter)
            waiter = watch.waiter(keys=names)
            try:
                if await self._call("kv_wait", all_exist):
                    return True
                period = min(deadline - loop.time(), self._recheck)
                if period <= 0:
                    return False
                await watch.sleep(waiter, period)
            finally:
                watch.discard(waiter)

    async def aclose(self) -> None:
        """Release this backend's share of the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        client, watch, self._client, self._watch = self._client, self._watch, None, None
        if client is None or watch is None:
            return
        await client.unwatch(watch)
        await release_client(client)

    # -- starting over (operators) --------------------------------------------------------

    async def reset(self) -> bool:
        """Delete every key of this run (state, store, pending adds) so the id can be reused.

        Finds the keys with ``SCAN`` (``MATCH <prefix>:{<run id>}:*``), removes them with
        ``UNLINK`` and publishes the change, so waiting nodes re-read. Only for a run whose
        nodes are gone: live nodes would see their rendezvous vanish.

        Returns:
            Whether the run had any key.

        Raises:
            RendezvousConnectionError: Redis could not be reached within ``read_timeout``.
        """
        client, watch = await self._bind()
        pattern = _glob_escape(self._keys.base) + ":*"

        async def delete_all(timeout: float) -> int:
            deleted, cursor = 0, 0
            while True:
                reply = await client.command(
                    "SCAN", cursor, "MATCH", pattern, "COUNT", 1000, timeout=timeout
                )
                cursor, names = int(reply[0]), list(reply[1])
                if names:
                    deleted += int(await client.command("UNLINK", *names, timeout=timeout))
                if cursor == 0:
                    break
            await client.command("PUBLISH", self._keys.channel, b"s", timeout=timeout)
            return deleted

        deleted = await self._call("reset", delete_all)
        watch.cached = None
        watch.seq += 1
        return deleted > 0


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a shared read's failure as seen (its callers may all have gone)."""
    if not task.cancelled():
        task.exception()
