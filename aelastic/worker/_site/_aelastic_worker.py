"""The worker's side of progress reporting: a shared page, torch's optimizer hook, stacks.

How it works: the agent gives each worker a page of shared memory (a 4 KiB file on
``/dev/shm``, named by ``AELASTIC_PROGRESS_FILE``). The first time the worker makes progress
(:func:`progress`, called by torch's global optimizer step hook or by the script through
:mod:`aelastic.worker`), it maps the page, writes its pid and main thread, and registers
``faulthandler`` on a free real-time signal that it writes into the page: the agent sends
that signal to a stalled worker and ``faulthandler`` writes the Python stack of every thread
to ``<page>.stacks``, even while the main thread is blocked in C. Each progress then writes
two integers into the page (steps, ``time.monotonic_ns()``): no system call, no lock
(about 0.3 us, measured in ``benchmarks/bench_progress.py``). The agent reads the page.

The bootstrap (``sitecustomize.py`` beside this file) loads this module under the name
``_aelastic_worker`` before the user's code, installs :func:`install_torch_hook` (an import
hook that registers the optimizer hook as soon as ``torch.optim.optimizer`` is imported)
and :func:`install_excepthook` (an uncaught exception is written to
``TORCHELASTIC_ERROR_FILE`` in torch's ``@record`` format when the script's own ``@record``
did not, and the agent is told at once that the worker is failing, with the traceback,
then again once its Python code is over: its last exit handler; see
``aelastic.agent._inplace``), and calls :func:`watch_agent`: when the agent names its beat page
(``AELASTIC_AGENT_BEAT``), a daemon thread sleeps until the deadline the agent's event loop
keeps pushing forward there; a deadline that passes means the agent did not run for as long
as its node's peers wait before they drop the node (it is frozen, or gone): the thread then
says so (stderr, the error file) and SIGKILLs the worker's process group, itself included,
so that no rank of the old group runs beside the rank that replaces it; and
:func:`install_exit_hook` (a gloo process group left alive is destroyed at exit, before
the interpreter's finalization would abort the process). Standard library
only, and cheap to import: it runs in every worker.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from types import ModuleType, TracebackType
from typing import IO, Any

__all__ = [
    "BEAT_AGENT",
    "BEAT_AT",
    "BEAT_DEADLINE",
    "BEAT_MAGIC",
    "BEAT_NEVER",
    "BEAT_WINDOW",
    "ENV_BEAT",
    "ENV_PAGE",
    "ENV_WORKERS_SOCKET",
    "MAGIC",
    "PAGE_SIZE",
    "SLOT_MAIN",
    "SLOT_PAUSED",
    "SLOT_PID",
    "SLOT_SIGNAL",
    "SLOT_STEPS",
    "SLOT_TIME",
    "attached",
    "forked_worker",
    "install_excepthook",
    "install_exit_hook",
    "install_torch_hook",
    "pause",
    "progress",
    "stacks_path",
    "watch_agent",
]

#: The worker's variable naming its page.
ENV_PAGE = "AELASTIC_PROGRESS_FILE"
#: Size of a page (bytes).
PAGE_SIZE = 4096
#: Slot 0 of a page the agent prepared ("AEP1", then the format version).
MAGIC = 0x0001_3150_4541
#: Slots of the page (unsigned 64-bit, native order).
SLOT_PID = 1
SLOT_STEPS = 2
SLOT_TIME = 3
SLOT_SIGNAL = 4
SLOT_MAIN = 5
SLOT_PAUSED = 6

_page: memoryview | None = None  # the page as unsigned 64-bit slots, once attached
_unavailable = False  # no page for this process: progress() is a no-op
_steps = 0
_keep: list[Any] = []  # the mapping and the stacks file, alive as long as the process
_monotonic_ns = time.monotonic_ns


def stacks_path(page_path: str) -> str:
    """Where the worker of ``page_path`` writes its stacks."""
    return page_path + ".stacks"


def progress() -> None:
    """One unit of progress (an optimizer step, a batch...): cheap, call it as often as you
    like. Does nothing when the process has no page."""
    global _steps
    page = _page
    if page is None:
        if _unavailable:
            return
        page = _attach()
        if page is None:
            return
    _steps += 1
    # The time first: a page with steps always has the time of a progress (the agent may
    # read between the two stores).
    page[SLOT_TIME] = _monotonic_ns()
    page[SLOT_STEPS] = _steps


def attached() -> bool:
    """Whether this process reports its progress to an agent (after its first progress)."""
    return _page is not None


def _attach() -> memoryview | None:
    global _page, _unavailable
    path = os.environ.get(ENV_PAGE)
    if not path:
        _unavailable = True
        return None
    try:
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), PAGE_SIZE)
        page = memoryview(mapping).cast("Q")
        if page[0] != MAGIC:
            raise ValueError("not a progress page")
        stacks = open(stacks_path(path), "a")  # noqa: SIM115 - kept for faulthandler
    except (OSError, ValueError):
        _unavailable = True
        return None
    _keep[:] = [mapping, page, stacks]
    page[SLOT_PID] = os.getpid()
    page[SLOT_MAIN] = threading.main_thread().ident or 0
    page[SLOT_SIGNAL] = _arm_stacks(stacks)
    _page = page
    atexit.register(_exiting)
    return page


def _arm_stacks(stacks: IO[str]) -> int:
    """Register faulthandler on the first real-time signal nobody handles; its number
    (0: none could be registered, the agent then never signals this worker).

    The signal is ignored first (from the main thread), so that it is harmless once
    faulthandler lets it go at the interpreter's exit: a real-time signal's default action
    ends the process.
    """
    if not hasattr(signal, "SIGRTMIN"):
        return 0
    main = threading.current_thread() is threading.main_thread()
    for signum in range(signal.SIGRTMIN + 2, signal.SIGRTMAX):
        try:
            if signal.getsignal(signum) != signal.SIG_DFL:
                continue
            if main:
                signal.signal(signum, signal.SIG_IGN)
            faulthandler.register(signum, file=stacks, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError):
            continue
        return signum
    return 0


def _exiting() -> None:
    """At the interpreter's exit: no more stacks, and no more watching."""
    page = _page
    if page is not None:
        page[SLOT_SIGNAL] = 0
        page[SLOT_PAUSED] = 1


