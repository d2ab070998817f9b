"""One run as seen by every HTTP backend of one event loop: shared requests, ordered writes.

How it works: the handlers of one process that share a run (a benchmark, or a test, runs
hundreds) share a :class:`RunChannel`, so that their traffic stays O(changes), not O(nodes
x changes):

* a mirror of the last state and token any answer carried. A compare-and-set whose token is
  certainly older than the mirror's (same epoch, lower version) would fail on the server, so
  it fails at once with the mirror's state, without a request;
* writes of the channel go one at a time, in arrival order. A writer that waited for its turn
  re-checks its token; when it is stale it fails at once and keeps the turn for its immediate
  retry (the handler recomputes synchronously), so N nodes joining cost about N writes, not N^2;
* reads, and ``kv_get`` of the same keys, that are called in the same event-loop iteration
  share one request (sent after all of them were called, so each sees every write that
  finished before its call);
* long-polls are shared by what they wait for (a token, a set of keys) and are cancelled when
  their last waiter leaves;
* a waiter whose state changed while writes of this channel are queued or under way returns
  when they are done: it would only read and wait again, once per write of the burst;
* writers queued behind one that failed for ``read_timeout`` fail with it at once.
The server still decides every compare-and-set; the mirror only saves requests that would fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from ...rendezvous.api import RendezvousConnectionError
from ._transport import Connection
from .wire import SchemaError, b64decode, b64encode, require_token, token_is_older

__all__ = ["LONG_POLL", "RunChannel"]

T = TypeVar("T")

#: Longest a long-poll asks the server to hold it (seconds); waits loop on it.
LONG_POLL = 30.0
#: First and largest bound of the random pause after a write lost to another process (s).
_CONFLICT_BACKOFF = 0.001
_MAX_CONFLICT_BACKOFF = 0.25


def _segment(run_id: str) -> str:
    return quote(run_id, safe="").replace(".", "%2E")


class _Shared(Generic[T]):
    """A task whose result several callers await; cancelled when the last one leaves."""

    def __init__(self, work: Awaitable[T], forget: Callable[[], None]) -> None:
        self.users = 0
        self._forget = forget
        self.task: asyncio.Task[T] = asyncio.ensure_future(work)
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[T]) -> None:
        self._forget()
        if not task.cancelled():
            task.exception()  # retrieved here; every waiter re-raises it

    async def join(self, timeout: float | None) -> tuple[bool, T | None]:
        self.users += 1
        try:
            done, _ = await asyncio.wait({self.task}, timeout=timeout)
        finally:
            self.users -= 1
            if self.users == 0 and not self.task.done():
                self.task.cancel()
                self._forget()
        if not done:
            return False, None
        return True, self.task.result()


class RunChannel:
    """The shared view of run ``run_id`` on ``conn`` (see the module docstring)."""

    def __init__(self, conn: Connection, run_id: str) -> None:
        self.conn = conn
        self.run_id = run_id
        self.refs = 0
        self._path = f"/v1/runs/{_segment(run_id)}"
        self._state: bytes | None = None
        self._token = ""
        self._writing = False
        self._turns: deque[asyncio.Future[None]] = deque()
        self._quiet_waiters: asyncio.Future[None] | None = None
        self._write_failure: tuple[float, RendezvousConnectionError] | None = None
        self._conflicts = 0  # consecutive writes lost to other processes
        self._shared: dict[Hashable, _Shared[Any]] = {}
        self._batches: dict[Hashable, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def aclose(self) -> None:
        """Cancel the shared requests still running."""
        tasks = {s.task for s in self._shared.values()} | self._tasks
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- the mirror -----------------------------------------------------------------------

    def _learn(self, state: bytes | None, token: str) -> None:
        if not token_is_older(token, self._token) or token == "":
            self._state, self._token = state, token

    def _parse_state(self, doc: dict[str, Any]) -> tuple[bytes | None, str]:
        try:
            raw = doc.get("state")
            token = require_token(doc.get("token"))
            if raw is not None and not isinstance(raw, str):
                raise SchemaError("'state' must be base64 text or null")
            state = None if raw is None else b64decode(raw, "state")
        except SchemaError as exc:
            raise self.conn.protocol_error(f"a state that does not fit the API ({exc})") from None
        if (state is None) != (token == ""):
            raise self.conn.protocol_error("a state without a token (or a token without one)")
        self._learn(state, token)
        return state, token

    # -- state cell -----------------------------------------------------------------------

    async def read(self, read_timeout: float) -> tuple[bytes | None, str]:
        async def send() -> tuple[bytes | None, str]:
            doc = await self._call("GET", "/state", read_timeout)
            return self._parse_state(doc)

        result: tuple[bytes | None, str] = await self._batched("read", send)
        return result

    async def compare_and_set(
        self, state: bytes, token: str, read_timeout: float
    ) -> tuple[bool, bytes | None, str]:
        if token_is_older(token, self._token):
            return False, self._state, self._token
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        await self._take_turn()
        failure = self._write_failure
        if failure is not None and failure[0] > queued_at:
            # The server failed the writer ahead for read_timeout while this one waited:
            # fail alike at once rather than spend another read_timeout on it.
            self._writing = False
            self._pass_turn()
            raise RendezvousConnectionError(str(failure[1]))
        if token_is_older(token, self._token):
            # Stale after waiting: fail now and leave the turn free for the retry that
            # follows synchronously; if none comes, the next writer is woken.
            self._writing = False
            loop.call_soon(self._pass_turn)
            return False, self._state, self._token
        try:
            answer = await self.conn.call(
                "PUT",
                self._path + "/state",
                read_timeout,
                body={"state": b64encode(state), "token": token},
                accept=frozenset({200, 409}),
                idempotent=False,
            )
            self._write_failure = None
        except RendezvousConnectionError as exc:
            self._write_failure = (loop.time(), exc)
            raise
        finally:
            self._writing = False
            self._pass_turn()
        assert answer is not None
        status, doc = answer
        if status == 409:
            current, current_token = self._parse_state(doc)
            return await self._back_off(current, current_token, read_timeout)
        self._conflicts = 0
        try:
            new_token = require_token(doc.get("token"))
        except SchemaError as exc:
            raise self.conn.protocol_error(f"a write without a valid token ({exc})") from None
        self._learn(state, new_token)
        return True, state, new_token

    async def _back_off(
        self, state: bytes | None, token: str, read_timeout: float
    ) -> tuple[bool, bytes | None, str]:
        """After a write lost to another process: a jittered pause, then the fresh state.

        Many processes writing at once would otherwise all retry at once, and all but one
        lose again (N^2 writes for N nodes). The pause grows with consecutive losses.
        """
        self._conflicts += 1
        limit = min(_CONFLICT_BACKOFF * 2 ** min(self._conflicts, 16), _MAX_CONFLICT_BACKOFF)
        await asyncio.sleep(random.uniform(0, limit))
        if token_is_older(token, self._token):
            return False, self._state, self._token
        current, current_token = await self.read(read_timeout)
        return False, current, current_token

    async def _take_turn(self) -> None:
        while self._writing:
            turn = asyncio.get_running_loop().create_future()
            self._turns.append(turn)
            try:
                await turn
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._pass_turn()  # woken, but leaving: wake the next writer instead
                else:
                    with contextlib.suppress(ValueError):
                        self._turns.remove(turn)
                raise
        self._writing = True

    def _pass_turn(self) -> None:
        if self._writing:
            return
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        quiet, self._quiet_waiters = self._quiet_waiters, None
        if quiet is not None and not quiet.done():
            quiet.set_result(None)

    async def _quiet(self, deadline: float) -> None:
        """Wait until no write of this channel is queued or under way (or ``deadline``).

        Waiters woken in the middle of a burst of local writes (N nodes joining) would
        only read and wait again; they wake once, when the burst is over.
        """
        loop = asyncio.get_running_loop()
        while (self._writing or self._turns) and loop.time() < deadline:
            if self._quiet_waiters is None:
                self._quiet_waiters = loop.create_future()
            left = None if deadline == math.inf else deadline - loop.time()
            await asyncio.wait({self._quiet_waiters}, timeout=left)

    async def wait_for_change(self, token: str, timeout: float | None, read_timeout: float) -> None:
        if timeout is not None and timeout <= 0:
            return
        deadline = math.inf if timeout is None else asyncio.get_running_loop().time() + timeout
        if not token_is_older(token, self._token):
            await self._wait_for_token(token, timeout, read_timeout)
        await self._quiet(deadline)

    async def _wait_for_token(self, token: str, timeout: float | None, read_timeout: float) -> None:

        async def poll() -> None:
            while True:
                hold = LONG_POLL
                doc = await self._call(
                    "GET",
                    "/state",
                    read_timeout,
                    query={"token": token, "wait": f"{hold:g}"},
                    hold=hold,
                )
                if self._parse_state(doc)[1] != token:
                    return

        await self._share(("state", token), poll, timeout)

    # -- key-value store ------------------------------------------------------------------

    async def kv_get(self, keys: Sequence[str], read_timeout: float) -> list[bytes | None]:
        wanted = list(keys)
        if not wanted:
            return []

        async def send() -> list[bytes | None]:
            doc = await self._call("POST", "/kv/get", read_timeout, body={"keys": wanted})
            values = doc.get("values")
            if not isinstance(values, list) or len(values) != len(wanted):
                raise self.conn.protocol_error("a kv/get answer without one value per key")
            return [None if v is None else self.decode_value(v) for v in values]

        result: list[bytes | None] = await self._batched(("kv_get", *wanted), send)
        return result

    async def kv_wait(self, keys: Sequence[str], timeout: float, read_timeout: float) -> bool:
        wanted = list(keys)
        if not wanted:
            return True
        if timeout <= 0:
            return all(v is not None for v in await self.kv_get(wanted, read_timeout))

        async def poll() -> None:
            while True:
                doc = await self._call(
                    "POST",
                    "/kv/wait",
                    read_timeout,
                    body={"keys": wanted, "timeout": LONG_POLL},
                    hold=LONG_POLL,
                )
                if doc.get("ready") is True:
                    return

        return await self._share(("kv_wait", *wanted), poll, timeout)

    async def kv_call(
        self, op: str, body: dict[str, Any], read_timeout: float
    ) -> tuple[int, dict[str, Any]]:
        answer = await self.conn.call(
            "POST",
            f"{self._path}/kv/{op}",
            read_timeout,
            body=body,
            accept=frozenset({200, 409}),
            idempotent=False,
        )
        assert answer is not None
        return answer

    def decode_value(self, value: Any) -> bytes:
        """A base64 value of an answer, or the error for an answer that does not fit."""
        if not isinstance(value, str):
            raise self.conn.protocol_error("a value that is not base64 text")
        try:
            return b64decode(value, "value")
        except SchemaError as exc:
            raise self.conn.protocol_error(str(exc)) from None

    # -- sharing --------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        sub: str,
        read_timeout: float,
        *,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
        hold: float = 0.0,
    ) -> dict[str, Any]:
        answer = await self.conn.call(
            method, self._path + sub, read_timeout, body=body, query=query, hold=hold
        )
        assert answer is not None
        return answer[1]

    async def _batched(self, key: Hashable, send: Callable[[], Awaitable[T]]) -> T:
        """Run ``send`` once for every caller of this loop iteration with the same ``key``."""
        future = self._batches.get(key)
        if future is None:
            future = self._batches[key] = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(self._send_batch(key, future, send))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        result: T = await asyncio.shield(future)
        return result

    async def _send_batch(
        self, key: Hashable, future: asyncio.Future[T], send: Callable[[], Awaitable[T]]
    ) -> None:
        try:
            try:
                await asyncio.sleep(0)  # let the callers of this iteration join
            finally:
                del self._batches[key]  # later callers need a request sent after their call
            future.set_result(await send())
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here; every caller re-raises it
        except BaseException:
            future.cancel()
            raise

    async def _share(
        self, key: Hashable, poll: Callable[[], Awaitable[None]], timeout: float | None
    ) -> bool:
        shared = self._shared.get(key)
        if shared is None or shared.task.done():
            shared = self._shared[key] = _Shared(poll(), lambda: self._drop(key, shared))
        done, _ = await shared.join(timeout)
        return done

    def _drop(self, key: Hashable, shared: _Shared[Any] | None) -> None:
        if self._shared.get(key) is shared:
            del self._shared[key]
