"""News of a run on etcd: one watch per process and run, feeding the run's watch.

How it works: a :class:`RunStream` holds one etcd watch (a streamed ``/v3/watch`` answer)
for every backend of its run in this process (per shared client), with up to two watchers
on it:

* the run's **header, cut and store** keys (``c``, ``h``, ``kv/...``): a header write is a
  round transition (the header changes on nothing else), told to the run's
  :class:`~aelastic.backends._watch.RunWatch` as the status it records; a store write wakes
  the waiters of that key; a new cut (``c``) is kept, so a finished join reads its rank in
  its one read. A join to a forming round and a heartbeat write none of these: they wake
  nobody;
* while a node of this process is among the first members of a complete round (ranks 0 to
  2, its **sentinels**), the **deletions** of the run's member keys: when etcd deletes the
  keys of a silent node (its lease expired), nothing else tells the survivors, so a
  sentinel asks the run's status (a short random while later, unless a header write came
  first), and that request writes what the loss changed (:func:`._port.reconcile`): every
  process then hears of it. Three sentinels, so one lost with the node is not missed; other
  members never receive deletions (a job of N nodes leaving would send N events to N
  processes).

The stream follows the client from member to member: on a failure it is opened again on the
next member from the revision after the last one it saw (no event is missed; if that
revision was compacted away, waiters re-read). Waiters are told when news may have been
missed (:meth:`RunWatch.on_lost`) and when it flows again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...core.errors import RendezvousConnectionError, RendezvousStateError
from ...core.race import cancel_and_wait, cancelling
from ...core.state import Status
from .._watch import RunWatch
from ._client import EtcdClient, EtcdError, b64, unb64
from ._layout import Header, RunKeys, decode_header, prefix_end
from ._leases import Deadlines
from ._port import status_of

__all__ = ["RunStream", "now_ms", "status_from_header"]

log = logging.getLogger("aelastic.backends.etcd")

#: How long a sentinel waits, at most, before it asks the status after a deletion.
SENTINEL_SPREAD = 0.2


def now_ms() -> int:
    """This process's time in whole milliseconds (the last call is timed on it)."""
    return round(time.time() * 1000)


def status_from_header(raw: bytes | Header, where: str, deadlines: Deadlines, now: int) -> Status:
    """The status a watcher is told: the header's fields, its counts as of its write."""
    h = raw if isinstance(raw, Header) else decode_header(raw, where)
    deadline = None
    if h.deadline is not None and h.rules is not None:
        deadline = deadlines.end(h.epoch, h.deadline[0], h.rules.last_call_ms, now)
    participants, waiting, redundant, _lost, finished, done = h.counts
    return status_of(h, participants, waiting, redundant, finished + done, done, now, deadline)


