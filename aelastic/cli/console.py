"""The launcher's console: one readable line per thing the agent does, with timings.

How it works: :class:`Console` is an agent event listener (``agent.add_listener``). Each
:class:`~aelastic.agent.AgentEvent` becomes at most one line on stderr, prefixed with
``[aelastic +<seconds since launch>]``, saying what happened in words a newcomer understands
(rendezvous, starting workers, a worker exited, restarting, rescaling, done) and how long it
took. Every line is redacted (:func:`aelastic.core.redact.redact`): no endpoint password,
``password=``/``token=`` value or known secret is ever printed. A hung worker (where it is
stuck), the job's first failure (from the rendezvous store: the same on every node), a
quarantined host and workers that outlived SIGKILL get a line each. The job's root cause is
said once: held until the next line of the run (a restart, a rescale), or until the end of
a failed run, where it follows this node's report in torch's shape (:meth:`Console.result`:
the entrypoint's name, the failures, the root cause; a traceback the worker's own output
showed is not shown again). Lines are queued, never
written on the event loop (:mod:`aelastic.agent.output.writer`): a console that stops reading
costs dropped lines and a note, never a heartbeat. Workers' own output is not touched: it
goes to stdout/stderr as the agent streams it.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from ..agent.api import ProcessFailure, RunResult
from ..agent.events import EventKind
from ..agent.health.errors import SHOWN_WIDTH, format_failures, printable
from ..agent.output import writer
from ..core.events import Event
from ..core.health import FailureRecord, shown
from ..core.redact import redact

__all__ = ["Console", "describe_exit", "summarize_failure"]


#: "(3 restarts left)" inside the agent's reason: the console says it once, at the end.
_RESTARTS_LEFT = re.compile(r"\s*\(\d+ restarts? left\)")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _ms(seconds: Any) -> str:
    value = float(seconds)
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def describe_exit(exitcode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` for a worker's exit status."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    import signal

    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def summarize_failure(failure: ProcessFailure) -> str:
    """One line: which rank failed, how, and the last line of its error message (escaped,
    cut)."""
    message = failure.message.strip().rsplit("\n", 1)[-1] if failure.message.strip() else ""
    if len(message) > SHOWN_WIDTH:
        message = f"{message[:SHOWN_WIDTH]}..."
    message = printable(message)
    text = (
        f"rank {failure.global_rank} (local rank {failure.local_rank}, pid {failure.pid}, "
        f"host {failure.hostname}) failed with {describe_exit(failure.exitcode)}"
    )
    return f"{text}: {message}" if message else text


class _LogHandler(logging.Handler):
    def __init__(self, console: Console) -> None:
        super().__init__()
        self._console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
            self._console.line(level + text, always=True, news=False)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


class Console:
    """Prints the agent's progress.

    Args:
        stream: Where to write (stderr by default).
        enabled: ``False`` prints only errors and the final summary.
        started: Monotonic time of the launch (``+seconds`` are counted from it).
        secrets: Values never to print (passwords, tokens), masked wherever they appear.
        report: ``False``: a failed run's report in torch's shape is left to the caller,
            which raises torch's ``ChildFailedError`` (its message is that report).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        enabled: bool = True,
        started: float | None = None,
        secrets: Iterable[str] = (),
        report: bool = True,
    ) -> None:
        self._stream = stream
        self._report = report
        self._enabled = enabled
        self._started = time.monotonic() if started is None else started
        self._secrets = frozenset(secrets)
        self._job_failure: str | None = None
        self._held: str | None = None  # the job's root cause, not said yet

    def line(self, text: str, *, always: bool = False, news: bool = True) -> None:
        """Print ``text`` as one launcher line (``news``: a line of the run's story, which
        the job's root cause, when held, goes before; a log record is not)."""
        if news:
            self._say_held()
        if not (self._enabled or always):
            return
        stream = self._stream or sys.stderr
        elapsed = time.monotonic() - self._started
        writer.write(stream, f"[aelastic +{elapsed:.2f}s] {redact(text, self._secrets)}\n")

    def capture_logs(self, level: int | None = None) -> logging.Handler:
        """Show aelastic's log records as console lines; returns the installed handler.

        Args:
            level: Threshold for every aelastic logger; by default warnings, except the
                agent's (whose news the event lines already tell), which show from errors.
        """
        handler = _LogHandler(self)
        root = logging.getLogger("aelastic")
        root.addHandler(handler)
        root.propagate = False
        root.setLevel(logging.WARNING if level is None else level)
        if level is None:
            logging.getLogger("aelastic.agent").setLevel(logging.ERROR)
        return handler

    def __call__(self, event: Event) -> None:
        """The agent listener: print the line for ``event``, if it deserves one."""
        text = self.describe(event)
        if event.kind is EventKind.JOB_FAILURE and text:
            if text != self._job_failure:  # read again, unchanged: held or said already
                self._held = text
            self._job_failure = text
        elif event.kind in _ALWAYS and text:
            self.line(text, always=True)
        elif text:
            self.line(text)

    def _say_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self.line(held, always=True, news=False)

    def job_failure(self) -> None:
        """Say the job's root cause (at the end) unless it was said already."""
        self._say_held()

    @staticmethod
    def describe(event: Event) -> str | None:
        """The line for ``event`` (``None``: nothing worth a line)."""
        data: Mapping[str, Any] = event.data
        kind = event.kind
        if kind is EventKind.RENDEZVOUS:
            took = f" in {_ms(data['duration'])}" if "duration" in data else ""
            nodes = int(data.get("group_world_size", 0))
            return (
                f"rendezvous round {data.get('round', '?')} complete{took}: "
                f"{_plural(nodes, 'node')}, this one is node {data.get('group_rank', '?')}; "
                f"{_plural(int(data.get('world_size', 0)), 'worker')} in all"
            )
        if kind is EventKind.WORKERS_STARTED:
            pids = data.get("pids") or {}
            shown = ", ".join(str(p) for _, p in sorted(dict(pids).items()))
            text = f"started {_plural(len(pids), 'worker')} (pid {shown})"
            if "duration" in data:
                text += f" in {_ms(data['duration'])}"
            if data.get("recovery") is not None:
                text += f"; back to work {_ms(data['recovery'])} after the interruption"
            return text
        if kind is EventKind.WORKERS_RECOVERED:
            pids = data.get("pids") or {}
            shown = ", ".join(str(p) for _, p in sorted(dict(pids).items()))
            text = f"kept {_plural(len(pids), 'worker')} (pid {shown}): they join the new group"
            if data.get("recovery") is not None:
                text += f" {_ms(data['recovery'])} after the interruption"
            return text
        if kind is EventKind.WORKER_EXITED:
            code = int(data.get("exitcode", 0))
            status = "finished" if code == 0 else f"failed ({describe_exit(code)})"
            return (
                f"worker rank {data.get('global_rank', '?')} (local {data.get('local_rank', '?')},"
                f" pid {data.get('pid', '?')}) {status}"
            )
        if kind is EventKind.MEMBERSHIP_CHANGED:
            if data.get("ignored"):
                return None
            return f"the group changed: {_membership(data)}"
        if kind is EventKind.RESTART:
            reason = _RESTARTS_LEFT.sub("", str(data.get("reason", "?")))
            if data.get("spent"):
                left = int(data.get("restarts_left", 0))
                return f"restarting the workers ({reason}); {_plural(left, 'restart')} left"
            return f"rescaling: re-forming the group ({reason}); no restart spent"
        if kind in _HEALING:
            return _healing(kind, data)
        if kind is EventKind.EXIT_BARRIER:
            if data.get("complete", True):
                return f"every node finished (exit barrier took {_ms(data.get('duration', 0))})"
            return f"gave up waiting for the other nodes after {_ms(data.get('duration', 0))}"
        return None

    def result(
        self,
        result: RunResult,
        name: str,
        shown: Callable[[ProcessFailure], bool] | None = None,
    ) -> None:
        """The end: success; or this node's failures in torch's shape (``<name> FAILED``,
        the failures, the root cause), then the job's root cause, once.

        Args:
            result: The run's result.
            name: The entrypoint's name (torch's title).
            shown: Whether a failure's traceback reached the console with the worker's own
                output (then the report does not show it again).
        """
        if not result.is_failed():
            self.line(f"{name}: all workers of this node succeeded")
            return
        if result.root_cause is None:
            self.line(f"{name} FAILED (no worker failure recorded)", always=True)
        elif self._report:
            text = format_failures(result, name, shown=shown)
            self.line(f"the failures of this node:\n{text}", always=True, news=False)
        self.job_failure()


