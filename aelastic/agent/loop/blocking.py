"""The agent's blocking entry point: ``run()`` on a private event loop, for plain scripts.

How it works: :func:`run_blocking` refuses a thread whose event loop is running, makes the fork
server before the loop and its threads exist (a safe state to fork from), then runs ``agent.run()``
with :func:`asyncio.run`, the rendezvous handler released after. In the main thread the signals to
handle (:mod:`aelastic.agent.loop.signals`) are forwarded to the workers and cancel the run; once it
ended, SIGINT raises ``KeyboardInterrupt`` and the others ``SignalException``.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

from ..api import RunResult
from ..processes.forks import fork_server_for
from .signals import forwarding, free_signals, raise_for, sigint_interrupts, signals_to_handle

if TYPE_CHECKING:
    from .agent import ElasticAgent

__all__ = ["run_blocking"]


def run_blocking(
    agent: ElasticAgent, role: str, signals: tuple[signal.Signals, ...] | None
) -> RunResult:
    """:meth:`ElasticAgent.run_sync` (see there and the module docstring)."""
    if asyncio._get_running_loop() is not None:
        raise RuntimeError("run_sync() called from a running event loop: await run() instead")
    if not agent._used:  # before the loop and its threads: a safe state to fork from
        agent._forks = fork_server_for(agent._spec)
    wanted = signals_to_handle() if signals is None else signals
    handled, received = free_signals(wanted), list[signal.Signals]()

    async def main() -> RunResult:
        try:
            with forwarding(handled, agent.forward_signal, received):
                return await agent.run(role)
        finally:
            await agent._handler.aclose()

    try:
        with sigint_interrupts():
            return asyncio.run(main())
    except asyncio.CancelledError:
        raise_for(received)
        raise
