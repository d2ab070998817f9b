"""Runs kept in this process: the memory backend's data and the HTTP server's.

How it works: an :class:`Engine` holds runs by id; each has its rendezvous state (a
:class:`~aelastic.core.state.RunState`, changed only by the pure machine's ``step``), its
key-value pairs and its waiters. A lock makes every operation atomic across threads and
event loops (the memory backend is shared by the loops of one process; the HTTP server has
one loop and pays an uncontended lock). Waiters register a future with the loop they run
on: status waiters are woken when the run's token changes (round transitions, never
heartbeats), key waiters when a key is written. A woken waiter is dropped; it re-checks and
waits anew. Nothing polls. Each run counts the bytes its store holds (keys, values and
:data:`KV_ENTRY_OVERHEAD` a key; the engine the sum over its runs), for the HTTP server's
quotas; ``touched`` is the last time the run changed or its store was read.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..core.brief import short_beat
from ..core.health import JobHealth
from ..core.machine import LONG_AGO_MS, health_of, snapshot_of, status_of, step
from ..core.protocol import INT64_MAX, INT64_MIN
from ..core.state import NodeDesc, Reply, Request, RunState, Snapshot, Status, Transition
from ..core.token import NO_STATE, make, new_epoch

__all__ = ["KV_ENTRY_OVERHEAD", "Engine", "Run", "add_int64", "kv_entry_size", "now_ms"]

#: Changes not worth keeping across a server restart (a restart grants a fresh window).
_QUIET = frozenset({Transition.NONE, Transition.KEEP_ALIVE})
#: Bytes a store entry counts beside its key and value (its bookkeeping, roughly).
KV_ENTRY_OVERHEAD = 64


def kv_entry_size(key: str, size: int) -> int:
    """Bytes a store entry of key ``key`` and a value of ``size`` bytes counts."""
    return len(key) + size + KV_ENTRY_OVERHEAD


def now_ms() -> int:
    """This machine's wall clock in whole milliseconds."""
    return round(time.time() * 1000)


def add_int64(current: bytes | None, amount: int, key: str) -> int:
    """``current + amount`` as a store counter (signed 64-bit, as torch's stores).

    Raises:
        ValueError: ``current`` is not an integer, or the sum leaves the signed 64-bit range.
    """
    try:
        value = 0 if current is None else int(current)
    except ValueError:
        raise ValueError(f"The value of key {key!r} is not an integer.") from None
    total = value + amount
    if not INT64_MIN <= value <= INT64_MAX or not INT64_MIN <= total <= INT64_MAX:
        raise ValueError(f"Adding {amount} to key {key!r} overflows a signed 64-bit integer.")
    return total


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    ready: Callable[[], bool]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(eq=False)
class Run:
    """One run: rendezvous state, store, waiters."""

    state: RunState | None = None
    kv: dict[str, bytes] = field(default_factory=dict)
    status_waiters: set[_Waiter] = field(default_factory=set)
    key_waiters: set[_Waiter] = field(default_factory=set)
    touched: float = field(default_factory=time.monotonic)
    #: Bytes its store holds (:func:`kv_entry_size` of each entry).
    kv_bytes: int = 0

    @property
    def token(self) -> str:
        state = self.state
        return NO_STATE if state is None else make(state.epoch, state.generation)

    @property
    def idle(self) -> bool:
        """Whether nobody waits on this run."""
        return not self.status_waiters and not self.key_waiters

    def empty(self) -> bool:
        """Whether the run holds nothing."""
        return self.state is None and not self.kv


def _wake(waiters: set[_Waiter]) -> None:
    woken = [w for w in waiters if w.ready()]
    if not woken:
        return
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    for waiter in woken:
        waiters.discard(waiter)
        # Resolved by the loop a step later, as a waker in another thread would see it
        # (callers rely on that order); on the waiter's own loop without the self-pipe
        # write ``call_soon_threadsafe`` costs.
        if waiter.loop is here:
            here.call_soon(_resolve, waiter.future)
        else:  # another thread's loop (the sync facade)
            waiter.loop.call_soon_threadsafe(_resolve, waiter.future)


