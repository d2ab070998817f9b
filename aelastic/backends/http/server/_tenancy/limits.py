"""The limits that keep the runs of a shared server apart, and how a refusal is told.

How it works: :class:`Quotas` gathers the numbers (``aelastic serve`` flags) that
:mod:`.creations` (runs a client or a scoped token may make) and :mod:`.sizes` (bytes a
run's members' store may hold) enforce, and the time after which an abandoned run is
forgotten (the server's sweep, :meth:`~.._runs.RunStore.expire`). A request past a limit
raises :class:`Refused` before it changes anything; the server answers with its status and
message (``{"error": ...}``, ``Retry-After`` when waiting helps), over HTTP and on the
rendezvous channel alike. Every message names the limit and the flag that sets it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_EMPTY_RUN_TTL",
    "DEFAULT_MAX_CLIENT_STORE",
    "DEFAULT_MAX_LIVE_RUNS",
    "DEFAULT_MAX_NEW_RUNS",
    "DEFAULT_MAX_RUN_STORE",
    "DEFAULT_MAX_TOTAL_STORE",
    "DEFAULT_MAX_VALUE",
    "DEFAULT_NEW_RUNS_WINDOW",
    "Quotas",
    "Refused",
]

#: Runs one client (or one scoped token) may make per window.
DEFAULT_MAX_NEW_RUNS = 60
#: Seconds of that sliding window.
DEFAULT_NEW_RUNS_WINDOW = 60.0
#: Runs one client (or one scoped token) made that may exist at once.
DEFAULT_MAX_LIVE_RUNS = 256
#: Bytes of one store value at most.
DEFAULT_MAX_VALUE = 1 << 20
#: Bytes one run's members' store may hold (keys, values and 64 bytes a key).
DEFAULT_MAX_RUN_STORE = 64 << 20
#: Bytes the stores of the runs one client (or one scoped token) made may hold together.
DEFAULT_MAX_CLIENT_STORE = 256 << 20
#: Bytes every run's store together may hold.
DEFAULT_MAX_TOTAL_STORE = 1 << 30
#: Seconds after which a run no live node is in, that nobody changed, is forgotten.
DEFAULT_EMPTY_RUN_TTL = 300.0


class Refused(Exception):
    """A request past a limit, refused before it changed anything.

    Args:
        status: The HTTP status to answer (403, 413, 429).
        message: What was refused, the limit and the flag that sets it.
        retry_after: Seconds after which the same request may pass (``None``: waiting does
            not help).
    """

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """The answer's extra headers (``Retry-After``, whole seconds, when waiting helps)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(math.ceil(self.retry_after), 1))}


@dataclass(frozen=True)
class Quotas:
    """The limits of one server (``0`` turns a limit off).

    Attributes:
        max_new_runs: Runs one client address (not on loopback) or one scoped token may
            make within ``new_runs_window`` seconds (``--max-new-runs``; ``429`` with
            ``Retry-After`` past it).
        new_runs_window: Seconds of that sliding window (``--new-runs-window``).
        max_live_runs: Runs one client or one scoped token made that may exist at once
            (``--max-live-runs``; ``429`` past it).
        max_value: Bytes of one store value at most (``--max-value-bytes``; ``413``).
        max_run_store: Bytes one run's store may hold (``--max-store-bytes``; ``413``).
        max_client_store: Bytes the stores of the runs one client address (not on
            loopback) or one scoped token made may hold together
            (``--max-client-store-bytes``; ``413``).
        max_total_store: Bytes every run's store together may hold
            (``--max-total-store-bytes``; ``413``).
        empty_run_ttl: Seconds after which a run that no live node is in and that nobody
            changed or read is forgotten, its store with it (``--empty-run-ttl``).

    Raises:
        ValueError: A limit is negative, or a time is not a positive finite number (the
            window) or a non-negative one (the TTL).
    """

    max_new_runs: int = DEFAULT_MAX_NEW_RUNS
    new_runs_window: float = DEFAULT_NEW_RUNS_WINDOW
    max_live_runs: int = DEFAULT_MAX_LIVE_RUNS
    max_value: int = DEFAULT_MAX_VALUE
    max_run_store: int = DEFAULT_MAX_RUN_STORE
    max_client_store: int = DEFAULT_MAX_CLIENT_STORE
    max_total_store: int = DEFAULT_MAX_TOTAL_STORE
    empty_run_ttl: float = DEFAULT_EMPTY_RUN_TTL

    def __post_init__(self) -> None:
        limits = ("max_new_runs", "max_live_runs", "max_value", "max_run_store")
        for name in (*limits, "max_client_store", "max_total_store"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0 (0: no limit)")
        if not 0 < self.new_runs_window < math.inf:
            raise ValueError(
                f"new_runs_window ({self.new_runs_window}) must be a positive number of seconds"
            )
        if not 0 <= self.empty_run_ttl < math.inf:
            raise ValueError(
                f"empty_run_ttl ({self.empty_run_ttl}) must be a non-negative number of "
                "seconds (0: never)"
            )
