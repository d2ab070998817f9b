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
did not, and told to the agent at once on its socket, before the interpreter's teardown).
Standard library only, and cheap to import: it runs in every worker.
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
    "ENV_AGENT_SOCKET",
    "ENV_PAGE",
    "MAGIC",
    "PAGE_SIZE",
    "RAISED_LIMIT",
    "SLOT_MAIN",
    "SLOT_PAUSED",
    "SLOT_PID",
    "SLOT_SIGNAL",
    "SLOT_STEPS",
    "SLOT_TIME",
    "attached",
    "forked_worker",
    "install_excepthook",
    "install_torch_hook",
    "pause",
    "progress",
    "stacks_path",
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
    (its environment names its page) and counts torch's optimizer steps."""
    global _unavailable
    _unavailable = False
    install_torch_hook()


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


# -- uncaught exceptions ------------------------------------------------------------------


def install_excepthook() -> None:
    """Write an uncaught exception to ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record``
    format) unless something wrote it already, and tell the agent that the script raised
    (:func:`_tell_agent`); then print it as before."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        try:
            if not issubclass(kind, (SystemExit, KeyboardInterrupt)):
                text = "".join(traceback.format_exception(kind, value, tb))
                _write_error_file(kind, value, text)
                _tell_agent(text)
        except Exception:  # never hide the user's exception behind ours
            pass
        previous(kind, value, tb)

    sys.excepthook = hook


#: The agent's socket for its workers (``aelastic.worker._inplace.ENV_SOCKET``).
ENV_AGENT_SOCKET = "AELASTIC_INPLACE_SOCKET"
#: The end of a traceback sent to the agent, at most (characters): the innermost frames
#: and the message.
RAISED_LIMIT = 8192
#: Seconds the worker gives the agent's socket to take the news (it is local).
_TELL_TIMEOUT = 1.0


def _tell_agent(text: str) -> None:
    """Say ``{"op": "raised", "pid", "error"}`` on the agent's socket, if it gave one.

    Why: after an uncaught exception the interpreter's teardown can take seconds (measured:
    1.5 to 2.5 s of garbage collection once torch and its compiler stack are imported, on a
    loaded machine), and the agent learns of the failure only when the process exits. A
    collective that raised because a peer died is the agent's cue to have the rendezvous
    report the peer's departure (``agent/_supervise.py``): told now, it does not wait for
    the exit.
    """
    path = os.environ.get(ENV_AGENT_SOCKET)
    if not path:
        return
    import socket  # (here: not every worker raises)

    line = json.dumps({"op": "raised", "pid": os.getpid(), "error": text[-RAISED_LIMIT:]})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TELL_TIMEOUT)
        sock.connect(path)
        sock.sendall(line.encode() + b"\n")


def _write_error_file(kind: type[BaseException], value: BaseException, text: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or path == os.devnull or os.path.exists(path):
        return
    message = "".join(traceback.format_exception_only(kind, value)).strip()
    doc = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(doc, f)
