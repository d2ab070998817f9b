"""``aelastic status``: what a job's rendezvous looks like now, for an operator (read-only).

How it works: the command opens the job's backend (redis or http) through the backend
registry, reads the state cell once, decodes it with the state codec and prints the round,
whether it is complete or closed, the participants with their ranks and heartbeat ages, and
the waiting and redundant nodes. It never writes, except with ``--reset``: that shows the
state, asks for a confirmation line (``--yes`` skips it) and deletes the run's rendezvous
state and store through the backend's ``reset()``, so that a finished job's id can be used
again. ``--watch`` prints again at every change (the backend wakes it; there is no poll),
``--json`` prints machine-readable output (a rank is ``null`` until the round is complete).
Nothing printed shows a password or token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from .._redact import known_secrets, redact, redact_endpoint
from ..backends.base import RendezvousBackend
from ..backends.registry import create_backend
from ..rendezvous.api import (
    RendezvousError,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStateError,
)
from ..rendezvous.state import NodeDesc, RendezvousState, decode_state
from .conf_keys import unknown_key_warnings
from .options import BACKEND_ALIASES, UsageError, parse_rdzv_conf

__all__ = ["build_parser", "format_state", "main", "state_to_json"]


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
    p.add_argument("--watch", action="store_true", help="print again at every change")
    p.add_argument(
        "--reset",
        action="store_true",
        help="delete the job's rendezvous state and store (asks first), so its id can be reused",
    )
    p.add_argument("-y", "--yes", action="store_true", help="--reset without asking")
    return p


def _age(now: float, at: float | None) -> str:
    if at is None:
        return "never"
    return f"{max(now - at, 0.0):.1f} s ago"


def _sorted_nodes(nodes: Sequence[NodeDesc] | frozenset[NodeDesc]) -> list[NodeDesc]:
    return sorted(nodes)


def state_to_json(
    state: RendezvousState | None, settings: RendezvousSettings, now: float
) -> dict[str, Any]:
    """The state as a JSON-able dict (heartbeat ages in seconds)."""
    if state is None:
        return {"run_id": settings.run_id, "exists": False}
    beats = state.last_heartbeats
    window = settings.heartbeat_window

    def node(n: NodeDesc) -> dict[str, Any]:
        at = beats.get(n)
        age = None if at is None else round(max(now - at, 0.0), 3)
        return {
            "node": str(n),
            "addr": n.addr,
            "pid": n.pid,
            "heartbeat_age": age,
            "alive": age is not None and age <= window,
        }

    return {
        "run_id": settings.run_id,
        "exists": True,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline_in": None if state.deadline is None else round(state.deadline - now, 3),
        "participants": [
            {**node(n), "rank": r if state.complete else None}
            for n, r in sorted(state.participants.items(), key=lambda item: (item[1], item[0]))
        ],
        "waiting": [node(n) for n in _sorted_nodes(state.wait_list)],
        "redundant": [node(n) for n in _sorted_nodes(state.redundancy_list)],
    }


def format_state(state: RendezvousState | None, settings: RendezvousSettings, now: float) -> str:
    """A human-readable report of ``state``."""
    if state is None:
        return f"job '{settings.run_id}': no rendezvous state (no node has joined yet)"
    status = "closed" if state.closed else ("complete" if state.complete else "forming")
    lines = [f"job '{settings.run_id}': round {state.round}, {status}"]
    if state.deadline is not None and not state.complete:
        lines[0] += f", closes for joining in {state.deadline - now:.1f} s"
    window = settings.heartbeat_window
    beats = state.last_heartbeats

    def mark(n: NodeDesc) -> str:
        at = beats.get(n)
        dead = at is None or now - at > window
        return _age(now, at) + (f" (silent > {window:g} s: presumed dead)" if dead else "")

    lines.append(f"participants ({len(state.participants)}):")
    for n, r in sorted(state.participants.items(), key=lambda item: (item[1], item[0])):
        rank = str(r) if state.complete else "-"
        lines.append(f"  rank {rank:>3}  {n}  heartbeat {mark(n)}")
    for title, nodes in (("waiting", state.wait_list), ("redundant", state.redundancy_list)):
        lines.append(f"{title} ({len(nodes)}):")
        lines.extend(f"  {n}  heartbeat {mark(n)}" for n in _sorted_nodes(nodes))
    return "\n".join(lines)


def _summary(state: RendezvousState | None, settings: RendezvousSettings, now: float) -> str:
    """One line: what ``--reset`` would delete, and whether nodes still use it."""
    if state is None:
        return "no rendezvous state (the store may still hold keys)"
    status = "closed" if state.closed else ("complete" if state.complete else "forming")
    nodes = {*state.participants, *state.wait_list, *state.redundancy_list}
    live = sum(
        1
        for n in nodes
        if (at := state.last_heartbeats.get(n)) is not None
        and now - at <= settings.heartbeat_window
    )
    text = f"round {state.round}, {status}, {len(nodes)} node(s)"
    if live and not state.closed:
        text += f"; {live} still alive: stop them first, they would lose their rendezvous"
    return text


def _say(text: str, secrets: frozenset[str], *, end: str = "\n", err: bool = False) -> None:
    """Print ``text`` redacted (no password, token or known secret)."""
    print(redact(text, secrets), end=end, file=sys.stderr if err else sys.stdout, flush=True)


def _confirm(prompt: str) -> bool:
    """Ask ``prompt``; whether the line read says yes (end of input: no). The event loop
    waits meanwhile: nothing else is under way, and Ctrl-C stays immediate."""
    print(prompt, end="", flush=True)
    answer = sys.stdin.readline()
    if not answer.endswith("\n"):
        print(flush=True)
    return answer.strip().lower() in ("y", "yes")


async def _reset(
    args: argparse.Namespace,
    backend: RendezvousBackend,
    settings: RendezvousSettings,
    secrets: frozenset[str],
) -> int:
    reset = getattr(backend, "reset", None)
    if not callable(reset):
        raise UsageError(f"the {backend.name} backend cannot reset a run")
    where = f"job '{settings.run_id}' at {redact_endpoint(args.rdzv_endpoint)}"
    data, _ = await backend.read()
    try:
        summary = _summary(None if data is None else decode_state(data), settings, time.time())
    except RendezvousStateError as exc:
        summary = f"unreadable state ({exc})"
    _say(f"{where}: {summary}", secrets)
    if not (args.yes or _confirm("delete its rendezvous state and store? [y/N] ")):
        _say("nothing deleted", secrets)
        return 1
    if await reset():
        _say(f"deleted the rendezvous state and store of {where}: the id is free", secrets)
    else:
        _say(f"{where} had nothing to delete: the id is free", secrets)
    return 0


async def _show(args: argparse.Namespace, secrets: frozenset[str]) -> int:
    backend_name = BACKEND_ALIASES.get(args.rdzv_backend, args.rdzv_backend)
    if backend_name == "memory":
        raise UsageError(
            "the memory backend lives inside one launcher process: status needs redis or http"
        )
    if args.reset and (args.watch or args.json):
        raise UsageError("--reset cannot be combined with --watch or --json")
    config = parse_rdzv_conf(args.rdzv_conf)
    for warning in unknown_key_warnings(config, backend_name):
        _say(f"aelastic status: warning: {warning}", secrets, err=True)
    try:
        params = RendezvousParameters(
            backend_name, args.rdzv_endpoint, args.rdzv_id, 1, 1, **config
        )
        settings = RendezvousSettings.from_parameters(params)
        backend = create_backend(params)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    try:
        if args.reset:
            return await _reset(args, backend, settings, secrets)
        while True:
            data, token = await backend.read()
            state = None if data is None else decode_state(data)
            now = time.time()
            if args.json:
                _say(json.dumps(state_to_json(state, settings, now)), secrets)
            else:
                _say(format_state(state, settings, now), secrets)
            if not args.watch:
                return 0
            await backend.wait_for_change(token, 30.0)
            if not args.json:
                print(flush=True)
    finally:
        await backend.aclose()


def main(argv: Sequence[str]) -> int:
    """Run ``aelastic status``; the exit code (1 when the backend cannot be read, or when
    ``--reset`` was not confirmed).

    Raises:
        UsageError: Bad flags (exit code 2).
    """
    args = build_parser().parse_args(list(argv))
    config = parse_rdzv_conf(args.rdzv_conf)
    secrets = known_secrets(args.rdzv_endpoint, config, os.environ)
    try:
        return asyncio.run(_show(args, secrets))
    except (RendezvousError, ImportError) as exc:
        _say(f"aelastic status: error: {exc}", secrets, err=True)
        return 1
    except KeyboardInterrupt:
        return 130
