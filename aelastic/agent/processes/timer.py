"""torch's file-based worker watchdog (``TORCHELASTIC_ENABLE_FILE_TIMER``) on the agent's loop.

How it works: with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the agent's environment, each
start of the workers gets a :class:`FileTimerServer`: a named pipe at ``TORCHELASTIC_TIMER_FILE``
(the agent's value, else a new path in a private directory), whose path the workers get in
the same variable. torch's ``FileTimerClient`` (``torch.distributed.elastic.timer``) opens it
for each request and writes one JSON line, ``{"version": 1, "pid": ..., "scope_id": ...,
"expiration_time": <time.time() seconds>, "signal": ...}``; a negative expiration time
releases the timer of ``(pid, scope_id)``. The agent reads the pipe when the loop says it is
readable (it keeps a writer of its own open, so the pipe never reports end-of-file between
clients) and keeps one loop timer armed at the earliest expiration: nothing polls.

When timers expire, each worker pid is sent the signal of its earliest expired timer that
has one (torch's ``FileTimerClient`` asks for SIGKILL); a pid whose expired timers carry no
signal is only logged. The worker dies, and the agent handles that like any worker failure:
the group restarts while restarts remain. Two deliberate differences from torch 2.13, whose
server then also sends that signal to the agent process itself (torchrun exits 137 and never
restarts) and reaps any pid it is told: here the agent survives, and a pid outside the
workers' process groups is ignored with a warning. The pipe is removed when the attempt ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...core.errors import reason

__all__ = ["ENABLE_VAR", "FILE_VAR", "FileTimerServer", "TimerRequest", "parse_request"]

log = logging.getLogger("aelastic.watchdog")  # shown by `aelastic run` (warnings)

#: ``1`` in the agent's environment enables the watchdog (torch's name).
ENABLE_VAR = "TORCHELASTIC_ENABLE_FILE_TIMER"
#: The named pipe's path, for the agent (optional) and its workers (torch's name).
FILE_VAR = "TORCHELASTIC_TIMER_FILE"

#: Longest line kept from a client (torch's clients refuse more than PIPE_BUF bytes).
_MAX_LINE = 64 * 1024


@dataclass(frozen=True)
class TimerRequest:
    """One line of torch's protocol: acquire (expiration >= 0) or release a timer."""

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def is_release(self) -> bool:
        """A negative expiration time releases the timer (torch's convention)."""
        return self.expiration_time < 0


def parse_request(line: bytes) -> TimerRequest:
    """Decode one JSON line written by torch's ``FileTimerClient``.

    Raises:
        ValueError: Not such a request.
    """
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        pid, scope, expiration, sig = (
            data["pid"],
            data["scope_id"],
            data["expiration_time"],
            data.get("signal", 0),
        )
    except KeyError as exc:
        raise ValueError(f"no {exc.args[0]!r}") from None
    if not isinstance(pid, int) or not isinstance(scope, str) or not isinstance(sig, int):
        raise ValueError("pid, scope_id or signal of the wrong type")
    if isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise ValueError("expiration_time is not a number")
    return TimerRequest(pid, scope, float(expiration), sig)


