"""``aelastic status``: what a job's rendezvous looks like now, for an operator (read-only).

How it works: the command opens the job's backend (redis or http) through the backend
registry, reads the run's whole membership once (a snapshot) and prints the round, whether
it is complete or closed, the participants with their ranks and heartbeat ages (by the
backend's clock), and the waiting and redundant nodes. It never changes the rendezvous.
``--watch`` prints again whenever the membership changed (woken by round transitions, and
looking every two seconds for joins to a forming round; heartbeats alone print nothing) and
exits when the run closes; ``--json`` prints machine-readable output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..backends.registry import create_backend
from ..core.errors import RendezvousError
from ..core.machine import expiry_ms
from ..core.params import RendezvousParameters, RendezvousSettings
from ..core.state import MemberEntry, Snapshot
from .options import BACKEND_ALIASES, UsageError, parse_rdzv_conf

__all__ = ["build_parser", "format_snapshot", "main", "snapshot_to_json"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser(prog: str = "aelastic status") -> argparse.ArgumentParser:
    """The parser of ``aelastic status``."""
    p = _Parser(prog=prog, description="Show the rendezvous state of a job (read-only).")
    p.add_argument("--rdzv-backend", "--rdzv_backend", required=True, help="redis or http")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="where it is")
    p.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the job's run id")
    p.add_argument(
        "--rdzv-conf", "--rdzv_conf", default="", help="keep_alive_interval=...,... (as run)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--watch", action="store_true", help="print again at every change, until the run closes"
    )
    return p


def _member(entry: MemberEntry, now_ms: int, window_ms: int) -> dict[str, Any]:
    age_ms = max(now_ms - entry.beat_ms, 0)
    return {
        "node": str(entry.node),
        "addr": entry.node.addr,
        "pid": entry.node.pid,
        "heartbeat_age": round(age_ms / 1000, 3),
        "alive": expiry_ms(entry.beat_ms, window_ms) >= now_ms,
    }


def snapshot_to_json(snapshot: Snapshot | None, settings: RendezvousSettings) -> dict[str, Any]:
    """The membership as a JSON-able dict (heartbeat ages in seconds, by the backend's clock).

    A participant's ``rank`` is ``null`` until the round completes.
    """
    if snapshot is None:
        return {"run_id": settings.run_id, "exists": False}
    status = snapshot.status
    now, window = status.now_ms, settings.rules.window_ms
    deadline = status.deadline_ms
    return {
        "run_id": settings.run_id,
        "exists": True,
        "round": status.round,
        "complete": status.complete,
        "closed": status.closed,
        "deadline_in": None if deadline is None else round((deadline - now) / 1000, 3),
        "participants": [
            {**_member(e, now, window), "rank": e.rank} for e in snapshot.participants
        ],
        "waiting": [_member(e, now, window) for e in snapshot.wait_list],
        "redundant": [_member(e, now, window) for e in snapshot.redundancy_list],
        "lost": status.lost,
        "finished": status.finished,
    }


def format_snapshot(snapshot: Snapshot | None, settings: RendezvousSettings) -> str:
    """A human-readable report of ``snapshot``."""
    if snapshot is None:
        return f"job '{settings.run_id}': no rendezvous state (no node has joined yet)"
    status = snapshot.status
    now, window = status.now_ms, settings.rules.window_ms
    state = "closed" if status.closed else ("complete" if status.complete else "forming")
    lines = [f"job '{settings.run_id}': round {status.round}, {state}"]
    if status.deadline_ms is not None and not status.complete:
        lines[0] += f", closes for joining in {(status.deadline_ms - now) / 1000:.1f} s"
    if status.lost or status.finished:
        lines[0] += f"; since completion {status.lost} lost, {status.finished} finished"

    def mark(entry: MemberEntry) -> str:
        age = max(now - entry.beat_ms, 0) / 1000
        dead = expiry_ms(entry.beat_ms, window) < now
        return f"{age:.1f} s ago" + (
            f" (silent > {window / 1000:g} s: presumed dead)" if dead else ""
        )

    lines.append(f"participants ({len(snapshot.participants)}):")
    for e in snapshot.participants:
        rank = "-" if e.rank is None else str(e.rank)
        lines.append(f"  rank {rank:>3}  {e.node}  heartbeat {mark(e)}")
    for title, entries in (
        ("waiting", snapshot.wait_list),
        ("redundant", snapshot.redundancy_list),
    ):
        lines.append(f"{title} ({len(entries)}):")
        lines.extend(f"  {e.node}  heartbeat {mark(e)}" for e in entries)
    return "\n".join(lines)


def _membership(snapshot: Snapshot | None) -> object:
    """What ``--watch`` compares: everything but heartbeat times and the clock."""
    if snapshot is None:
        return None
    status = snapshot.status
    return (
        status.signature(),
        status.lost,
        status.finished,
        tuple((e.node, e.rank) for e in snapshot.participants),
        frozenset(e.node for e in snapshot.wait_list),
        frozenset(e.node for e in snapshot.redundancy_list),
    )


#: How often ``--watch`` looks at the membership besides being woken by round transitions
#: (joins to a forming round notify nobody).
_WATCH_PERIOD = 2.0


async def _show(args: argparse.Namespace) -> int:
    backend_name = BACKEND_ALIASES.get(args.rdzv_backend, args.rdzv_backend)
    if backend_name == "memory":
        raise UsageError(
            "the memory backend lives inside one launcher process: status needs redis or http"
        )
    config = parse_rdzv_conf(args.rdzv_conf)
    try:
        params = RendezvousParameters(
            backend_name, args.rdzv_endpoint, args.rdzv_id, 1, 1, **config
        )
        settings = RendezvousSettings.from_parameters(params)
        backend = create_backend(params)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    shown: object = ()
    try:
        while True:
            snapshot = await backend.snapshot()
            if _membership(snapshot) != shown:
                shown = _membership(snapshot)
                if args.json:
                    print(json.dumps(snapshot_to_json(snapshot, settings)), flush=True)
                else:
                    if args.watch and shown != () and snapshot is not None:
                        print(flush=True)
                    print(format_snapshot(snapshot, settings), flush=True)
            if not args.watch or (snapshot is not None and snapshot.status.closed):
                return 0
            token = "" if snapshot is None else snapshot.status.token
            await backend.wait_for_change(token, _WATCH_PERIOD)
    finally:
        await backend.aclose()


def main(argv: Sequence[str]) -> int:
    """Run ``aelastic status``; the exit code (1 when the backend cannot be read).

    Raises:
        UsageError: Bad flags (exit code 2).
    """
    args = build_parser().parse_args(list(argv))
    try:
        return asyncio.run(_show(args))
    except RendezvousError as exc:
        print(f"aelastic status: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except ImportError as exc:
        print(f"aelastic status: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
