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
from collections.abc import Awaitable, Callable

from ..api import RunResult
from .signals import forwarding, free_signals, raise_for, sigint_interrupts, signals_to_handle

__all__ = ["run_blocking"]


def run_blocking(
    run: Callable[[], Awaitable[RunResult]],
    *,
    prefork: Callable[[], None],
    forward: Callable[[int], None],
    release: Callable[[], Awaitable[None]],
    signals: tuple[signal.Signals, ...] | None,
) -> RunResult:
    """:meth:`ElasticAgent.run_sync` (see there and the module docstring): ``run()`` on a
    private loop, ``prefork()`` before it (the fork server, before the loop's threads),
    the handled signals given to ``forward`` (the agent stops its workers with them),
    ``release()`` (the rendezvous handler) at the end."""
    if asyncio._get_running_loop() is not None:
        raise RuntimeError("run_sync() called from a running event loop: await run() instead")
    prefork()  # before the loop and its threads: a safe state to fork from
    wanted = signals_to_handle() if signals is None else signals
    handled, received = free_signals(wanted), list[signal.Signals]()

    async def main() -> RunResult:
        try:
            with forwarding(handled, forward, received):
                return await run()
        finally:
            await release()

    try:
        with sigint_interrupts():
            return asyncio.run(main())
    except asyncio.CancelledError:
        raise_for(received)
        raise