class RunStream:
    """The watch of one run in this process (see the module docstring).

    Args:
        client: The shared etcd client.
        keys: The run's keys.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self._client = client
        self._keys = keys
        self.watch = RunWatch()
        self.deadlines = Deadlines()
        self.where = f"The rendezvous state of run '{keys.run_id}' at {client.display}"
        #: The revision of the last completion heard of (a round's cut).
        self.cut: int | None = None
        #: The revision after which the live stream tells every change (``None``: not live).
        self.live_from: int | None = None
        #: The header the watch last brought (what :attr:`RunWatch.latest` was made of).
        self.header: Header | None = None
        self._revision = 0  # the last revision seen: a new stream starts after it
        self._sentinels: dict[object, Callable[[], Awaitable[object]]] = {}
        self._sentinel_on = False
        self._task: asyncio.Task[None] | None = None
        self._restart = asyncio.Event()
        self._header_rev = 0
        self._pending: asyncio.TimerHandle | None = None
        self._asking: asyncio.Task[None] | None = None
        self._deleted_at = 0
        self._resumed = False
        self._up = False

    def start(self) -> None:
        """Open the stream (on the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"aelastic-etcd-watch-{self._keys.run_id}"
            )

    async def aclose(self) -> None:
        """Close the stream; waiters are told that news stopped."""
        task, self._task = self._task, None
        if self._pending is not None:
            self._pending.cancel()
        for pending in (task, self._asking):
            if pending is not None:
                await cancel_and_wait(pending)
        self.live_from = None
        self.watch.on_lost()

    # -- sentinels ------------------------------------------------------------------------

    def sentinel(self, owner: object, ask: Callable[[], Awaitable[object]] | None) -> None:
        """``owner`` (a backend) is a sentinel of the run (``ask``: its status request),
        or no longer (``None``)."""
        if ask is None:
            self._sentinels.pop(owner, None)
        else:
            self._sentinels[owner] = ask
        if bool(self._sentinels) != self._sentinel_on:
            self._restart.set()

    def _on_deleted(self, revision: int) -> None:
        self._deleted_at = max(self._deleted_at, revision)
        if self._pending is None and (self._asking is None or self._asking.done()):
            loop = asyncio.get_running_loop()
            self._pending = loop.call_later(random.uniform(0.0, SENTINEL_SPREAD), self._ask)

    def _ask(self) -> None:
        self._pending = None
        if self._header_rev >= self._deleted_at or not self._sentinels:
            return  # a header write came after the deletion: it was seen to
        ask = next(iter(self._sentinels.values()))
        deleted = self._deleted_at

        async def asking() -> None:
            try:
                await ask()
            except Exception as exc:  # the next deletion or request tries again
                log.warning("a sentinel's status request failed: %s", exc)
            if self._deleted_at > deleted:  # more came meanwhile
                self._on_deleted(self._deleted_at)

        self._asking = asyncio.get_running_loop().create_task(asking())

    # -- the stream -----------------------------------------------------------------------

    def _body(self) -> list[dict[str, Any]]:
        k = self._keys
        start = self._revision + 1 if self._revision else 0
        self._resumed = bool(start)
        news: dict[str, Any] = {
            "key": b64(k.cut),
            "range_end": b64(prefix_end(k.store)),
            "watch_id": 1,
        }
        if start:
            news["start_revision"] = start
        parts = [{"create_request": news}]
        self._sentinel_on = bool(self._sentinels)
        if self._sentinel_on:
            members: dict[str, Any] = {
                "key": b64(k.participants),
                "range_end": b64(prefix_end(k.waiting)),
                "filters": ["NOPUT"],
                "watch_id": 2,
            }
            if start:
                members["start_revision"] = start
            parts.append({"create_request": members})
        return parts

    async def _run(self) -> None:
        delay = 0.05
        failing, failures = False, 0
        while True:
            self._restart.clear()
            self._up = False
            member = self._client.member
            try:
                async with self._client.stream("/v3/watch", self._body()) as messages:
                    await self._read(messages)
                if failing:
                    log.info("the watch of run '%s' is back", self._keys.run_id)
                failing, delay, failures = False, 0.05, 0
            except asyncio.CancelledError:
                raise
            except (ConnectionError, EtcdError, RendezvousConnectionError, OSError) as exc:
                failures = 1 if self._up else failures + 1
                # Moving to another member is what a member lost looks like: said once the
                # watch failed on every member.
                if failures == len(self._client.endpoint.members):
                    log.warning(
                        "the watch of run '%s' at %s fails (%s); waiters ask etcd themselves "
                        "until it is back",
                        self._keys.run_id,
                        self._client.display,
                        exc,
                    )
                    failing = True
                else:
                    log.info("the watch of run '%s' moves to another member (%s)",
                             self._keys.run_id, exc)  # fmt: skip
                self._client.next_member(member)
            except Exception:
                log.exception("the watch of run '%s' failed", self._keys.run_id)
                failing = True
            if cancelling():  # a cancellation lost on the way: still the end
                raise asyncio.CancelledError
            self.live_from = None
            self.watch.on_lost()
            if not self._restart.is_set():
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _read(self, messages: Any) -> None:
        """Until the stream fails, or the sentinels changed (it is opened again then)."""
        reader = asyncio.ensure_future(self._consume(messages))
        restart = asyncio.ensure_future(self._restart.wait())
        try:
            await asyncio.wait({reader, restart}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, restart):
                task.cancel()
            await asyncio.wait({reader, restart})
        if not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()  # type: ignore[misc]

    async def _consume(self, messages: Any) -> None:
        async for doc in messages:
            self._handle(doc)
        raise ConnectionError("the watch ended")

    def _handle(self, doc: dict[str, Any]) -> None:
        header = doc.get("header", {})
        if doc.get("compact_revision"):
            self._revision = 0  # compacted: start from now; waiters re-read
            raise ConnectionError("the watch's revision was compacted")
        if doc.get("canceled"):
            raise ConnectionError(f"etcd cancelled the watch: {doc.get('cancel_reason', '')}")
        if doc.get("created"):
            if int(doc.get("watch_id", 0)) in (0, 1):
                if not self._resumed:  # from now on: nothing before it is owed
                    self._revision = max(self._revision, int(header.get("revision", 0)))
                self.live_from = self._revision
                self._up = True
                self.watch.on_live()
            return
        events = doc.get("events", [])
        watcher = int(doc.get("watch_id", 0))
        for event in events:
            kv = event.get("kv", {})
            revision = int(kv.get("mod_revision", 0))
            self._revision = max(self._revision, revision)
            if watcher == 2:
                self._on_deleted(revision)
                continue
            key = unb64(kv.get("key")).decode(errors="replace")
            deleted = event.get("type") == "DELETE"
            self._on_news(key, deleted, unb64(kv.get("value")), revision)

    def _on_news(self, key: str, deleted: bool, value: bytes, revision: int) -> None:
        k = self._keys
        if key == k.header:
            self._header_rev = max(self._header_rev, revision)
            if deleted:
                self.cut, self.header = None, None
                self.watch.on_status(Status(now_ms=now_ms()))
                return
            try:
                header = decode_header(value, self.where)
            except RendezvousStateError:
                return  # a foreign value: requests say so
            self.header = header
            self.watch.on_status(status_from_header(header, self.where, self.deadlines, now_ms()))
        elif key == k.cut:
            self.cut = None if deleted else revision
        elif key.startswith(k.store):
            self.watch.on_key(key[len(k.store) :].encode())
