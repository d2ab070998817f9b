"""Progress lines while ``aelastic run`` waits: for nodes, for the last call, for the store.

How it works: :class:`Progress` is a listener on the event model. The handler publishes a
:class:`~aelastic.core.events.RendezvousWaiting` each time it asks to join and must wait (at
least once a keep-alive interval), and the backend a
:class:`~aelastic.core.events.BackendRetry` each time a call fails and is tried again. Each
kind of wait prints one line at once, then at most one every ``interval`` seconds (10)::

    waiting for nodes: 1 joined of min 2 (max 4); join timeout in 9m35s
    last call: 3 nodes, completes in 12 s
    redis at host:6379 unreachable (connection refused); retrying for 55 s more

A completed round (or a call that succeeds) ends the wait, so the next wait prints at once
again. Lines go through the console, which redacts them. An endpoint that nobody gave (the
launcher took a default) is named in the first line (:func:`default_endpoint_note`)::

    redis at localhost:6379 unreachable (connection refused); retrying for 55 s more; the
    endpoint localhost:6379 is taken by default: no --rdzv-endpoint or PET_RDZV_ENDPOINT was given

The torchrun plugin logs the same lines (:mod:`aelastic.integrations.torchrun`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from ..core.events import BackendRetry, Event, EventKind, RendezvousEvent, RendezvousWaiting

__all__ = ["Progress", "default_endpoint_note", "describe_wait", "duration"]

#: Seconds between two lines about the same wait.
INTERVAL = 10.0

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_REASONS = (
    ("refused", "connection refused"),
    ("connect call failed", "connection refused"),
    ("reset by peer", "connection reset"),
    ("timed out", "timed out"),
    ("timeout", "timed out"),
    ("name or service not known", "name not resolved"),
    ("name resolution", "name not resolved"),
    ("nodename nor servname", "name not resolved"),
    ("no route to host", "no route to host"),
    ("loading the dataset", "the server is loading its data"),
)


def duration(seconds: float) -> str:
    """``12 s`` (under 100 s), ``9m35s``, or ``1h02m``."""
    whole = max(round(seconds), 0)
    if whole >= 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    if whole >= 100:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole} s"


def _where(endpoint: str) -> str:
    """``host:port`` of an endpoint URL (no scheme, no path)."""
    return _SCHEME.sub("", endpoint).split("/", 1)[0] or endpoint


def _reason(error: str) -> str:
    lowered = error.lower()
    for needle, reason in _REASONS:
        if needle in lowered:
            return reason
    return error if len(error) <= 80 else error[:77] + "..."


def default_endpoint_note(endpoint: str, not_given: list[str] | tuple[str, ...]) -> str:
    """What the first progress line and a connection error add when the endpoint was taken by
    default: ``the endpoint localhost:6379 is taken by default: no --rdzv-endpoint or
    PET_RDZV_ENDPOINT was given``; ``not_given`` names the flags (or variables) that set it."""
    names = list(not_given)
    said = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
    return f"the endpoint {endpoint} is taken by default: no {said} was given"


def describe_wait(event: RendezvousWaiting | BackendRetry) -> str:
    """The progress line for a wait."""
    if isinstance(event, BackendRetry):
        return (
            f"{event.backend} at {_where(event.endpoint)} unreachable ({_reason(event.error)}); "
            f"retrying for {duration(event.retry_for)} more"
        )
    if event.id_wait is not None:
        free = duration(event.id_free_in or 0.0)
        return (
            f"waiting for the job id: a job that used it has ended (its run is "
            f"{event.id_wait}); the id is free again in {free} (two heartbeat windows after "
            f"its last node left); join timeout in {duration(event.join_timeout_in)}"
        )
    if event.last_call_in is not None:
        return f"last call: {event.participants} nodes, completes in {duration(event.last_call_in)}"
    timeout = f"join timeout in {duration(event.join_timeout_in)}"
    if event.waiting:
        return (
            f"waiting for the next round: round {event.round} is running; "
            f"{event.participants} node(s) waiting to join; {timeout}"
        )
    return (
        f"waiting for nodes: {event.participants} joined of min {event.min_nodes} "
        f"(max {event.max_nodes}); {timeout}"
    )


class Progress:
    """The listener printing progress lines.

    Args:
        line: Prints one line (the console's).
        interval: Least seconds between two lines about the same wait.
        note: Said at the end of the first line (:func:`default_endpoint_note`).
    """

    def __init__(
        self, line: Callable[[str], None], interval: float = INTERVAL, note: str | None = None
    ) -> None:
        self._line = line
        self._interval = interval
        self._last: dict[EventKind, float] = {}
        self._note = note

    def __call__(self, event: Event) -> None:
        """Print a line for ``event`` if it is a wait and none was printed lately."""
        if isinstance(event, RendezvousEvent) and event.transition:
            self._last.pop(EventKind.BACKEND_RETRY, None)  # the backend answered again
        if not isinstance(event, RendezvousWaiting | BackendRetry):
            if event.kind is EventKind.RENDEZVOUS:
                self._last.clear()
            return
        now = time.monotonic()
        last = self._last.get(event.kind)
        if last is not None and now - last < self._interval:
            return
        self._last[event.kind] = now
        text = describe_wait(event)
        if self._note:
            text, self._note = f"{text}; {self._note}", None
        self._line(text)