def pause(delta: int) -> None:
    """Add ``delta`` to the page's count of phases not watched for stalls (see
    ``aelastic.worker.paused``); the clock of the last progress restarts at the end."""
    page = _page
    if page is None:
        if _unavailable:
            return
        page = _attach()
        if page is None:
            return
    page[SLOT_PAUSED] = max(page[SLOT_PAUSED] + delta, 0)
    page[SLOT_TIME] = _monotonic_ns()


def _forget_after_fork() -> None:
    """A forked child (a data loader worker) must not write its parent's page."""
    global _page, _unavailable, _steps
    _page, _unavailable, _steps = None, True, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def forked_worker() -> None:
    """This forked process is a worker (fork start method): it reports its own progress
    (its environment names its page), counts torch's optimizer steps and watches its agent."""
    global _unavailable
    _unavailable = False
    install_torch_hook()
    watch_agent()


# -- torch's optimizer hook ---------------------------------------------------------------

_TORCH_MODULE = "torch.optim.optimizer"


def _on_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    progress()


def _register(module: ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:
        _keep.append(register(_on_optimizer_step))


class _ThenRegister:
    """The loader of ``torch.optim.optimizer``, registering the hook after it ran."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        spec = module.__spec__
        if spec is not None:  # leave no trace of the wrapper
            spec.loader = self._loader
        module.__loader__ = self._loader
        _register(module)


class _TorchWatch:
    """A meta path finder that wraps the loader of ``torch.optim.optimizer`` once."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _TORCH_MODULE:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenRegister(spec.loader)  # type: ignore[assignment]
        return spec

    def invalidate_caches(self) -> None:
        pass


def install_torch_hook() -> None:
    """Count optimizer steps as progress: now if torch's optimizer module is loaded, else
    as soon as it is."""
    module = sys.modules.get(_TORCH_MODULE)
    if module is not None:
        _register(module)
    elif not any(isinstance(f, _TorchWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatch())


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

#: Longest wait at exit for a gloo group's destruction (its threads may wait on a peer).
_DESTROY_BOUND = 10.0


def install_exit_hook() -> None:
    """Destroy a gloo default process group still alive when the interpreter exits.

    A script that leaves it alive (no ``destroy_process_group()``, an uncaught exception, a
    collective that broke because a peer died) has gloo's C++ threads torn down during the
    interpreter's finalization, which aborts the process ("terminate called without an
    active exception", SIGABRT) about one exit in four: the agent would see a crash where
    the script exited. Destroyed here, before finalization (after the script's own
    ``atexit`` handlers), in a thread waited for at most :data:`_DESTROY_BOUND` seconds.
    NCCL and other backends are left to the script, as under torchrun.
    """
    atexit.register(_destroy_gloo_group)


def _destroy_gloo_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if str(dist.get_backend()) != "gloo":
            return
    except Exception:
        return

    def destroy() -> None:
        try:  # noqa: SIM105 - contextlib is not worth importing in every worker
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to: the exit goes on
            pass

    thread = threading.Thread(target=destroy, name="aelastic-destroy-group", daemon=True)
    thread.start()
    thread.join(_DESTROY_BOUND)


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
