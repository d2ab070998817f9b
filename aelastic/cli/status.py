"""``aelastic status``: what a job's rendezvous looks like now, for an operator.

How it works: the command opens the job's backend (redis, http, etcd...) through the backend
registry, reads the run's whole membership once (a snapshot) and prints the round, whether
it is complete or closed, the participants with their ranks and heartbeat ages (by the
backend's clock), and the waiting and redundant nodes. It never changes the rendezvous,
except with ``--reset``: that shows the run, asks for a confirmation line (``--yes`` skips
it) and deletes the run's rendezvous state and store (the backend's ``reset()``), so that a
finished job's id can be used again; and ``--close``: that closes the run as its operator
(the backend's ``close_run()``; nodes still joining fail with ``RendezvousClosedError``).
Heartbeat ages are judged by the run's own heartbeat window (the one it was created with).
``--watch`` prints again whenever the membership changed (woken by round transitions, and
looking every two seconds for joins to a forming round; heartbeats alone print nothing) and
exits when the run closes; ``--json`` prints machine-readable output (a rank is ``null``
until the round completes). ``--list`` names the runs on the backend instead, one line each
(:mod:`.status_list`). Nothing printed shows a password or token. When the job's workers
failed, the job's health follows (:mod:`aelastic.core.health`, the same on every node): the
root cause of its newest failure with the message, how many nodes failed, quarantined and
lost hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..backends.registry import create_backend
from ..core._signals import sigint_interrupts
from ..core.errors import RendezvousError, RendezvousStateError
from ..core.health import JobHealth, shown
from ..core.machine import expiry_ms
from ..core.params import RendezvousParameters, RendezvousSettings
from ..core.protocol import RendezvousBackend
from ..core.redact import known_secrets, redact, redact_endpoint
from ..core.state import MemberEntry, Snapshot
from ..core.wire import rules_to_json
from .options import UsageError, parse_rdzv_conf
from .reading import add_backend_flags, backend_of
from .rules import UsageParser
from .status_list import show_runs

__all__ = ["build_parser", "format_health", "format_snapshot", "main", "snapshot_to_json"]


def build_parser(prog: str = "aelastic status") -> argparse.ArgumentParser:
    """The parser of ``aelastic status``."""
    p = UsageParser(prog=prog, description="Show the rendezvous state of a job (read-only).")
    # Like ``aelastic run``: a flag not given is read from PET_<NAME> (a job's own variables).
    add_backend_flags(p, run_id=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--list", action="store_true", help="list the runs on the backend, one line each"
    )
    p.add_argument("--limit", type=int, default=1000, help="runs --list shows at most")
    p.add_argument(
        "--watch", action="store_true", help="print again at every change, until the run closes"
    )
    p.add_argument(
        "--reset",
        action="store_true",
        help="delete the job's rendezvous state and store (asks first), so its id can be reused",
    )
    p.add_argument(
        "--close",
        action="store_true",
        help="close the job's rendezvous (asks first): its nodes stop, later joins fail",
    )
    p.add_argument("-y", "--yes", action="store_true", help="--reset or --close without asking")
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


def _window_ms(snapshot: Snapshot, settings: RendezvousSettings) -> int:
    """The run's heartbeat window (this command's settings only if the backend did not say)."""
    rules = snapshot.rules or settings.rules
    return rules.window_ms


def snapshot_to_json(snapshot: Snapshot | None, settings: RendezvousSettings) -> dict[str, Any]:
    """The membership as a JSON-able dict (heartbeat ages in seconds, by the backend's clock;
    ``alive`` by the run's own heartbeat window).

    A participant's ``rank`` is ``null`` until the round completes.
    """
    if snapshot is None:
        return {"run_id": settings.run_id, "exists": False}
    status = snapshot.status
    now, window = status.now_ms, _window_ms(snapshot, settings)
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
        "rules": None if snapshot.rules is None else rules_to_json(snapshot.rules),
    }


def format_snapshot(snapshot: Snapshot | None, settings: RendezvousSettings) -> str:
    """A human-readable report of ``snapshot``."""
    if snapshot is None:
        return f"job '{settings.run_id}': no rendezvous state (no node has joined yet)"
    status = snapshot.status
    now, window = status.now_ms, _window_ms(snapshot, settings)
    state = "closed" if status.closed else ("complete" if status.complete else "forming")
    lines = [f"job '{settings.run_id}': round {status.round}, {state}"]
    if snapshot.rules is not None:
        r = snapshot.rules
        lines[0] += (
            f" (nodes {r.min_nodes}:{r.max_nodes}, heartbeat window {r.window_ms / 1000:g} s)"
        )
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


async def read_health(backend: RendezvousBackend) -> tuple[JobHealth | None, int]:
    """The job's health as the rendezvous keeps it and how many nodes failed in its newest
    failure's round (``(None, 0)``: no such run).

    Raises:
        RendezvousStateError: The backend's answer is not one this version understands.
    """
    health = await backend.health()
    if health is None or health.latest is None:
        return health, 0
    return health, health.latest.failed


def health_to_json(health: JobHealth | None, failed_nodes: int) -> dict[str, Any] | None:
    """The health as ``--json`` prints it (``None``: nothing failed)."""
    if health is None:
        return None
    return {**health.to_json(), "failed_nodes": failed_nodes}


def format_health(health: JobHealth | None, failed_nodes: int) -> str:
    """A human-readable report of the job's health ("" when nothing failed)."""
    if health is None:
        return ""
    lines = []
    latest = health.latest
    if latest is not None:
        root = latest.root
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(root.time))
        lines.append(
            f"failures: {health.incidents_total}; root cause of the newest (round "
            f"{latest.round}, {when}, {failed_nodes} node(s) failed):"
        )
        lines.append(f"  {root.summary()}")
        body = [line for line in shown(root.message).splitlines() if line.strip()]
        if len(body) > 1:
            lines.extend(f"    {line}" for line in body)
        if latest.streak > 1:
            lines.append(
                f"  host {shown(root.host)} was the root cause {latest.streak} times in a row"
            )
    if health.quarantined:
        lines.append(f"quarantined ({len(health.quarantined)}):")
        lines.extend(f"  {shown(h)}: {shown(r)}" for h, r in sorted(health.quarantined.items()))
    if health.lost:
        lost = ", ".join(f"{shown(h)} ({c.count}x)" for h, c in sorted(health.lost.items()))
        lines.append(f"lost hosts: {lost}")
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


