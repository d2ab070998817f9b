"""The flags of ``aelastic serve`` that keep the runs of a shared server apart.

How it works: :func:`add_quota_flags` adds them to the parser; :func:`quota_kwargs` checks
their values (a usage error names the flag) and returns the ones given, as keyword
arguments of :class:`aelastic.backends.http.server.Quotas` (the defaults live there). Byte
counts take a binary suffix: ``64M`` is 64 MiB.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from .options import UsageError

__all__ = ["add_quota_flags", "parse_bytes", "quota_kwargs"]

_BYTES = re.compile(r"^([0-9]+)([KMG]i?B?)?$", re.IGNORECASE)
_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30}
#: flag (without dashes), Quotas field, kind (``count``, ``bytes``, ``seconds``), help.
_FLAGS = (
    (
        "max-new-runs",
        "max_new_runs",
        "count",
        "runs one client address (not on loopback) or one scoped token may make per "
        "--new-runs-window; past it 429 with Retry-After (default 60; 0: no limit)",
    ),
    (
        "new-runs-window",
        "new_runs_window",
        "window",
        "seconds of the sliding window of --max-new-runs (default 60)",
    ),
    (
        "max-live-runs",
        "max_live_runs",
        "count",
        "runs one client address (not on loopback) or one scoped token made that the server "
        "may keep at once; past it 429 (default 256; 0: no limit)",
    ),
    (
        "max-value-bytes",
        "max_value",
        "bytes",
        "largest store value; past it 413 (default 1M; K, M, G suffixes; 0: no limit)",
    ),
    (
        "max-store-bytes",
        "max_run_store",
        "bytes",
        "bytes one run's store may hold (keys, values, 64 a key); past it 413 (default 64M; "
        "0: no limit)",
    ),
    (
        "max-client-store-bytes",
        "max_client_store",
        "bytes",
        "bytes the stores of the runs one client address (not on loopback) or one scoped "
        "token made may hold together; past it 413 (default 256M; 0: no limit)",
    ),
    (
        "max-total-store-bytes",
        "max_total_store",
        "bytes",
        "bytes all runs' stores may hold together; past it 413 (default 1G; 0: no limit)",
    ),
    (
        "empty-run-ttl",
        "empty_run_ttl",
        "seconds",
        "forget a run no live node is in that nobody changed or read for this long, its "
        "store with it (s; default 300; 0: never)",
    ),
)


def parse_bytes(text: str) -> int:
    """A byte count: digits, optionally with a binary suffix (``K``, ``M``, ``G``, also
    ``KiB``...).

    Raises:
        ValueError: It is not one.
    """
    match = _BYTES.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a byte count (e.g. 1048576, 512K, 64M, 1G)")
    suffix = (match.group(2) or "")[:1].lower()
    return int(match.group(1)) << _SHIFT[suffix]


def add_quota_flags(parser: argparse.ArgumentParser) -> None:
    """Add the quota flags to ``aelastic serve``'s parser."""
    for flag, dest, kind, text in _FLAGS:
        metavar = {"count": "N", "bytes": "BYTES"}.get(kind, "SECONDS")
        parser.add_argument(f"--{flag}", dest=dest, metavar=metavar, default=None, help=text)


def quota_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The quota flags given, checked, as keyword arguments of ``Quotas``.

    Raises:
        UsageError: A value is not a number of the flag's kind, or is out of range.
    """
    given: dict[str, Any] = {}
    for flag, dest, kind, _ in _FLAGS:
        text = getattr(args, dest)
        if text is None:
            continue
        try:
            if kind == "bytes":
                value: float = parse_bytes(text)
            elif kind == "count":
                if not re.fullmatch(r"-?[0-9]+", text.strip()):
                    raise ValueError("must be a whole number")
                value = int(text)
                if value < 0:
                    raise ValueError("must be >= 0 (0: no limit)")
            else:
                try:
                    value = float(text)
                except ValueError:
                    raise ValueError("must be a number of seconds") from None
                lowest_ok = value > 0 if kind == "window" else value >= 0
                if not (lowest_ok and value < math.inf):
                    raise ValueError(
                        "must be a positive number of seconds"
                        if kind == "window"
                        else "must be >= 0 seconds (0: never)"
                    )
        except ValueError as exc:
            raise UsageError(f"--{flag} {text}: {exc}") from None
        given[dest] = value
    return given
