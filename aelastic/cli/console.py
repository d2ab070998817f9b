"""The launcher's console: one readable line per thing the agent does, with timings.

How it works: :class:`Console` is an agent event listener (``agent.add_listener``). Each
:class:`~aelastic.agent.AgentEvent` becomes at most one line on stderr, prefixed with
``[aelastic +<seconds since launch>]``, saying what happened in words a newcomer understands
(rendezvous, starting workers, a worker exited, restarting, rescaling, done) and how long it
took. Every line is redacted (:func:`aelastic.core.redact.redact`): no endpoint password,
``password=``/``token=`` value or known secret is ever printed. A hung worker (where it is
stuck), the job's first failure (from the rendezvous store: the same on every node), a
quarantined host and workers that outlived SIGKILL get a line each; the job's first failure
is said again at the end of a failed run. Lines are queued, never
written on the event loop (:mod:`aelastic.agent._output`): a console that stops reading
costs dropped lines and a note, never a heartbeat. Workers' own output is not touched: it
goes to stdout/stderr as the agent streams it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from ..agent import _output
from ..agent.api import ProcessFailure, RunResult
from ..agent.errors import SHOWN_WIDTH, bounded, error_details, printable
from ..agent.events import EventKind
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
            self._console.line(level + text, always=True)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


class Console:
    """Prints the agent's progress.

    Args:
        stream: Where to write (stderr by default).
        enabled: ``False`` prints only errors and the final summary.
        started: Monotonic time of the launch (``+seconds`` are counted from it).
        secrets: Values never to print (passwords, tokens), masked wherever they appear.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        enabled: bool = True,
        started: float | None = None,
        secrets: Iterable[str] = (),
    ) -> None:
        self._stream = stream
        self._enabled = enabled
        self._started = time.monotonic() if started is None else started
        self._secrets = frozenset(secrets)
        self._job_failure: str | None = None

    def line(self, text: str, *, always: bool = False) -> None:
        """Print ``text`` as one launcher line."""
        if not (self._enabled or always):
            return
        stream = self._stream or sys.stderr
        elapsed = time.monotonic() - self._started
        _output.write(stream, f"[aelastic +{elapsed:.2f}s] {redact(text, self._secrets)}\n")

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
            if text != self._job_failure:  # read again, unchanged: said already
                self.line(text, always=True)
            self._job_failure = text
        elif event.kind in _ALWAYS and text:
            self.line(text, always=True)
        elif text:
            self.line(text)

    def job_failure(self) -> None:
        """Say the job's first failure again (at the end), if one was read."""
        if self._job_failure is not None:
            self.line(self._job_failure, always=True)

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

    def result(self, result: RunResult, name: str) -> None:
        """The final line(s): success, or the root cause of the failure."""
        if not result.is_failed():
            self.line(f"{name}: all workers of this node succeeded")
            return
        root = result.root_cause
        if root is None:
            self.line(f"{name} FAILED (no worker failure recorded)", always=True)
            return
        self.line(f"{name} FAILED; root cause: {summarize_failure(root)}", always=True)
        if os.path.isfile(root.error_file):
            self.line(f"error file of rank {root.global_rank}: {root.error_file}", always=True)
        elif root.error_file_data:  # the file went with the temporary logs: show what it said
            details = textwrap.indent(bounded(error_details(root), root.error_file), "  ")
            self.line(
                f"error file of rank {root.global_rank} (not kept; --log-dir keeps it):\n{details}",
                always=True,
            )
        others = sorted(
            (f for f in result.failures.values() if f is not root), key=lambda f: f.global_rank
        )
        if others:
            also = ", ".join(f"rank {f.global_rank} ({describe_exit(f.exitcode)})" for f in others)
            self.line(f"also failed: {also}", always=True)
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
        idle = f"no progress for {float(data.get('idle', 0)):.1f} s"
        idle += f" after {data.get('steps', 0)} step(s)"
        at = data.get("user_where") or data.get("where") or "an unknown line (no stacks)"
        if data.get("stopped") and not data.get("where"):
            at = "an unknown line (no stacks: the process is stopped, by SIGSTOP or a debugger)"
        if data.get("waiting_for_peer"):
            return (
                f"{who}: {idle}, waiting in torch.distributed at {shown(str(at))}; "
                "waiting one more stall timeout (6 s at least) for the rank at fault"
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
