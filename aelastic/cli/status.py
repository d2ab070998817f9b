"""``aelastic status``: what a job's rendezvous looks like now, for an operator (read-only).

How it works: the command opens the job's backend (redis or http) through the backend
registry, reads the state cell once, decodes it with the state codec and prints the round,
whether it is complete or closed, the participants with their ranks and heartbeat ages, and
the waiting and redundant nodes. It never writes. ``--watch`` prints again at every change
(the backend wakes it; there is no poll), ``--json`` prints machine-readable output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from .._signals import sigint_interrupts
from ..backends.registry import create_backend
from ..rendezvous.api import RendezvousError, RendezvousParameters, RendezvousSettings
from ..rendezvous.state import NodeDesc, RendezvousState, decode_state
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
            {**node(n), "rank": r}
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
    try:
        while True:
            data, token = await backend.read()
            state = None if data is None else decode_state(data)
            now = time.time()
            if args.json:
                print(json.dumps(state_to_json(state, settings, now)), flush=True)
            else:
                print(format_state(state, settings, now), flush=True)
            if not args.watch:
                return 0
            await backend.wait_for_change(token, 30.0)
            if not args.json:
                print(flush=True)
    finally:
        await backend.aclose()


def main(argv: Sequence[str]) -> int:
    """Run ``aelastic status``; the exit code (1 when the backend cannot be read).

    Raises:
        UsageError: Bad flags (exit code 2).
    """
    args = build_parser().parse_args(list(argv))
    try:
        with sigint_interrupts():  # --watch ends on SIGINT, even if inherited ignored
            return asyncio.run(_show(args))
    except RendezvousError as exc:
        print(f"aelastic status: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except ImportError as exc:
        print(f"aelastic status: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
