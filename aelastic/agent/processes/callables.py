"""Python callables as worker entrypoints, under torch's start methods; return values back.

How it works: a callable runs as multiprocessing would run it under the spec's
``start_method``:

* ``spawn`` (torch's default) and ``forkserver``: a fresh interpreter. As multiprocessing's
  spawn does, the agent pickles its preparation data (``sys.path``, working directory, main module,
  authkey) and the user's ``(callable, args)`` into a private file *while it spawns*
  (:func:`write_payload`), so objects that may only pass to a process being started (an
  ``mp.Queue``, a lock, an event, a pipe) pickle as they do for multiprocessing: their file
  descriptors are collected and passed to the child at the same numbers. The child runs ``python
  .../aelastic/agent/_call.py PAYLOAD RESULT`` (:mod:`aelastic.agent.processes._call`).
  ``forkserver`` is run the same way: its workers also start from a fresh interpreter, and the same
  objects pass.
* ``fork``: the worker is forked from a server forked off the caller before the agent's
  loop and threads start (:mod:`aelastic.agent.processes.forks`), so lambdas, closures and functions
  of a notebook's ``__main__`` work as under torch.

Either way the return value comes back pickled in a file (:func:`read_result`), never
through the rendezvous store.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from multiprocessing import context, reduction, spawn
from typing import Any

__all__ = ["CALL_SCRIPT", "child_argv", "read_result", "write_payload"]

#: The program of a spawned callable's worker (see :mod:`aelastic.agent.processes._call`).
CALL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_call.py")


class _DupFd:
    """What a descriptor pickles to for a child being spawned (multiprocessing's form)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


class _Spawning:
    """Stands for the process being spawned while its payload is pickled: multiprocessing's
    objects ask it to pass their descriptors (``duplicate_for_child``), as its spawn
    ``Popen`` does; the child gets them at the same numbers."""

    DupFd = _DupFd

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return fd


def write_payload(path: str, name: str, fn: Callable[..., Any], args: Sequence[Any]) -> list[int]:
    """Write what a spawned child needs to call ``fn(*args)``; the descriptors to pass it.

    Raises:
        pickle.PicklingError: ``fn`` or ``args`` cannot be pickled (a lambda, say).
        AttributeError: Same, for objects pickle cannot find by name.
        RuntimeError: An object multiprocessing refuses to pass to a spawned process (a
            lock made in a fork context, ...).
    """
    spawning = _Spawning()
    context.set_spawning_popen(spawning)  # type: ignore[arg-type]
    try:
        prep = reduction.ForkingPickler.dumps(spawn.get_preparation_data(name))
        body = reduction.ForkingPickler.dumps((fn, tuple(args)))
    finally:
        context.set_spawning_popen(None)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as f:
        f.write(prep)
        f.write(body)
    return sorted(set(spawning.fds))


def child_argv(payload: str, result: str) -> list[str]:
    """The command of a spawned callable's worker."""
    return [spawn.get_executable(), CALL_SCRIPT, payload, result]


def read_result(path: str) -> Any:
    """The value the callable returned (``None`` if it wrote none, e.g. ``sys.exit(0)``)."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
    finally:
        if os.path.exists(path):
            os.unlink(path)