#: The run id a backend opened only to list runs is made with (never read).
_LISTING = "aelastic-status-list"

#: How often ``--watch`` looks at the membership besides being woken by round transitions
#: (joins to a forming round notify nobody).
_WATCH_PERIOD = 2.0


def _say(text: str, secrets: frozenset[str], *, end: str = "\n", err: bool = False) -> None:
    """Print ``text`` redacted (no password, token or known secret)."""
    print(redact(text, secrets), end=end, file=sys.stderr if err else sys.stdout, flush=True)


#: Said when the confirmation got no answer at all (no terminal, an empty input).
_NO_ANSWER = (
    ": no answer came (standard input is not a terminal, or it ended); add --yes (-y) to "
    "do it without asking"
)


def _confirm(prompt: str) -> bool | None:
    """Ask ``prompt``; whether the line read says yes (``None``: no line came at all)."""
    print(prompt, end="", flush=True)
    answer = sys.stdin.readline() if sys.stdin is not None else ""
    if not answer.endswith("\n"):
        print(flush=True)
    if not answer:
        return None
    return answer.strip().lower() in ("y", "yes")


def _summary(snapshot: Snapshot | None, settings: RendezvousSettings) -> str:
    """One line: what ``--reset`` would delete, and whether nodes still use it."""
    if snapshot is None:
        return "no rendezvous state (the store may still hold keys)"
    status = snapshot.status
    state = "closed" if status.closed else ("complete" if status.complete else "forming")
    members = snapshot.members()
    window = _window_ms(snapshot, settings)
    live = sum(1 for e in members if expiry_ms(e.beat_ms, window) >= status.now_ms)
    text = f"round {status.round}, {state}, {len(members)} node(s)"
    if live and not status.closed:
        text += f"; {live} still alive: stop them first, they would lose their rendezvous"
    return text


