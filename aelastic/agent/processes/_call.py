"""A callable worker's last mile: call the function, hand its value back, record its error.

How it works: both start methods end here. Under *spawn* (and *forkserver*) the agent runs
this file as a script, ``python .../aelastic/agent/_call.py PAYLOAD RESULT``, so that nothing
of the ``aelastic`` package is imported into the worker: :func:`_main` reads the payload the
agent pickled (multiprocessing's preparation data, then the function and its arguments),
prepares the interpreter as multiprocessing's spawn does and removes the payload. Under
*fork* the forked child calls :func:`call` directly (:mod:`aelastic.agent.processes.forks`).

:func:`call` calls the function and pickles its return value into ``RESULT`` (written
atomically; the agent reads it). An exception is written to ``TORCHELASTIC_ERROR_FILE`` in
torch's ``@record`` format (unless the function's own ``@record`` did already) and printed
to stderr as Python would, with the user's frames only (none of this file), and the worker
exits with 1. ``SystemExit`` and ``KeyboardInterrupt`` behave as in a plain script. The
payload is a local parent-to-child transfer of the user's own objects in a private
directory; shared rendezvous state never goes through pickle.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

__all__ = ["call", "user_traceback"]


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, without the frames of this file."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _record(exc: BaseException, callstack: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or path == os.devnull or os.path.exists(path):
        return  # no error file, or the function's own @record wrote it
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as err:
        print(f"cannot write the error file {path}: {err}", file=sys.stderr)


def call(fn: Callable[..., Any], args: Sequence[Any], result: str) -> int:
    """Call ``fn(*args)``; the exit code the worker should end with.

    The return value is pickled into ``result`` (atomically); an exception is recorded and
    printed (exit code 1). ``SystemExit`` and ``KeyboardInterrupt`` propagate.
    """
    try:
        value = fn(*args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        text = user_traceback(exc)
        _record(exc, text)
        sys.stderr.write(text)
        sys.stderr.flush()
        return 1
    with open(result + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(result + ".tmp", result)
    return 0


def _main() -> int:
    payload, result = sys.argv[1], sys.argv[2]
    from multiprocessing import spawn

    with open(payload, "rb") as f:
        spawn.prepare(pickle.load(f))  # sys.path, sys.argv, cwd, __main__, authkey
        fn, args = pickle.load(f)
    os.unlink(payload)
    return call(fn, args, result)


if __name__ == "__main__":
    sys.exit(_main())