_HEALING = frozenset(
    {
        EventKind.WORKER_STALLED,
        EventKind.JOB_FAILURE,
        EventKind.QUARANTINED,
        EventKind.UNKILLABLE,
    }
)
#: Lines shown even with ``--quiet``.
_ALWAYS = _HEALING - {EventKind.JOB_FAILURE}


def _healing(kind: EventKind, data: Mapping[str, Any]) -> str:
    if kind is EventKind.WORKER_STALLED:
        who = (
            f"rank {data.get('global_rank', '?')} (local {data.get('local_rank', '?')}, "
            f"pid {data.get('pid', '?')}) on host {shown(str(data.get('host', '?')))}"
        )
        idle = _idle(data)
        at = data.get("user_where") or data.get("where") or "an unknown line (no stacks)"
        if data.get("stopped") and not data.get("where"):
            at = "an unknown line (no stacks: the process is stopped, by SIGSTOP or a debugger)"
        if data.get("waiting_for_peer"):
            startup = data.get("phase") == "startup"
            wait = "a minute at most" if startup else "one more stall timeout (6 s at least)"
            return (
                f"{who}: {idle}, waiting in torch.distributed at {shown(str(at))}; "
                f"waiting {wait} for the rank at fault"
            )
        text = f"{who} is hung: {idle}; stuck at {shown(str(at))}"
        if data.get("user_where") and data.get("where"):
            text += f" (innermost: {shown(str(data['where']))})"
        if data.get("stacks_file"):
            text += f"; stacks of every thread in {data['stacks_file']}"
        return text
    if kind is EventKind.JOB_FAILURE:
        try:
            root = FailureRecord.from_json(dict(data.get("root") or {})).summary()
        except ValueError:
            root = "(unreadable)"
        failed = int(data.get("failed_nodes", 0))
        text = f"root cause of the job's failure {data.get('incidents', '?')}: {root} "
        text += f"({_plural(failed, 'node')} failed"
        budget = data.get("job_max_restarts")
        text += f"; job-wide budget: {budget} restart(s))" if budget is not None else ")"
        if data.get("budget_spent"):
            text += "; the job spent its job-wide restarts: it stops"
        return text
    if kind is EventKind.QUARANTINED:
        return (
            f"host {shown(str(data.get('host', '?')))} is quarantined "
            f"({data.get('reason', '?')}): this node leaves the job, the others go on"
        )
    details = "; ".join(str(d) for d in data.get("details") or ())
    return (
        f"gave up on worker(s) that outlived SIGKILL by {float(data.get('bound', 0)):g} s: "
        f"{details}; leaving the job so that the others go on"
    )


def _idle(data: Mapping[str, Any]) -> str:
    """How long a stalled worker went without progress, and against which bound."""
    idle, steps = float(data.get("idle", 0)), int(data.get("steps", 0))
    bound, phase = float(data.get("bound", 0)), data.get("phase")
    if not steps:
        return f"no first step {idle:.1f} s after its start (start-up bound {bound:g} s)"
    text = f"no progress for {idle:.1f} s after {steps} step(s)"
    if phase == "learned":
        text += f" (bound {bound:.1f} s, learned from the step times)"
    return text


def _membership(data: Mapping[str, Any]) -> str:
    parts: list[str] = []
    lost = list(data.get("lost") or ())
    if lost:
        parts.append(f"{len(lost)} node(s) lost ({', '.join(str(n) for n in lost)})")
    if data.get("waiting"):
        parts.append(f"{data['waiting']} node(s) waiting to join")
    if data.get("removed"):
        parts.append("this node was removed")
    if data.get("closed"):
        parts.append("the job was closed")
    return ", ".join(parts) or "membership changed"
