"""The agent's beat: a deadline its workers watch, so that a frozen agent's workers stop.

How it works: a frozen agent (``SIGSTOP``, a debugger, an event loop blocked for good) sends
no keep-alive, and its node's peers drop it after the heartbeat window and go on, maybe
with a spare in its place; it cannot stop its workers either. So each worker stops itself:
the agent keeps one page of shared memory (``/dev/shm``, 4 KiB) and a task on its event
loop writes there, every :attr:`AgentBeat.period` seconds, a deadline on the machine's
monotonic clock; each worker's bootstrap (:mod:`aelastic.worker._site._aelastic_guard`)
runs a thread that sleeps until that deadline and, when it finds it passed, SIGKILLs the
worker's process group. The deadline is the earliest moment the peers may drop the node:
one heartbeat window after this node's last keep-alive went out (:attr:`keep_alive_age`:
the backend heard it no earlier), and never sooner than ``window - interval`` from now (a
keep-alive held by a slow backend is no sign of a frozen agent). A healthy loop pushes it
forward long before it comes; a loop that did not run that long is one whose node may
already be dropped. So no worker of a frozen node runs beside the rank that replaces it.

An agent that runs again after it missed a deadline finds its workers gone (killed by
SIGKILL, their error files saying why): :meth:`AgentBeat.lapsed` tells the supervision, and
the agent re-rendezvouses without spending a restart, as it would for a node removed from
its round. When the agent ends it writes a deadline that never comes (it stops its workers
itself) and removes the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import tempfile
import time
from typing import TYPE_CHECKING

from ...core.race import cancel_and_wait
from ...worker._site import _aelastic_guard as runtime

if TYPE_CHECKING:
    from ...rendezvous.handler import DynamicRendezvousHandler

__all__ = ["AgentBeat"]

log = logging.getLogger("aelastic.agent")

#: Longest time between two writes of the deadline (seconds).
_MAX_PERIOD = 1.0


class AgentBeat:
    """The deadline page of one agent (see the module docstring).

    Args:
        handler: The agent's rendezvous handler (its heartbeat settings and keep-alives).
    """

    def __init__(self, handler: DynamicRendezvousHandler) -> None:
        self._handler = handler
        settings = handler.settings
        #: The heartbeat window (seconds): the peers drop a node silent for this long.
        self.window = settings.heartbeat_window
        # The least a deadline leaves from now: a window less the interval (the last
        # keep-alive may have gone out up to an interval ago), half the window at least.
        self.slack = max(self.window - settings.keep_alive_interval, min(self.window / 2, 1.0))
        #: Seconds between two writes: a small part of the slack.
        self.period = min(self.slack / 4, _MAX_PERIOD)
        self._dir: str | None = None
        self._mapping: mmap.mmap | None = None
        self._page: memoryview | None = None
        self._task: asyncio.Task[None] | None = None
        self._written = 0  # the deadline last written (ns)
        self._late_since: float | None = None  # when a missed deadline was last seen

    def start(self) -> None:
        """Make the page and start writing it (on the running loop; once). A page that
        cannot be made is logged: the workers then do not watch their agent."""
        if self._dir is not None:
            return
        shm = "/dev/shm"
        where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        try:
            self._dir = tempfile.mkdtemp(prefix="aelastic-beat-", dir=where)
            blank = bytearray(runtime.PAGE_SIZE)
            slots = memoryview(blank).cast("Q")
            slots[0] = runtime.BEAT_MAGIC
            slots[runtime.BEAT_AGENT] = os.getpid()
            slots[runtime.BEAT_WINDOW] = round(self.window * 1000)
            slots.release()
            with open(self.path, "wb") as f:
                f.write(blank)
            with open(self.path, "r+b") as f:
                self._mapping = mmap.mmap(f.fileno(), runtime.PAGE_SIZE)
            self._page = memoryview(self._mapping).cast("Q")
        except OSError as exc:
            log.warning("workers will not watch this agent (no beat page): %s", exc)
            self._release()
            return
        self._write()
        self._task = asyncio.get_running_loop().create_task(self._beat(), name="aelastic-beat")

    @property
    def path(self) -> str:
        """The page's file."""
        assert self._dir is not None
        return os.path.join(self._dir, "beat")

    def env(self) -> dict[str, str]:
        """The variable that names the page to the workers (empty without a page)."""
        return {} if self._page is None else {runtime.ENV_BEAT: self.path}

    def deadline(self, now: float) -> float:
        """The deadline to write at monotonic time ``now`` (see the module docstring)."""
        deadline = now + self.slack
        age = self._handler.keep_alive_age
        if age is not None:
            deadline = max(deadline, now - age + self.window)
        return deadline

    def _write(self) -> None:
        page = self._page
        if page is None:
            return
        now = time.monotonic()
        now_ns = int(now * 1e9)
        if self._written and now_ns >= self._written:
            self._late_since = now
            log.warning(
                "this agent did not run for %.1f s, past the deadline its workers watch "
                "(frozen?): they stopped themselves",
                now - (page[runtime.BEAT_AT] / 1e9),
            )
        self._written = int(self.deadline(now) * 1e9)
        page[runtime.BEAT_AT] = now_ns
        page[runtime.BEAT_DEADLINE] = self._written

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self._write()

    def lapsed(self, since: float) -> bool:
        """Whether the agent missed a deadline after monotonic time ``since`` (or misses
        one now): its workers may have stopped themselves."""
        if self._written and time.monotonic_ns() >= self._written:
            self._write()  # noticed here first (a worker's exit woke the loop before the beat)
        return self._late_since is not None and self._late_since >= since

    async def aclose(self) -> None:
        """Stop writing; a deadline that never comes (the agent stops its workers itself);
        remove the page."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        if self._page is not None:
            self._page[runtime.BEAT_DEADLINE] = runtime.BEAT_NEVER
        self._release()

    def _release(self) -> None:
        if self._page is not None:
            self._page.release()
            self._page = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self._dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir, "beat"))
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)
            self._dir = None
