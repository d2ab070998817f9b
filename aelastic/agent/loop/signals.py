"""The signals torchrun forwards, for ``run_sync``.

The signals in ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (by default SIGTERM, SIGINT, SIGHUP and
SIGQUIT) are handled by ``run_sync`` through :func:`forwarding`: the signal is recorded for
the agent (its workers get that signal, the grace period, then SIGKILL) and cancels the run;
afterwards :func:`raise_for` raises ``KeyboardInterrupt`` for SIGINT and
:class:`SignalException` (torch's name) for the others. A SIGHUP ignored when the process
started (``nohup``) stays ignored (:func:`kept_ignored`): the job goes on when the terminal
goes away. ``await agent.run()`` installs no
handler: the embedding program owns its signals. SIGINT that always interrupts (even when
inherited ignored) is :func:`aelastic.core._signals.sigint_interrupts`, re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ...core._signals import sigint_interrupts

__all__ = [
    "DEFAULT_SIGNALS",
    "SignalException",
    "forwarding",
    "free_signals",
    "kept_ignored",
    "raise_for",
    "sigint_interrupts",
    "signals_to_handle",
]


#: The signals torchrun handles when ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is unset.
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class SignalException(Exception):
    """The agent was stopped by a signal (torch's name): its workers got that same signal,
    the grace period, then SIGKILL. ``sigval`` is the signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def signals_to_handle(env: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The signals of ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (torch's default when unset);
    unknown names, SIGKILL and SIGSTOP are left out (torch logs and skips them too)."""
    text = (os.environ if env is None else env).get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    found: list[signal.Signals] = []
    for raw in (text if text is not None else DEFAULT_SIGNALS).split(","):
        name = raw.strip().upper()
        sig = getattr(signal.Signals, name if name.startswith("SIG") else f"SIG{name}", None)
        if sig is not None and sig not in (signal.SIGKILL, signal.SIGSTOP):
            found.append(sig)
    return tuple(dict.fromkeys(found))


def free_signals(signals: Iterable[signal.Signals]) -> tuple[signal.Signals, ...]:
    """Those of ``signals`` the program left to the system or ignored (call before the loop
    runs: a handler the program installed itself is left alone). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return ()
    unset = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None)
    return tuple(sig for sig in signals if signal.getsignal(sig) in unset and not kept_ignored(sig))


def kept_ignored(sig: signal.Signals) -> bool:
    """Whether ``sig`` is SIGHUP ignored by the process (``nohup``): it stays ignored."""
    return sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN


@contextlib.contextmanager
def forwarding(
    signals: Iterable[signal.Signals],
    forward: Callable[[signal.Signals], None],
    received: list[signal.Signals],
) -> Iterator[None]:
    """Within the block, on the running loop: each of ``signals`` is recorded in
    ``received``, passed to ``forward`` and cancels the current task (the first time).
    The previous dispositions are restored afterwards."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_signal(sig: signal.Signals) -> None:
        if not received:
            received.append(sig)
            forward(sig)
            task.cancel()

    installed: list[tuple[signal.Signals, Any]] = []
    for sig in signals:
        previous = signal.getsignal(sig)
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append((sig, previous))
    try:
        yield
    finally:
        for sig, previous in installed:
            loop.remove_signal_handler(sig)
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, previous)


def raise_for(received: list[signal.Signals]) -> None:
    """After a run a signal cancelled: ``KeyboardInterrupt`` for SIGINT (Python's way),
    :class:`SignalException` for any other signal; nothing if none came."""
    if not received:
        return
    sig = received[0]
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
