"""The agent's own stdout and stderr, written without ever blocking its event loop.

How it works: what the agent shows (aelastic's lines, workers' teed output) goes to its own
stdout and stderr, which may be a pipe whose reader stopped reading or a terminal on hold.
A write to it then blocks the thread that makes it; on the event loop that would be every
heartbeat and every health-check answer of the node (its peers would drop it). So the loop
only queues the text (:func:`write`) and one daemon thread per process writes it out, in
order across both streams. At most :data:`LIMIT` bytes wait: beyond that, lines are dropped
and counted, and where they would have been the writer puts one note on the same stream::

    [aelastic] the console is not reading: 1234 line(s) dropped here (the log files have them)

A stream with no file descriptor (a test's ``StringIO``) is written at once. :func:`flush`
waits a bounded time for the queue to be written (the launcher calls it at exit).

Why a thread and not ``O_NONBLOCK``: the descriptors are shared with the workers, which
inherit them, and with the shell; a non-blocking file would make their writes fail with
``EAGAIN``. Hand-written (about 100 lines): ``logging.handlers.QueueListener`` has an
unbounded queue (a bounded one makes ``QueueHandler`` raise), and it serves log records only.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections import deque
from typing import IO, Any

__all__ = ["LIMIT", "dropped", "flush", "write"]

#: Bytes that may wait for a stalled console before lines are dropped.
LIMIT = 4 * 1024 * 1024


class _Note:
    """Where dropped lines would have been: their count, written as one line."""

    __slots__ = ("lines",)

    def __init__(self) -> None:
        self.lines = 0

    def text(self) -> bytes:
        return (
            f"[aelastic] the console is not reading: {self.lines} line(s) dropped here "
            "(the log files have them)\n"
        ).encode()


class _Writer:
    """The queue and the thread of one process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pid = os.getpid()
        self.dropped = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[tuple[int, bytes | _Note]] = deque()
        self._waiting = 0  # bytes queued or being written
        self._note: _Note | None = None  # the note that new drops add to
        self._thread: threading.Thread | None = None

    def put(self, fd: int, data: bytes) -> None:
        with self._lock:
            if self._waiting + len(data) > self.limit:
                if self._note is None:
                    self._note = _Note()
                    self._queue.append((fd, self._note))
                count = max(data.count(b"\n"), 1)
                self._note.lines += count
                self.dropped += count
            else:
                self._note = None
                self._queue.append((fd, data))
                self._waiting += len(data)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="aelastic-console", daemon=True
                )
                self._thread.start()
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._changed.wait()
                fd, item = self._queue[0]
                if item is self._note:
                    self._note = None  # later drops make a note of their own, after this one
            _write_all(fd, item.text() if isinstance(item, _Note) else item)
            with self._lock:
                self._queue.popleft()
                if not isinstance(item, _Note):
                    self._waiting -= len(item)
                self._changed.notify_all()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # somebody made the file non-blocking: wait until it takes
            with contextlib.suppress(OSError, ValueError):
                select.select([], [fd], [], 1.0)
        except InterruptedError:
            continue
        except OSError:
            return  # closed, or its reader is gone: nothing can be shown there


_writer: _Writer | None = None
_create = threading.Lock()


def _the_writer() -> _Writer:
    global _writer
    writer = _writer
    if writer is None or writer.pid != os.getpid():  # a forked child starts its own
        with _create:
            writer = _writer
            if writer is None or writer.pid != os.getpid():
                writer = _writer = _Writer(LIMIT)
    return writer


def write(stream: IO[str] | Any, text: str) -> None:
    """Show ``text`` on ``stream`` (``sys.stdout``, ``sys.stderr``, ...) without blocking:
    queued for the writer thread when the stream has a descriptor, else written at once."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1
    if fd < 0:
        with contextlib.suppress(OSError, ValueError):
            stream.write(text)
            stream.flush()
        return
    with contextlib.suppress(OSError, ValueError):
        stream.flush()  # what was printed to it before comes first
    encoding = getattr(stream, "encoding", None) or "utf-8"
    _the_writer().put(fd, text.encode(encoding, errors="replace"))


def flush(timeout: float = 2.0) -> bool:
    """Wait until what was written is out (at most ``timeout`` seconds); whether it is."""
    writer = _writer
    return writer is None or writer.pid != os.getpid() or writer.flush(timeout)


def dropped() -> int:
    """Lines dropped so far in this process because the console was not reading."""
    writer = _writer
    return 0 if writer is None or writer.pid != os.getpid() else writer.dropped
