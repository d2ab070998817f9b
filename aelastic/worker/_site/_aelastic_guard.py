"""The worker's guards: it stops when its agent froze, and its uncaught error is written.

How it works: the bootstrap (``sitecustomize.py`` beside this file) loads this module under
the name ``_aelastic_guard`` before the user's code (beside the progress runtime,
``_aelastic_worker.py``), installs :func:`install_excepthook` (an uncaught exception is
written to ``TORCHELASTIC_ERROR_FILE`` in torch's ``@record`` format when the script's own
``@record`` did not) and calls :func:`watch_agent`: when the agent names its beat page
(``AELASTIC_AGENT_BEAT``), a daemon thread sleeps until the deadline the agent's event loop
keeps pushing forward there; a deadline that passes means the agent did not run for as long
as its node's peers wait before they drop the node (it is frozen, or gone): the thread then
says so (stderr, the error file) and SIGKILLs the worker's process group, itself included,
so that no rank of the old group runs beside the rank that replaces it. The excepthook also
tells the agent at once that the worker is failing, with the traceback, then again once its
Python code is over (its last exit handler; see ``aelastic.agent.processes.inplace``); and
:func:`install_exit_hook` destroys a gloo process group left alive at exit, before the
interpreter's finalization would abort the process. Standard library only, and cheap to
import: it runs in every worker.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

__all__ = [
    "BEAT_AGENT",
    "BEAT_AT",
    "BEAT_DEADLINE",
    "BEAT_MAGIC",
    "BEAT_NEVER",
    "BEAT_WINDOW",
    "ENV_BEAT",
    "ENV_WORKERS_SOCKET",
    "PAGE_SIZE",
    "install_excepthook",
    "install_exit_hook",
    "watch_agent",
]

#: Size of the beat page (bytes).
PAGE_SIZE = 4096
_keep: list[Any] = []  # the mapping, alive as long as the process
_monotonic_ns = time.monotonic_ns


# -- the agent's beat ---------------------------------------------------------------------

#: The worker's variable naming its agent's beat page.
ENV_BEAT = "AELASTIC_AGENT_BEAT"
#: Slot 0 of a beat page ("AEB1", then the format version).
BEAT_MAGIC = 0x0001_3142_4541
#: Slots of the beat page (unsigned 64-bit, native order): the deadline
#: (``time.monotonic_ns()``) by which the agent writes again, the agent's last write, its
#: pid, and its node's heartbeat window (ms).
BEAT_DEADLINE = 1
BEAT_AT = 2
BEAT_AGENT = 3
BEAT_WINDOW = 4
#: A deadline that never comes: the agent stops its workers itself (it is ending).
BEAT_NEVER = 2**64 - 1
#: Seconds the stop waits for stderr to take its line (a pipe the frozen agent reads).
_SAY_WAIT = 0.2

_watching = False


def watch_agent() -> None:
    """Stop this worker, and its process group, once its agent misses the deadline of its
    beat page (see the module docstring). Nothing when the environment names no page, or
    when the page cannot be read. Called at start (the bootstrap, a warm standby released,
    a forked worker)."""
    global _watching
    path = os.environ.get(ENV_BEAT)
    if _watching or not path:
        return
    try:
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), PAGE_SIZE, access=mmap.ACCESS_READ)
        page = memoryview(mapping).cast("Q")
        if page[0] != BEAT_MAGIC:
            return
    except (OSError, ValueError):
        return
    _watching = True
    _keep.append(mapping)
    threading.Thread(target=_watch, args=(page,), name="aelastic-agent-watch", daemon=True).start()


def _watch(page: memoryview) -> None:
    while True:
        deadline = page[BEAT_DEADLINE]
        if deadline == BEAT_NEVER:
            return  # the agent is ending: it stops its workers itself
        left = deadline - _monotonic_ns()
        if left > 0:
            time.sleep(left / 1e9 + 0.001)
            continue
        _stop_for_agent(page)
        return


def _stop_for_agent(page: memoryview) -> None:
    silent = max(_monotonic_ns() - page[BEAT_AT], 0) / 1e9
    message = (
        f"aelastic: this worker's agent (pid {page[BEAT_AGENT]}) has not run for {silent:.1f} s, "
        f"so the other nodes may drop this node (heartbeat window "
        f"{page[BEAT_WINDOW] / 1000:g} s): the worker (pid {os.getpid()}) stops, with its "
        "process group"
    )
    try:  # noqa: SIM105 - contextlib is not worth importing in every worker
        _write_error_doc(message, message)
    except Exception:
        pass
    _say(message + "\n")
    try:
        group = os.getpgrp()
        if group == os.getsid(0):  # the session the agent started the worker in
            os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _say(text: str) -> None:
    """Write ``text`` to stderr unless it would block (a full pipe of the frozen agent)."""
    import select

    try:
        poller = select.poll()
        poller.register(2, select.POLLOUT)
        if poller.poll(_SAY_WAIT * 1000):
            os.write(2, text.encode(errors="replace"))
    except (OSError, ValueError):
        pass


# -- a gloo group at exit -----------------------------------------------------------------

#: Longest wait at exit for a gloo group's end (its threads may wait on a peer).
_DESTROY_BOUND = 10.0
#: The name gloo's worker threads carry (a process group's, joined when it is freed).
_GLOO_THREAD = "pt_gloo_runloop"


def install_exit_hook() -> None:
    """End a gloo process group still alive when the interpreter exits, before it finalizes.

    A gloo group's worker threads give up the tensors of their last collective after the
    call returned, and that needs the GIL; they are joined when the group is freed. A group
    freed during the interpreter's finalization (never destroyed: no
    ``destroy_process_group()``, an uncaught exception, a peer that died; or destroyed but
    still referred to from a cycle of objects, such as a model wrapped in DDP or a closure,
    which only finalization's last collection frees) has a thread ask for the GIL then, and
    Python 3.11 ends such a thread in a way C++ cannot unwind: the process aborts
    ("terminate called without an active exception", SIGABRT), about one exit in ten,
    more under load; the agent would see a crash where the script exited. So here, after
    the script's own ``atexit`` handlers: a default gloo group still set up is destroyed,
    and while gloo's threads are still there, the cycles are collected (the group freed,
    its threads joined) while the interpreter is whole. In a thread waited for at most
    :data:`_DESTROY_BOUND` seconds (a thread may wait on a peer). NCCL and other backends
    are left to the script, as under torchrun.
    """
    atexit.register(_end_gloo_group)


def _end_gloo_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        alive = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    except Exception:
        alive = False
    if not alive and not _gloo_threads():
        return

    def end() -> None:
        try:
            if alive:
                dist.destroy_process_group()
        except Exception:  # a broken group may fail to: the exit goes on
            pass
        if _gloo_threads():
            import gc

            gc.collect()

    thread = threading.Thread(target=end, name="aelastic-end-group", daemon=True)
    thread.start()
    thread.join(_DESTROY_BOUND)


def _gloo_threads() -> bool:
    """Whether a gloo group's worker thread runs in this process (its name, from /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == _GLOO_THREAD:
                    return True
        except OSError:
            continue
    return False


