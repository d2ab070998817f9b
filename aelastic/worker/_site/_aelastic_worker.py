"""The worker's side of progress reporting: a shared page, torch's optimizer hook, stacks.

How it works: the agent gives each worker a page of shared memory (a 4 KiB file on
``/dev/shm``, named by ``AELASTIC_PROGRESS_FILE``). At its start (:func:`start`, called by
the bootstrap, by a warm standby when it is released, by a forked worker) the worker maps
the page, writes its pid and main thread, and registers ``faulthandler`` on a free
real-time signal that it writes into the page: the agent sends that signal to a stalled
worker and ``faulthandler`` writes the Python stack of every thread to ``<page>.stacks``,
even while the main thread is blocked in C, before the first step too. Each progress
(:func:`progress`, called by torch's global optimizer step hook or by the script through
:mod:`aelastic.worker`) then writes three integers into the page: the gap since the last
progress into a ring of the last 256 (the agent learns the job's step times from it), the
steps and ``time.monotonic_ns()``: no system call, no lock (about 0.2 us, measured in
``benchmarks/hook_cost.py``). The page also says whether torch's optimizer hook is
registered (a torch worker: the agent watches it from its start) and whether the worker is
in a phase not watched (:func:`pause`). The agent reads the page.

The bootstrap (``sitecustomize.py`` beside this file) loads this module under the name
``_aelastic_worker`` before the user's code, installs :func:`install_torch_hook` (an import
hook that registers the optimizer hook as soon as ``torch.optim.optimizer`` is imported)
and calls :func:`start`; the worker's guards (its agent's beat, its error file) are
``_aelastic_guard.py``'s. Standard library only, and cheap to import: it runs in every
worker.
"""

from __future__ import annotations

import atexit
import faulthandler
import mmap
import os
import signal
import sys
import threading
import time
from types import ModuleType
from typing import IO, Any

__all__ = [
    "ENV_PAGE",
    "GAPS",
    "MAGIC",
    "PAGE_SIZE",
    "SLOT_GAPS",
    "SLOT_MAIN",
    "SLOT_PAUSED",
    "SLOT_PID",
    "SLOT_SIGNAL",
    "SLOT_STEPS",
    "SLOT_TIME",
    "SLOT_TORCH",
    "attached",
    "forked_worker",
    "install_torch_hook",
    "pause",
    "progress",
    "stacks_path",
    "start",
]

#: The worker's variable naming its page.
ENV_PAGE = "AELASTIC_PROGRESS_FILE"
#: Size of a page (bytes).
PAGE_SIZE = 4096
#: Slot 0 of a page the agent prepared ("AEP1", then the format version).
MAGIC = 0x0002_3150_4541
#: Slots of the page (unsigned 64-bit, native order).
SLOT_PID = 1
SLOT_STEPS = 2
SLOT_TIME = 3
SLOT_SIGNAL = 4
SLOT_MAIN = 5
SLOT_PAUSED = 6
SLOT_TORCH = 7
#: The ring of gaps: the gap (ns) before step ``n`` is at ``SLOT_GAPS + n % GAPS`` (0: not a
#: gap between two steps: the first step, the first after a pause).
SLOT_GAPS = 256
GAPS = 256
_GAP_MASK = GAPS - 1

_page: memoryview | None = None  # the page as unsigned 64-bit slots, once attached
_unavailable = False  # no page for this process: progress() is a no-op
_steps = 0
_last_ns = 0  # the last progress, or the end of a pause after one (0: none yet)
_torch = False  # torch's optimizer hook is registered
_keep: list[Any] = []  # the mapping and the stacks file, alive as long as the process
_monotonic_ns = time.monotonic_ns


def stacks_path(page_path: str) -> str:
    """Where the worker of ``page_path`` writes its stacks."""
    return page_path + ".stacks"


def progress() -> None:
    """One unit of progress (an optimizer step, a batch...): cheap, call it as often as you
    like. Does nothing when the process has no page."""
    global _steps, _last_ns
    page = _page
    if page is None:
        if _unavailable:
            return
        page = _attach()
        if page is None:
            return
    now = _monotonic_ns()
    steps = _steps = _steps + 1
    page[SLOT_GAPS + (steps & _GAP_MASK)] = now - _last_ns if _last_ns else 0
    _last_ns = now
    # The time first: a page with steps always has the time of a progress (the agent may
    # read between the two stores).
    page[SLOT_TIME] = now
    page[SLOT_STEPS] = steps


def start() -> None:
    """At the worker's start: map the page now when the environment names one, so that the
    agent can take the stacks of a worker that hangs before its first step."""
    if _page is None and not _unavailable and os.environ.get(ENV_PAGE):
        _attach()


def attached() -> bool:
    """Whether this process reports its progress to an agent (its page is mapped: from its
    start when the agent watches it)."""
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
    page[SLOT_TORCH] = int(_torch)
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
    ``aelastic.worker.paused``); the clock of the last progress restarts at the end, and
    the next step's gap counts from there."""
    global _last_ns
    page = _page
    if page is None:
        if _unavailable:
            return
        page = _attach()
        if page is None:
            return
    page[SLOT_PAUSED] = max(page[SLOT_PAUSED] + delta, 0)
    now = page[SLOT_TIME] = _monotonic_ns()
    if _last_ns:
        _last_ns = now


def _forget_after_fork() -> None:
    """A forked child (a data loader worker) must not write its parent's page."""
    global _page, _unavailable, _steps, _last_ns
    _page, _unavailable, _steps, _last_ns = None, True, 0, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def forked_worker() -> None:
    """This forked process is a worker (fork start method): it reports its own progress
    (its environment names its page) from its start and counts torch's optimizer steps."""
    global _unavailable
    _unavailable = False
    install_torch_hook()
    start()


# -- torch's optimizer hook ---------------------------------------------------------------

_TORCH_MODULE = "torch.optim.optimizer"


def _on_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    progress()


def _register(module: ModuleType) -> None:
    global _torch
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:
        _keep.append(register(_on_optimizer_step))
        _torch = True
        if _page is not None:
            _page[SLOT_TORCH] = 1


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
