"""The run's time rules: when a node beats next, when a silent node expires, how long a node
whose connection ended has to be heard from again, how many such departures a member may
confirm at once, and how long a closed run stays closed once empty.

How it works: pure functions of times in whole milliseconds (the backend's clock) and the
run's :class:`~.params.Rules`; :mod:`.machine` decides with them and re-exports them (import
them from there), and the handler, the command line and the backends use the same ones, so
that every side agrees on when a node is due, dead or gone.
"""

from __future__ import annotations

from .params import Rules

__all__ = [
    "beat_due_ms",
    "confirmable",
    "departure_grace_ms",
    "expiry_ms",
    "reuse_grace_ms",
]


def beat_due_ms(last_beat_ms: int, interval_ms: int) -> int:
    """When a node whose last recorded heartbeat is ``last_beat_ms`` beats next."""
    return last_beat_ms + interval_ms


def expiry_ms(last_beat_ms: int, window_ms: int) -> int:
    """When a node whose last heartbeat is ``last_beat_ms`` is dead (and pruned)."""
    return last_beat_ms + window_ms


def departure_grace_ms(rules: Rules) -> int:
    """How long a node whose connection ended has to be heard from again: half the
    heartbeat window, at most a second. A live node's client notices its connection end
    at the same moment and sends its beat again at once (a new connection's handshake);
    a second covers that on a loaded machine, and half the window keeps the report worth
    making when the window is short."""
    return min(rules.window_ms // 2, 1000)


def confirmable(departing: int, nodes: int) -> bool:
    """Whether ``departing`` nodes of a run of ``nodes`` whose connections ended may be
    confirmed lost once a member's collective broke: at most half of them (many connections
    ending at once is the network, or a store that restarted, not deaths: they keep the
    grace)."""
    return 2 * departing <= nodes


def reuse_grace_ms(rules: Rules) -> int:
    """How long a closed run stays closed once its last node left: then the next join makes
    it a new run (its id is reused). Two heartbeat windows: a node of the old job that went
    silent just before the end is dropped after one window, and still learns that the run
    closed if it comes back within another."""
    return 2 * rules.window_ms
