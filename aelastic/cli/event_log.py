"""``aelastic run --event-log PATH``: the job's events as JSON lines, one per event.

How it works: :class:`EventLog` is a listener on the event model (:mod:`aelastic.core.events`):
every event of the agent, its rendezvous handler and its backend becomes one JSON object on
one line, with ``time`` (seconds since the epoch), ``kind``, ``run_id``, ``node``,
``round`` and the event's own fields (enums by value, mappings as objects, tuples as
lists). ``-`` writes to stderr (queued like the console's lines: a stderr that stops being
read never stalls the launcher, see :mod:`aelastic.agent.output.writer`); a path is opened for
appending (several runs of a job may
share a file) and every line is flushed as it is written, so ``tail -f`` and log shippers see
it at once. Events are redacted before any listener sees them, so no secret reaches the log.
A write that fails (disk full) is reported once on the console and the log stops; the job
goes on.
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Callable, Mapping
from typing import IO, Any

from ..agent.output import writer
from ..core.errors import reason
from ..core.events import Event, event_fields

__all__ = ["EventLog", "event_record"]


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [_plain(v) for v in value]
    return value


def event_record(event: Event) -> dict[str, Any]:
    """The JSON object of ``event``: the common keys first, then its own fields."""
    fields = event_fields(event)
    record: dict[str, Any] = {
        "time": round(fields.pop("at"), 6),
        "kind": event.kind.value,
        "run_id": fields.pop("run_id"),
        "node": fields.pop("node"),
        "round": fields.pop("round"),
    }
    record.update((name, _plain(value)) for name, value in fields.items())
    return record


class EventLog:
    """A listener writing each event as a JSON line.

    Args:
        target: A path, or ``-`` for stderr.
        on_error: Called once with a message if writing fails.

    Raises:
        OSError: The file cannot be opened.
    """

    def __init__(self, target: str, on_error: Callable[[str], None] | None = None) -> None:
        self._target = target
        self._on_error = on_error
        self._own = target != "-"
        self._out: IO[str] | None = (
            open(target, "a", encoding="utf-8", buffering=1) if self._own else sys.stderr  # noqa: SIM115
        )

    def __call__(self, event: Event) -> None:
        """Write ``event`` (the listener)."""
        out = self._out
        if out is None:
            return
        line = json.dumps(event_record(event), default=str) + "\n"
        if not self._own:
            writer.write(out, line)
            return
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError) as exc:
            self._out = None
            if self._on_error is not None:
                self._on_error(f"warning: the event log {self._target} stopped: {reason(exc)}")

    def close(self) -> None:
        """Close the file (stderr is left open)."""
        out, self._out = self._out, None
        if out is not None and self._own:
            out.close()