# -- uncaught exceptions ------------------------------------------------------------------

#: The worker's variable naming its agent's socket (``aelastic.worker._inplace.ENV_SOCKET``).
ENV_WORKERS_SOCKET = "AELASTIC_INPLACE_SOCKET"
#: Characters of the traceback's end told to the agent (where it broke, and why).
_NOTICE_TEXT = 8192

_failing: Any = None  # the socket that told the agent this worker is failing


def install_excepthook() -> None:
    """Write an uncaught exception to ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record``
    format) unless something wrote it already, tell the agent the worker is failing; then
    print it as before.

    Also registers the exit handler that tells the agent when a failing worker's Python
    code is over. Registered here, before the user's code, it runs last: after the user's
    exit handlers, and after Python joined the user's threads; what is left is the
    interpreter's own teardown (seconds with torch loaded, on a busy machine), which the
    agent need not wait for when it stops the worker.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        try:
            if not issubclass(kind, (SystemExit, KeyboardInterrupt)):
                text = "".join(traceback.format_exception(kind, value, tb))
                _write_error_file(kind, value, text)
        except Exception:  # never hide the user's exception behind ours
            pass
        try:  # noqa: SIM105
            _tell_failing(kind, value, tb)
        except Exception:
            pass
        previous(kind, value, tb)

    sys.excepthook = hook
    atexit.register(_tell_exiting)


def _tell_failing(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    """Tell the agent (its socket, when the environment names one) that this worker is
    failing with an uncaught exception: the earliest sign of a collective broken by a
    peer's loss, seconds before the process is gone."""
    global _failing
    path = os.environ.get(ENV_WORKERS_SOCKET)
    if not path or _failing is not None or issubclass(kind, (SystemExit, KeyboardInterrupt)):
        return
    import socket

    text = "".join(traceback.format_exception(kind, value, tb))[-_NOTICE_TEXT:]
    line = json.dumps({"op": "failing", "pid": os.getpid(), "error": text}) + "\n"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_SAY_WAIT)  # never hold the exit for an agent that does not read
        sock.connect(path)
        sock.sendall(line.encode(errors="replace"))
    except OSError:
        sock.close()
        return
    _failing = sock


def _tell_exiting() -> None:
    """The last exit handler: tell the agent that this failing worker's Python code is over."""
    global _failing
    sock, _failing = _failing, None
    if sock is None:
        return
    try:  # noqa: SIM105 - contextlib is not worth importing in every worker
        sock.sendall(json.dumps({"op": "exiting", "pid": os.getpid()}).encode() + b"\n")
    except OSError:
        pass
    sock.close()


def _write_error_file(kind: type[BaseException], value: BaseException, text: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or path == os.devnull or os.path.exists(path):
        return
    message = "".join(traceback.format_exception_only(kind, value)).strip()
    _write_error_doc(message, text)


def _write_error_doc(message: str, callstack: str) -> None:
    """Write ``TORCHELASTIC_ERROR_FILE`` in ``@record``'s format unless something did."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or path == os.devnull or os.path.exists(path):
        return
    doc = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(doc, f)
