"""The views the pages stream, kept fresh while somebody looks: one reader per run.

How it works: a :class:`Feed` holds the newest view (JSON) and a version; every page that
shows it awaits :meth:`Feed.next`. A :class:`RunFeed` reads its run's snapshot, compares it
with the one before (:class:`~.model.History`) and publishes; then it waits on the source
until the status's token moves (a round transition, a member lost, the run closed) or a
slow tick passes (joins to a forming round notify nobody, and heartbeat times move), and
reads again. Heartbeats never wake it, and nothing is added to the rendezvous path: the
tick is the page's own. A :class:`RunsFeed` lists the runs every tick. The
:class:`FeedHub` starts a feed when the first page opens it and stops it a while after the
last one left (its history is kept for a page opened again meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from ..core.errors import RendezvousError
from ..core.race import wait_within
from .model import MAX_LISTED, History, health_view, run_view, runs_view
from .sources import RunSource

__all__ = ["Feed", "FeedHub", "FeedLimitError", "RunFeed", "RunsFeed"]

#: Seconds between two reads of a watched run when nothing woke the feed.
RUN_TICK = 1.0
#: Seconds between two listings of the runs.
LIST_TICK = 2.0
#: Seconds a feed nobody watches is kept (with its history) before it stops.
LINGER = 300.0
#: Runs watched at once, at most.
MAX_FEEDS = 64
#: What a failed read may raise (the page shows it, the feed tries again).
_READ_ERRORS = (RendezvousError, OSError, ValueError, TimeoutError)


class FeedLimitError(RuntimeError):
    """Too many runs are watched at once."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class Feed:
    """The newest view of something, and who looks at it."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.version = 0
        self.view: dict[str, Any] | None = None
        self.viewers = 0
        self.idle_since = time.monotonic()
        self.stopped = False
        self.task: asyncio.Task[None] | None = None
        self._news = asyncio.Event()

    def publish(self, view: dict[str, Any]) -> None:
        """Make ``view`` the newest and wake the pages waiting for it (unless only the
        backend's clock moved: pages count ages and countdowns themselves)."""
        if self.view is not None and {**self.view, "now_ms": 0} == {**view, "now_ms": 0}:
            return
        self.view = view
        self.version += 1
        news, self._news = self._news, asyncio.Event()
        news.set()

    def stop(self) -> None:
        """Stop reading; wake every page (they end their streams)."""
        self.stopped = True
        self._news.set()

    async def next(self, seen: int, timeout: float) -> tuple[int, dict[str, Any]] | None:
        """The newest view once it is newer than version ``seen``; ``None`` after
        ``timeout`` s or when the feed stopped."""
        if self.version <= seen or self.view is None:
            news = self._news
            with contextlib.suppress(TimeoutError):
                await wait_within(news.wait(), timeout)
        if self.stopped or self.version <= seen or self.view is None:
            return None
        return self.version, self.view

    def forgotten(self, linger: float) -> bool:
        """Whether nobody has looked for ``linger`` seconds."""
        return self.viewers == 0 and time.monotonic() - self.idle_since >= linger

    async def read(self) -> None:
        """Read until stopped (see the subclasses)."""
        raise NotImplementedError


class RunFeed(Feed):
    """One run's view (see the module docstring)."""

    def __init__(self, source: RunSource, run_id: str, tick: float = RUN_TICK) -> None:
        super().__init__(tick)
        self.source = source
        self.run_id = run_id
        self.history = History()

    async def read(self) -> None:
        source, run_id = self.source, self.run_id
        snapshot = None
        read_at, backend_ms = time.monotonic(), round(time.time() * 1000)
        while not self.stopped:
            error = None
            try:
                fresh = await source.snapshot(run_id)
            except _READ_ERRORS as exc:
                error = _one_line(exc)
            else:
                if fresh is not None:
                    read_at, backend_ms = time.monotonic(), fresh.status.now_ms
                now = backend_ms + round((time.monotonic() - read_at) * 1000)
                self.history.observe(fresh, now)
                snapshot = fresh
            health = None if error is not None else await self._health()
            self.publish(run_view(run_id, snapshot, self.history, error=error, health=health))
            if self._done():
                return
            token = "" if snapshot is None else snapshot.status.token
            try:
                if error is None:
                    await source.wait_for_change(run_id, token, self.tick)
                else:
                    await asyncio.sleep(self.tick)
            except _READ_ERRORS:
                await asyncio.sleep(self.tick)

    async def _health(self) -> dict[str, Any] | None:
        """The job's health as the rendezvous keeps it (``None`` when unreadable)."""
        try:
            health = await self.source.health(self.run_id)
        except _READ_ERRORS:
            return None
        if health is None:
            return None
        return health_view(health, health.latest.failed if health.latest else 0)

    def _done(self) -> bool:
        return self.stopped or self.forgotten(LINGER)


class RunsFeed(Feed):
    """The list of runs (see the module docstring)."""

    def __init__(self, source: RunSource, tick: float = LIST_TICK) -> None:
        super().__init__(tick)
        self.source = source

    async def read(self) -> None:
        while not self.stopped:
            try:
                runs = await self.source.list_runs(MAX_LISTED + 1)
            except _READ_ERRORS as exc:
                view = runs_view([], error=_one_line(exc))
                if self.view is not None:  # keep showing what was listed last
                    view = {**self.view, "error": view["error"]}
                self.publish(view)
            else:
                self.publish(runs_view(runs[:MAX_LISTED], more=len(runs) > MAX_LISTED))
            if self.forgotten(self.tick * 5):
                return
            await asyncio.sleep(self.tick)


class FeedHub:
    """The feeds of one page server.

    Args:
        source: Where the runs are read.
        run_tick: Seconds between reads of a watched run nothing woke (heartbeat times).
        list_tick: Seconds between two listings.
        max_feeds: Runs watched at once, at most.
    """

    def __init__(
        self,
        source: RunSource,
        *,
        run_tick: float = RUN_TICK,
        list_tick: float = LIST_TICK,
        max_feeds: int = MAX_FEEDS,
    ) -> None:
        self.source = source
        self._run_tick = run_tick
        self._max_feeds = max_feeds
        self._runs: dict[str, RunFeed] = {}
        self._list = RunsFeed(source, list_tick)
        self.closing = False

    def runs(self) -> RunsFeed:
        """The feed of the run list."""
        return self._list

    def run(self, run_id: str) -> RunFeed:
        """The feed of ``run_id`` (made if needed).

        Raises:
            FeedLimitError: ``max_feeds`` runs are watched already.
        """
        feed = self._runs.get(run_id)
        if feed is not None and not feed.stopped:
            return feed
        if len(self._runs) >= self._max_feeds:
            idle = [f for f in self._runs.values() if f.viewers == 0]
            if not idle:
                raise FeedLimitError(
                    f"{self._max_feeds} runs are being watched already: close a page first"
                )
            oldest = min(idle, key=lambda f: f.idle_since)
            oldest.stop()
            self._runs.pop(oldest.run_id, None)
        feed = self._runs[run_id] = RunFeed(self.source, run_id, self._run_tick)
        return feed

    async def exists(self, run_id: str) -> bool:
        """Whether ``run_id`` has a rendezvous state (or is watched, or cannot be read now:
        its page then says why)."""
        if run_id in self._runs:
            return True
        try:
            found = await self.source.snapshot(run_id) is not None
        except _READ_ERRORS:
            return True
        if not found:
            await self.source.release(run_id)
        return found

    @contextlib.asynccontextmanager
    async def watching(self, feed: Feed) -> AsyncIterator[None]:
        """Count a page looking at ``feed`` (started if it is not reading)."""
        feed.viewers += 1
        if feed.task is None or feed.task.done():
            feed.task = asyncio.get_running_loop().create_task(self._read(feed))
        try:
            yield
        finally:
            feed.viewers -= 1
            feed.idle_since = time.monotonic()

    async def _read(self, feed: Feed) -> None:
        try:
            await feed.read()
        finally:
            if isinstance(feed, RunFeed):
                feed.stop()
                if self._runs.get(feed.run_id) is feed:
                    del self._runs[feed.run_id]
                if feed.run_id not in self._runs and not self.closing:
                    await self.source.release(feed.run_id)

    async def aclose(self) -> None:
        """Stop every feed (their pages end their streams) and free the source."""
        self.closing = True
        feeds: list[Feed] = [self._list, *self._runs.values()]
        for feed in feeds:
            feed.stop()
        tasks = [f.task for f in feeds if f.task is not None and not f.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runs.clear()
        await self.source.aclose()