async def _reset(
    args: argparse.Namespace,
    backend: RendezvousBackend,
    settings: RendezvousSettings,
    secrets: frozenset[str],
) -> int:
    where = f"job '{settings.run_id}' at {redact_endpoint(args.rdzv_endpoint)}"
    try:
        summary = _summary(await backend.snapshot(), settings)
    except RendezvousStateError as exc:
        summary = f"unreadable state ({exc})"
    _say(f"{where}: {summary}", secrets)
    if not args.yes:
        answer = _confirm("delete its rendezvous state and store? [y/N] ")
        if not answer:
            _say("nothing deleted" + ("" if answer is False else _NO_ANSWER), secrets)
            return 1
    if await backend.reset():
        _say(f"deleted the rendezvous state and store of {where}: the id is free", secrets)
    else:
        _say(f"{where} had nothing to delete: the id is free", secrets)
    return 0


async def _close(
    args: argparse.Namespace,
    backend: RendezvousBackend,
    settings: RendezvousSettings,
    secrets: frozenset[str],
) -> int:
    where = f"job '{settings.run_id}' at {redact_endpoint(args.rdzv_endpoint)}"
    snapshot = await backend.snapshot()
    if snapshot is None:
        _say(f"{where}: no rendezvous state: nothing to close", secrets)
        return 1
    if snapshot.status.closed:
        _say(f"{where} is closed already", secrets)
        return 0
    _say(f"{where}: {_summary(snapshot, settings)}", secrets)
    if not args.yes:
        answer = _confirm("close it (its nodes stop, later joins fail)? [y/N] ")
        if not answer:
            _say("nothing closed" + ("" if answer is False else _NO_ANSWER), secrets)
            return 1
    if await backend.close_run():
        _say(f"closed {where}", secrets)
    else:
        _say(f"{where} was closed already (or is gone)", secrets)
    return 0


async def _show(args: argparse.Namespace, secrets: frozenset[str]) -> int:
    backend_name, config = backend_of(args, "status", lambda line: _say(line, secrets, err=True))
    acting = "--reset" if args.reset else ("--close" if args.close else None)
    if args.reset and args.close:
        raise UsageError("--reset and --close cannot be combined")
    if acting and (args.watch or args.json):
        raise UsageError(f"{acting} cannot be combined with --watch or --json")
    if args.list and (args.watch or acting):
        raise UsageError("--list cannot be combined with --watch, --reset or --close")
    if args.list and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, not {args.limit}")
    if not args.list and not args.rdzv_id:
        raise UsageError("--rdzv-id is required (or PET_RDZV_ID), unless --list")
    try:
        params = RendezvousParameters(
            backend_name, args.rdzv_endpoint, args.rdzv_id or _LISTING, 1, 1, **config
        )
        settings = RendezvousSettings.from_parameters(params)
        backend = create_backend(params)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if args.list:
        try:
            return await show_runs(backend, args.limit, args.json, lambda line: _say(line, secrets))
        finally:
            await backend.aclose()
    last: object = ()
    try:
        if args.reset:
            return await _reset(args, backend, settings, secrets)
        if args.close:
            return await _close(args, backend, settings, secrets)
        while True:
            snapshot = await backend.snapshot()
            health, failed = await read_health(backend)
            seen = (_membership(snapshot), health, failed)
            if seen != last:
                first = last == ()
                last = seen
                if args.json:
                    doc = snapshot_to_json(snapshot, settings)
                    doc["health"] = health_to_json(health, failed)
                    _say(json.dumps(doc), secrets)
                else:
                    if not first:
                        print(flush=True)
                    report = format_snapshot(snapshot, settings)
                    extra = format_health(health, failed)
                    _say(f"{report}\n{extra}" if extra else report, secrets)
            if not args.watch or (snapshot is not None and snapshot.status.closed):
                return 0
            token = "" if snapshot is None else snapshot.status.token
            await backend.wait_for_change(token, _WATCH_PERIOD)
    finally:
        await backend.aclose()


def main(argv: Sequence[str]) -> int:
    """Run ``aelastic status``; the exit code (1 when the backend cannot be read, or when
    ``--reset`` or ``--close`` was not confirmed or found nothing).

    Raises:
        UsageError: Bad flags (exit code 2).
    """
    args = build_parser().parse_args(list(argv))
    config = parse_rdzv_conf(args.rdzv_conf)
    secrets = known_secrets(args.rdzv_endpoint or "", config, os.environ)
    try:
        with sigint_interrupts():  # --watch ends on SIGINT, even if inherited ignored
            return asyncio.run(_show(args, secrets))
    except (RendezvousError, ImportError) as exc:
        _say(f"aelastic status: error: {exc}", secrets, err=True)
        return 1
    except KeyboardInterrupt:
        return 130
