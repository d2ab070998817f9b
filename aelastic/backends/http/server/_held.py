"""Heartbeats held on the channels: one timer wheel and one watch per run, no task per beat.

How it works: every member of a complete round keeps one keep-alive held on the server
(:mod:`._answer` says when a held request is answered). On the channel, a held keep-alive is
a small record (:class:`Held`) instead of a task awaiting a future with a timer: it is
applied when it arrives (:meth:`HeldBeats.take`), its answer is encoded then (the brief form,
``core/brief.py``, when nothing but time moved), and it waits in a slot of a timer wheel
(``_TICK`` s slots, one loop timer for the whole server, armed at the earliest slot) and in
its run's set. When the hold ends the answer made at arrival goes out, as before. When the
run's status moves, the one watch of the run (:meth:`~aelastic.backends._engine.Engine.
on_status_change`) answers every beat held on it: each is applied again, as its node would
send it, in batches (the loop serves other messages between them). An answer is written at
once (an uncompressed WebSocket frame is written without waiting, unless the socket's
buffer is full: then a task finishes it); with a journal (``--persist``) an answer waits
until the change is durable, in a task, as :func:`._answer.answer` does. Anything else (no
hold, a server closing, a journal write under way, a run over the limit) goes the way of
every request (:mod:`._channel`'s task and :func:`._answer.answer`).

Why: a held beat as a task, a future and a timer cost the server about 110 us of CPU per
beat at 4,096 nodes and 5.4 KB of memory per node (measured); see docs/scale.md.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from ....core.brief import brief_to_json, is_brief
from ....core.state import Reply, Request
from ....core.wire import reply_to_json
from ..._engine import now_ms
from ._runs import RunLimitError, RunStore

__all__ = ["HeldBeats", "encode", "start"]

#: Seconds per slot of the timer wheel: a held beat is answered up to this late.
_TICK = 0.02
#: Beats answered again per loop iteration when news comes.
_BATCH = 256


class _Channel(Protocol):
    """What a held beat needs of its channel."""

    beats: dict[int, Held]

    @property
    def closed(self) -> bool: ...

    def send_text(self, text: str, status: int) -> None: ...

    def deliver(self, msg_id: int, reply: Reply, key: str) -> None: ...


def encode(msg_id: int, reply: Reply, key: str) -> str:
    """The answer to request ``msg_id``: brief when it may be (``key``: its beat key)."""
    if is_brief(reply, key):
        now, oldest = brief_to_json(reply)
        return f'{{"id":{msg_id},"brief":[{now},{oldest}]}}'
    return json.dumps({"id": msg_id, "reply": reply_to_json(reply)}, separators=(",", ":"))


def start(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
    """Run ``coro`` (a WebSocket send) up to its first wait; only if it waits (a full
    buffer) is it finished in a task, kept in ``tasks``. A closed socket is ignored."""
    try:
        waited = coro.send(None)
    except StopIteration:
        return
    except (ConnectionError, RuntimeError):
        return  # the client went away
    task = asyncio.get_running_loop().create_task(_resume(coro, waited))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _resume(coro: Coroutine[Any, Any, None], waited: Any) -> None:
    try:
        while True:
            try:
                if waited is None:
                    await asyncio.sleep(0)
                else:
                    await waited
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the awaited future failed: tell the send
                try:
                    waited = coro.throw(exc)
                except StopIteration:
                    return
                continue
            try:
                waited = coro.send(None)
            except StopIteration:
                return
    except (ConnectionError, RuntimeError):
        return
    finally:
        coro.close()


class Held:
    """One held keep-alive."""

    __slots__ = ("channel", "key", "msg_id", "request", "run_id", "slot", "text", "token")

    def __init__(
        self,
        channel: _Channel,
        msg_id: int,
        run_id: str,
        request: Request,
        key: str,
        text: str,
        token: str,
        slot: int,
    ) -> None:
        self.channel = channel
        self.msg_id = msg_id
        self.run_id = run_id
        self.request = request
        self.key = key
        self.text = text
        self.token = token
        self.slot = slot


class _Run:
    __slots__ = ("beats", "cancel")

    def __init__(self) -> None:
        self.beats: dict[Held, None] = {}
        self.cancel: Callable[[], None] | None = None


class HeldBeats:
    """The held keep-alives of every channel of one server (see the module docstring).

    Args:
        store: The server's runs.
    """

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._slots: dict[int, dict[Held, None]] = {}
        self._due: list[int] = []  # slot numbers (a heap; emptied slots stay until due)
        self._timer: asyncio.TimerHandle | None = None
        self._armed: int | None = None
        self._runs: dict[str, _Run] = {}
        self._news: list[Held] = []  # to answer again, in batches

    def take(
        self,
        channel: _Channel,
        msg_id: int,
        run_id: str,
        request: Request,
        hold: float,
        seen: str | None,
        key: str,
    ) -> bool:
        """Apply keep-alive ``request`` and hold it (or answer it at once when it must not
        be held, as :func:`._answer.answer` would); ``False`` (nothing done) when it must
        go the way of every request."""
        store = self._store
        if hold <= 0 or store.closing or not store.settled:
            return False
        try:
            store.admit(run_id)
        except RunLimitError:
            return False
        now = now_ms()
        bar = key.find("|")
        brief = None
        if bar > 0 and (seen is None or seen == key[:bar]):  # a plain beat: the short path
            brief = store.engine.short_beat(run_id, request.node, request.secret, key, now)
        if brief is not None:
            token = key[:bar]  # the run's token: the key matched its status
            text = f'{{"id":{msg_id},"brief":[{brief[0]},{brief[1]}]}}'
        else:
            reply = store.engine.apply(run_id, request, now)
            token = reply.status.token
            if not reply.known or (seen is not None and seen != token):
                channel.deliver(msg_id, reply, key)  # news already: at once
                return True
            text = encode(msg_id, reply, key)
        loop = asyncio.get_running_loop()
        slot = math.ceil((loop.time() + hold) / _TICK)
        held = Held(channel, msg_id, run_id, request, key, text, token, slot)
        old = channel.beats.get(msg_id)
        if old is not None:  # an id used again while held: the older is withdrawn
            self.drop(old)
        channel.beats[msg_id] = held
        store.holding.add(run_id, request.node)
        beats = self._slots.get(slot)
        if beats is None:
            beats = self._slots[slot] = {}
            heapq.heappush(self._due, slot)
        beats[held] = None
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run()
        run.beats[held] = None
        if run.cancel is None:
            run.cancel = store.engine.on_status_change(run_id, token, lambda: self._moved(run_id))
        self._arm(loop)
        return True

    def drop(self, held: Held) -> None:
        """Forget ``held`` without answering it (withdrawn, or its channel closed)."""
        if held.channel.beats.get(held.msg_id) is held:
            del held.channel.beats[held.msg_id]
            self._store.holding.remove(held.run_id, held.request.node)
        beats = self._slots.get(held.slot)
        if beats is not None:
            beats.pop(held, None)
            if not beats:
                del self._slots[held.slot]
        run = self._runs.get(held.run_id)
        if run is not None:
            run.beats.pop(held, None)
            if not run.beats:
                del self._runs[held.run_id]
                if run.cancel is not None:
                    run.cancel()

    # -- the wheel --------------------------------------------------------------------------

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        due = self._due
        while due and due[0] not in self._slots:
            heapq.heappop(due)
        first = due[0] if due else None
        if first == self._armed:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._armed = first
        self._timer = None if first is None else loop.call_at(first * _TICK, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = self._armed = None
        now = math.floor((loop.time() + 0.001) / _TICK)  # a timer may fire a hair early
        due = self._due
        while due and due[0] <= now:
            beats = self._slots.get(heapq.heappop(due))
            for held in list(beats or ()):
                self.drop(held)
                if not held.channel.closed:
                    held.channel.send_text(held.text, 200)
        self._arm(loop)

    def flush(self) -> None:
        """Answer every held beat now (the server is closing: applied again, each sees
        the run as it is)."""
        for run_id, run in list(self._runs.items()):
            if run.cancel is not None:
                run.cancel()
                run.cancel = None
            self._moved(run_id)
        while self._news:
            self._answer_news()

    # -- news -------------------------------------------------------------------------------

    def _moved(self, run_id: str) -> None:
        """The run's status moved (or it was deleted, or the server closes)."""
        run = self._runs.get(run_id)
        if run is None:
            return
        run.cancel = None
        state = self._store.engine.runs.get(run_id)
        token = None if state is None or self._store.closing else state.token
        moved = [h for h in run.beats if h.token != token]
        for held in moved:
            self.drop(held)
        if run_id in self._runs and token is not None:  # beats held since, at this token
            run.cancel = self._store.engine.on_status_change(
                run_id, token, lambda: self._moved(run_id)
            )
        first = not self._news
        self._news += moved
        if first and self._news:
            self._answer_news()

    def _answer_news(self) -> None:
        """Answer a batch of the beats news brought early: each applied again now, as its
        node, still holding its request, would send it (answered with the arrival's status
        instead, a beat counted from before the news could expire while the whole job sends
        its next beats at once: seen at 4,096 nodes on 2 cores)."""
        batch, self._news = self._news[:_BATCH], self._news[_BATCH:]
        engine = self._store.engine
        for held in batch:
            if not held.channel.closed:
                reply = engine.apply(held.run_id, held.request, now_ms())
                held.channel.deliver(held.msg_id, reply, held.key)
        if self._news:
            asyncio.get_running_loop().call_soon(self._answer_news)
