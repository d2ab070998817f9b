"""SIGINT that always interrupts: aelastic's blocking entry points stop on Ctrl-C or ``kill -INT``.

How it works: Python turns SIGINT into ``KeyboardInterrupt`` only when the process did not
inherit it ignored, and ``asyncio.run`` cancels its main task on SIGINT only in that case
too. A job started in the background by a shell script (``cmd &`` without job control, as CI
runners and test harnesses do) inherits SIGINT ignored: its agent, or ``aelastic status
--watch``, would then never stop on SIGINT. :func:`sigint_interrupts` restores Python's
handler for the duration of such a call (in the main thread, when SIGINT is ignored or at
the system default; a handler the program installed itself is left alone) and puts the
previous disposition back afterwards. ``aelastic run`` and torchrun handle SIGINT
themselves, whatever was inherited, for the same reason.

The ``aelastic`` command enters it first thing (before its subcommand's modules load):
while SIGINT is ignored the kernel discards it, so a Ctrl-C arriving then is lost for good.
What remains is the interpreter's own start and ``import aelastic`` (a fraction of a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["sigint_interrupts", "stop_on_signals"]


def stop_on_signals() -> asyncio.Event:
    """An event the running loop sets on SIGINT or SIGTERM: a server command's ``stop``
    (where the loop cannot take signal handlers, e.g. off the main thread, it is never set)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, stop.set)
    return stop


@contextlib.contextmanager
def sigint_interrupts() -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives Python's signal handlers
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous not in (signal.SIG_IGN, signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
