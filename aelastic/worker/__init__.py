"""Progress reports from inside a worker, for hang detection (on by default).

A training script needs nothing of this module: under ``aelastic run`` every optimizer step
(torch's global optimizer step hook, registered by the worker's bootstrap before the script
runs) counts as progress, the agent learns the job's step times from them, and a phase
without steps that works (an evaluation, a checkpoint being written) is seen to work from
outside. A phase that may sit idle without steps for longer than that (waiting for a file,
sleeping between phases, a wait outside torch) can say it is alive with :func:`progress`::

    import aelastic.worker

    while not os.path.exists(ready):
        time.sleep(1)
        aelastic.worker.progress()

or be left unwatched (the next gap between steps counts from its end)::

    with aelastic.worker.paused():
        wait_for_the_data_service()

A script can also survive a peer's loss without a process restart (in-place recovery, see
:class:`InPlace`)::

    state = {"model": model, "optimizer": optimizer, "step": 0}
    aelastic.worker.InPlace(state, backend="gloo").run(train)   # train(round) uses state

Progress costs well under a microsecond (three integers written to shared memory), needs no
torch, and does nothing outside an aelastic worker or when the agent does not watch for
hangs (``--stall-timeout 0``). The interpreter's exit is never watched.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

from ._inplace import GroupChanged, InPlace, Round

__all__ = ["GroupChanged", "InPlace", "Round", "paused", "progress", "reporting"]


def _runtime() -> ModuleType:
    """The bootstrap's runtime when the worker was started by an agent, else a fresh copy
    (one per process either way: its state is the process's progress)."""
    loaded = sys.modules.get("_aelastic_worker")
    if loaded is not None:
        return loaded
    from ._site import _aelastic_worker

    sys.modules["_aelastic_worker"] = _aelastic_worker
    return _aelastic_worker


_RUNTIME = _runtime()


def progress() -> None:
    """Report one unit of progress (a batch, a step) to the agent that watches this worker."""
    _RUNTIME.progress()


def reporting() -> bool:
    """Whether this process reports progress to an agent (true from the worker's start when
    the agent watches for hangs)."""
    return bool(_RUNTIME.attached())


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within the block, this worker is not watched for stalls; the time without progress
    counts from the end of the block."""
    _RUNTIME.pause(1)
    try:
        yield
    finally:
        _RUNTIME.pause(-1)