class Engine:
    """Every run of one in-process backend (see the module docstring).

    Args:
        on_change: Called (under the lock) with a run id after its state or store changed
            in a way worth keeping (the HTTP server persists then); heartbeats do not count.
    """

    def __init__(self, on_change: Callable[[str], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, Run] = {}
        self._on_change = on_change
        #: Bytes every run's store holds together.
        self.kv_bytes = 0

    def run(self, run_id: str) -> Run:
        """The run ``run_id``, made empty if needed (call with the lock held)."""
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = Run()
        return run

    def _changed(self, run_id: str, run: Run) -> None:
        run.touched = time.monotonic()
        if self._on_change is not None:
            self._on_change(run_id)

    # -- rendezvous -----------------------------------------------------------------------

    def apply(self, run_id: str, request: Request, now: int) -> Reply:
        """Apply ``request`` to the run at time ``now`` (ms) and wake who it concerns."""
        with self.lock:
            run = self.run(run_id)
            before = run.token
            state = run.state
            if state is None:
                state = RunState(new_epoch())
                reply = step(state, request, now)
                if state.made:  # a join made the run: a new token, who waits for it wakes
                    run.state = state
            else:
                reply = step(state, request, now)
            if run.token != before:
                _wake(run.status_waiters)
            if reply.transition not in _QUIET:
                self._changed(run_id, run)
            return reply

    def short_beat(
        self, run_id: str, node: NodeDesc, secret: str, key: str, now: int
    ) -> tuple[int, int] | None:
        """A plain keep-alive's brief answer ``(now, oldest)`` (:func:`~aelastic.core.brief.
        short_beat`: nothing but the node's time moves, nobody is woken), or ``None``, the
        run untouched, when :meth:`apply` must answer it."""
        with self.lock:
            run = self.runs.get(run_id)
            if run is None or run.state is None:
                return None
            return short_beat(run.state, node, secret, key, now)

    def knows(self, run_id: str, node: NodeDesc) -> bool:
        """Whether ``node`` is in the run's state."""
        with self.lock:
            run = self.runs.get(run_id)
            return run is not None and run.state is not None and run.state.knows(node)

    def status(self, run_id: str, now: int) -> Status:
        """The run's status (an empty one when it has no state)."""
        with self.lock:
            run = self.runs.get(run_id)
            if run is None or run.state is None:
                return Status(now_ms=now)
            return status_of(run.state, now)

    def snapshot(self, run_id: str, now: int) -> Snapshot | None:
        """The run's whole membership, or ``None`` when it has no state."""
        with self.lock:
            run = self.runs.get(run_id)
            if run is None or run.state is None:
                return None
            return snapshot_of(run.state, now)

    def list_runs(self, now: int, limit: int, prefix: str = "") -> list[tuple[str, Status]]:
        """The runs with a rendezvous state whose id starts with ``prefix``, sorted by id (at
        most ``limit``), and their statuses at ``now`` (ms)."""
        with self.lock:
            found = sorted(
                r for r, run in self.runs.items() if run.state is not None and r.startswith(prefix)
            )
            return [(r, status_of(s, now)) for r in found[:limit] if (s := self.runs[r].state)]

    async def wait_status(self, run_id: str, token: str, timeout: float | None) -> bool:
        """Wait until the run's token differs from ``token``; whether it did."""
        run = self.runs.get(run_id)
        if run is None:
            with self.lock:
                run = self.run(run_id)
        return await self._wait(run.status_waiters, lambda: run.token != token, timeout)

    def on_status_change(
        self, run_id: str, token: str, callback: Callable[[], None]
    ) -> Callable[[], None]:
        """Call ``callback`` once (on the running loop) when the run's token differs from
        ``token`` (at once if it does already), or the run is deleted or everyone woken;
        returns a function that cancels it. Not a coroutine: one registration serves any
        number of requests held on the run (the HTTP server's held heartbeats)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self.lock:
            run = self.run(run_id)
            waiter = _Waiter(loop, future, lambda: run.token != token)
            if waiter.ready():
                loop.call_soon(_resolve, future)
            else:
                run.status_waiters.add(waiter)
        future.add_done_callback(lambda f: None if f.cancelled() else callback())

        def cancel() -> None:
            with self.lock:
                run.status_waiters.discard(waiter)
            future.cancel()

        return cancel

    # -- store ----------------------------------------------------------------------------

    def kv_set(self, run_id: str, key: str, value: bytes) -> None:
        with self.lock:
            run = self.run(run_id)
            self._put(run, key, bytes(value))
            self._kv_changed(run_id, run)

    def kv_get(self, run_id: str, keys: Sequence[str]) -> list[bytes | None]:
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                return [None] * len(keys)
            run.touched = time.monotonic()
            kv = run.kv
            return [kv.get(k) for k in keys]

    def kv_usage(self, run_id: str, key: str) -> tuple[int, int, int]:
        """Bytes the entry ``key`` of the run's store counts (0: none), bytes the run's store
        holds, and bytes every run's store holds."""
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                return 0, 0, self.kv_bytes
            value = run.kv.get(key)
            entry = 0 if value is None else kv_entry_size(key, len(value))
            return entry, run.kv_bytes, self.kv_bytes

    def recount_kv(self) -> None:
        """Count the bytes of every run's store again (after a store was filled directly)."""
        with self.lock:
            for run in self.runs.values():
                run.kv_bytes = sum(kv_entry_size(k, len(v)) for k, v in run.kv.items())
            self.kv_bytes = sum(run.kv_bytes for run in self.runs.values())

    def _put(self, run: Run, key: str, value: bytes | None) -> None:
        """Set (``None``: remove) one entry of ``run``'s store, counting its bytes."""
        old = run.kv.pop(key, None) if value is None else run.kv.get(key)
        if value is not None:
            run.kv[key] = value
        grown = (0 if value is None else kv_entry_size(key, len(value))) - (
            0 if old is None else kv_entry_size(key, len(old))
        )
        run.kv_bytes += grown
        self.kv_bytes += grown

    def kv_add(self, run_id: str, key: str, amount: int) -> int:
        with self.lock:
            run = self.run(run_id)
            value = add_int64(run.kv.get(key), amount, key)
            self._put(run, key, str(value).encode())
            self._kv_changed(run_id, run)
            return value

    def kv_compare_set(
        self, run_id: str, key: str, expected: bytes | None, desired: bytes
    ) -> bytes:
        with self.lock:
            run = self.run(run_id)
            current = run.kv.get(key)
            if current is None and expected is not None:
                return expected
            if current != expected:
                assert current is not None
                return current
            self._put(run, key, bytes(desired))
            self._kv_changed(run_id, run)
            return bytes(desired)

    def kv_delete(self, run_id: str, key: str) -> bool:
        with self.lock:
            run = self.runs.get(run_id)
            if run is None or key not in run.kv:
                return False
            self._put(run, key, None)
            self._kv_changed(run_id, run)
            return True

    async def kv_wait(self, run_id: str, keys: Iterable[str], timeout: float | None) -> bool:
        wanted = list(keys)
        with self.lock:
            run = self.run(run_id)
            run.touched = time.monotonic()
        kv = run.kv
        return await self._wait(run.key_waiters, lambda: all(k in kv for k in wanted), timeout)

    def _kv_changed(self, run_id: str, run: Run) -> None:
        _wake(run.key_waiters)
        self._changed(run_id, run)

    # -- runs -----------------------------------------------------------------------------

    def delete(self, run_id: str) -> bool:
        """Forget ``run_id`` (state and store), waking its waiters; whether it held anything."""
        with self.lock:
            run = self.runs.pop(run_id, None)
            if run is None:
                return False
            self.kv_bytes -= run.kv_bytes
            for waiters in (run.status_waiters, run.key_waiters):
                for waiter in waiters:
                    waiter.loop.call_soon_threadsafe(_resolve, waiter.future)
                waiters.clear()
            if self._on_change is not None:
                self._on_change(run_id)
            return not run.empty()

    def free_if_over(self, run_id: str) -> bool:
        """Make ``run_id``, if no node is in it any more (it closed, or its nodes all left),
        free for a new job at once, with no grace (it stays closed until a join makes it
        new); whether it was over."""
        with self.lock:
            run = self.runs.get(run_id)
            state = None if run is None else run.state
            if state is None or state.beats or state.vacated_ms is None:
                return False
            state.vacated_ms = LONG_AGO_MS
            return True

    def health(self, run_id: str) -> JobHealth | None:
        """The job's health of ``run_id`` (``None``: no such run)."""
        with self.lock:
            run = self.runs.get(run_id)
            return None if run is None or run.state is None else health_of(run.state)

    def wake_everyone(self) -> None:
        """Wake every waiter of every run (a server shutting down)."""
        with self.lock:
            for run in self.runs.values():
                for waiters in (run.status_waiters, run.key_waiters):
                    for waiter in waiters:
                        waiter.loop.call_soon_threadsafe(_resolve, waiter.future)
                    waiters.clear()

    async def _wait(
        self, waiters: set[_Waiter], ready: Callable[[], bool], timeout: float | None
    ) -> bool:
        loop = asyncio.get_running_loop()
        with self.lock:
            if ready():
                return True
            waiter = _Waiter(loop, loop.create_future(), ready)
            waiters.add(waiter)
        # One future and one timer handle: ``asyncio.wait`` would add a task-like
        # wrapper, callbacks and a set per waiter, a fifth of a busy server's time (every
        # held heartbeat of a job waits here; measured with py-spy at 2,048 nodes).
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter.future)
        try:
            await waiter.future
        finally:
            if timer is not None:
                timer.cancel()
            with self.lock:
                waiters.discard(waiter)
            waiter.future.cancel()
        with self.lock:
            return ready()
