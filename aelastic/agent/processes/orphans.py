"""No worker outlives its agent: the parent-death signal armed in the child, and the guardian.

See :mod:`aelastic.agent.processes.process` for how the two fit together; this module holds their
machinery: :func:`child_setup` (the ``preexec_fn`` that arms ``PR_SET_PDEATHSIG`` through
ctypes and binds CPUs) and :data:`GUARDIAN`, this process's link to its guardian helper
(:mod:`aelastic.agent.processes._guard`), to which every worker's group is announced. Both end a
dead agent's workers with SIGKILL, at once: nobody runs their node any more (the
guardian's module docstring says why no grace). The guardian lives while an agent of this
process has workers: the end of a run retires it once no group is announced
(:meth:`_Guardian.retire`), so a program that embeds the agent is left with no process of
aelastic's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from ...core.errors import reason
from ._guard import start_time

__all__ = ["GUARDIAN", "child_setup"]

log = logging.getLogger("aelastic.agent")

_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None
_prctl_looked_up = False


def _libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), looked up once in the agent, never in a forked child."""
    global _prctl, _prctl_looked_up
    if not _prctl_looked_up:
        _prctl_looked_up = True
        if sys.platform.startswith("linux"):
            try:
                prctl = ctypes.CDLL(None, use_errno=True).prctl
            except (OSError, AttributeError):
                return None
            prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
            prctl.restype = ctypes.c_int
            _prctl = prctl
    return _prctl


def child_setup(affinity: frozenset[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that arms SIGKILL on the parent's death (Linux) and binds the child
    to ``affinity`` (``None``: nothing to do). Make it in the parent; call it in the child."""
    prctl = _libc_prctl()
    if prctl is None and affinity is None:
        return None
    parent = os.getpid()
    sig = int(signal.SIGKILL)

    def setup() -> None:
        # Runs in the child between fork and exec: nothing here takes a lock that another
        # thread of the agent could have held when it forked.
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)  # the agent died before the signal was armed
        if affinity is not None:
            os.sched_setaffinity(0, affinity)

    return setup


_GUARD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")


class _Guardian:
    """This process's link to its guardian (see :mod:`aelastic.agent.processes._guard`).

    Started before the first spawn, started again (told every group still watched) if it
    died. Thread-safe; a forked child starts with no guardian of its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid: int | None = None
        self._groups: dict[int, bytes] = {}
        self._warned = False

    def ensure(self) -> None:
        """Start the guardian now if there is none (so that announcing a group is a write)."""
        with self._lock:
            if self._fd is None:
                self._start()

    def watch(self, pgid: int) -> None:
        """Announce group ``pgid``: SIGKILL it should this process die."""
        line = f"+ {pgid} {start_time(pgid)}\n".encode()
        with self._lock:
            self._groups[pgid] = line
            self._send(line)

    def forget(self, pgid: int) -> None:
        """Withdraw group ``pgid`` (stopped and swept)."""
        with self._lock:
            if self._groups.pop(pgid, None) is not None:
                self._send(f"- {pgid}\n".encode())

    def retire(self) -> int | None:
        """End the guardian if no group is announced (every agent of this process is done):
        its pipe is closed, so it exits; its pid, for the caller to await and reap. The next
        :meth:`ensure` starts another one."""
        with self._lock:
            if self._groups or self._fd is None:
                return None
            pid, self._pid = self._pid, None
            fd, self._fd = self._fd, None
            os.close(fd)
            return pid

    def _send(self, line: bytes) -> None:
        if self._fd is not None:
            try:
                os.write(self._fd, line)
                return
            except OSError:  # it died: start another one, told every group
                self._close()
        self._start()

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            with open(os.devnull, "rb") as null:
                self._pid = os.posix_spawn(
                    sys.executable,
                    [sys.executable, "-I", "-S", _GUARD_SCRIPT],
                    os.environ,
                    file_actions=[
                        (os.POSIX_SPAWN_DUP2, read_fd, 0),
                        (os.POSIX_SPAWN_DUP2, null.fileno(), 1),
                        (os.POSIX_SPAWN_DUP2, null.fileno(), 2),
                    ],
                    setsid=True,
                )
            if self._groups:
                os.write(write_fd, b"".join(self._groups.values()))
        except (OSError, ValueError, AttributeError) as exc:
            os.close(write_fd)
            self._close()  # reaps one that started but died at once
            if not self._warned:
                self._warned = True
                log.warning(
                    "no guardian for the workers (%s): they may outlive a killed agent", reason(exc)
                )
            return
        finally:
            os.close(read_fd)
        self._fd = write_fd

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        pid, self._pid = self._pid, None
        if pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def after_fork_in_child(self) -> None:
        """A forked child has no guardian: its copy of the pipe would hide the agent's end."""
        self._lock = threading.Lock()
        fd, self._fd, self._pid = self._fd, None, None
        self._groups = {}
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


GUARDIAN = _Guardian()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=GUARDIAN.after_fork_in_child)