class FileTimerServer:
    """The watchdog of one attempt's workers (see the module docstring).

    Args:
        owns: Whether a pid belongs to this attempt's workers (their process groups).
        path: The named pipe (default: ``TORCHELASTIC_TIMER_FILE`` of ``env``, else a new
            path in a private directory).
        env: The agent's environment (default ``os.environ``).
    """

    def __init__(
        self,
        owns: Callable[[int], bool],
        path: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._owns = owns
        given = path or (os.environ if env is None else env).get(FILE_VAR)
        self._private_dir: str | None = None
        if not given:
            self._private_dir = tempfile.mkdtemp(prefix="aelastic_timer_")
            given = os.path.join(self._private_dir, f"watchdog_timer_{uuid.uuid4()}")
        self.path = given
        self._timers: dict[tuple[int, str], TimerRequest] = {}
        #: pid -> scope of the timer it was reaped for.
        self.reaped: dict[int, str] = {}
        self._buffer = b""
        self._read_fd: int | None = None
        self._keep_fd: int | None = None
        self._alarm: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def enabled(env: Mapping[str, str] | None = None) -> bool:
        """Whether ``TORCHELASTIC_ENABLE_FILE_TIMER`` is ``1`` (torch's test)."""
        return (os.environ if env is None else env).get(ENABLE_VAR) == "1"

    def start(self) -> None:
        """Make the pipe and read it on the running loop.

        Raises:
            OSError: The pipe cannot be made or opened.
        """
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        os.mkfifo(self.path, 0o600)
        try:
            self._read_fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            self._keep_fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            self.close()
            raise
        self._loop.add_reader(self._read_fd, self._on_readable)
        log.info("file-timer watchdog at %s", self.path)

    def close(self) -> None:
        """Stop reading, forget the timers, remove the pipe (and its private directory)."""
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if self._read_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._read_fd)
        for fd in (self._read_fd, self._keep_fd):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._keep_fd = None
        self._timers.clear()
        with contextlib.suppress(OSError):
            os.remove(self.path)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    @property
    def timers(self) -> dict[tuple[int, str], TimerRequest]:
        """The timers held now, by ``(pid, scope_id)``."""
        return dict(self._timers)

    # -- requests -------------------------------------------------------------------------

    def _on_readable(self) -> None:
        assert self._read_fd is not None
        while True:
            try:
                data = os.read(self._read_fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > _MAX_LINE:
            log.warning("file-timer watchdog: dropped a request longer than %d bytes", _MAX_LINE)
            self._buffer = b""
        for line in lines:
            if line.strip():
                self.handle(line)

    def handle(self, line: bytes) -> None:
        """Apply one request line (a bad one is logged and dropped)."""
        try:
            request = parse_request(line)
        except ValueError as exc:
            log.warning("file-timer watchdog: ignored a request (%s): %.200r", reason(exc), line)
            return
        key = (request.pid, request.scope_id)
        if request.is_release:
            self._timers.pop(key, None)
        else:
            self._timers[key] = request
        self._arm()

    # -- expiry ---------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if not self._timers or self._loop is None:
            return
        first = min(t.expiration_time for t in self._timers.values())
        delay = max(first - time.time(), 0.0)
        self._alarm = self._loop.call_at(self._loop.time() + delay, self.expire)

    def expire(self, now: float | None = None) -> None:
        """Reap the workers whose timers expired by ``now`` (default: the wall clock)."""
        self._alarm = None
        now = time.time() if now is None else now
        expired: dict[int, list[TimerRequest]] = {}
        for timer in self._timers.values():
            if timer.expiration_time <= now:
                expired.setdefault(timer.pid, []).append(timer)
        for pid, timers in expired.items():
            timers.sort(key=lambda t: t.expiration_time)
            for timer in timers:
                del self._timers[(pid, timer.scope_id)]
            armed = next((t for t in timers if t.signal > 0), None)
            scopes = ", ".join(t.scope_id for t in timers)
            if armed is None:
                log.warning(
                    "file-timer watchdog: timers of pid %d expired (%s) with no signal: not reaped",
                    pid,
                    scopes,
                )
            elif not self._owns(pid):
                log.warning(
                    "file-timer watchdog: timers of pid %d expired (%s), but it is "
                    "not in a worker's process group: ignored",
                    pid,
                    scopes,
                )
            else:
                self._reap(pid, armed)
        self._arm()

    def _reap(self, pid: int, timer: TimerRequest) -> None:
        name = _signal_name(timer.signal)
        log.warning(
            "file-timer watchdog: timer '%s' of worker pid %d expired: sending %s",
            timer.scope_id,
            pid,
            name,
        )
        self.reaped[pid] = timer.scope_id
        try:
            os.kill(pid, timer.signal)
        except ProcessLookupError:
            pass  # gone already
        except OSError as exc:
            log.error("file-timer watchdog: cannot signal pid %d: %s", pid, reason(exc))
        for key in [k for k in self._timers if k[0] == pid]:
            del self._timers[key]


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
