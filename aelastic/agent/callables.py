"""Python callables as worker entrypoints: run in a fresh interpreter, return value back.

How it works: as ``multiprocessing``'s *spawn* start method does, the agent pickles its
own preparation data (``sys.path``, working directory, main module) and the user's
``(callable, args)`` into a private file, and starts ``python -c <bootstrap> payload result``.
The bootstrap prepares the interpreter like a spawned multiprocessing child, calls the
callable, and pickles the return value into the result file (written atomically). An
exception is written to ``TORCHELASTIC_ERROR_FILE`` in torch's ``@record`` format (unless
the callable's own ``@record`` did already) and ends the process with exit code 1. This is
a local parent-to-child transfer of the user's own objects; shared rendezvous state never
goes through pickle.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Sequence
from multiprocessing import spawn
from typing import Any

__all__ = ["BOOTSTRAP", "child_argv", "read_result", "write_payload"]

#: The code a callable's worker runs (``python -c BOOTSTRAP payload result``).
BOOTSTRAP = """\
import json, os, pickle, sys, time, traceback
payload, result = sys.argv[1], sys.argv[2]
from multiprocessing import spawn
with open(payload, "rb") as f:
    spawn.prepare(pickle.load(f))
    fn, args = pickle.load(f)
try:
    value = fn(*args)
except Exception as exc:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and path != os.devnull and not os.path.exists(path):
        data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
            "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}
        with open(path, "w") as f:
            json.dump(data, f)
    raise
with open(result + ".tmp", "wb") as f:
    pickle.dump(value, f)
os.replace(result + ".tmp", result)
"""


def write_payload(path: str, name: str, fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Write what the child needs to call ``fn(*args)`` like a spawned multiprocessing child.

    Raises:
        pickle.PicklingError: ``fn`` or ``args`` cannot be pickled (a lambda, say).
        AttributeError: Same, for objects pickle cannot find by name.
    """
    prep = spawn.get_preparation_data(name)
    prep.pop("authkey", None)  # the child never talks back through multiprocessing
    body = pickle.dumps((fn, tuple(args)))
    with open(path, "wb") as f:
        pickle.dump(prep, f)
        f.write(body)


def child_argv(payload: str, result: str) -> list[str]:
    """The command of a callable's worker."""
    return [sys.executable, "-c", BOOTSTRAP, payload, result]


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
