"""The agent's side of worker progress: the bootstrap on the workers' path, and their pages.

How it works: every worker starts with aelastic's bootstrap directory first on its
``PYTHONPATH`` (:func:`with_bootstrap`; the bootstrap takes it off again, see
:mod:`aelastic.worker._site.sitecustomize`), so Python workers count optimizer steps and
write torch's error file without a line of the script changed. When the agent watches for
stalls, each worker of an attempt also gets a page (:class:`ProgressPages`): a 4 KiB file
on ``/dev/shm`` (memory, never disk) that the worker maps and writes and the agent maps
read-only: its pid, steps, last progress, stacks signal, whether it is paused or a torch
worker, and a ring of the gaps before its last 256 steps (:meth:`ProgressPages.gaps`).
Reading a page is a few loads from memory: the agent looks at the pages only when a
deadline computed from them passes (see :mod:`aelastic.agent.health.stall`), never per step.
``AELASTIC_WORKER_BOOTSTRAP=0`` in the agent's environment leaves the workers' path alone.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ...worker._site import _aelastic_worker as runtime

__all__ = [
    "BOOTSTRAP_DIR",
    "ENV_PAGE",
    "PageReading",
    "ProgressPages",
    "with_bootstrap",
    "without_bootstrap",
]

#: The directory holding the workers' ``sitecustomize.py``.
BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(runtime.__file__))
#: The worker's variable naming its page.
ENV_PAGE = runtime.ENV_PAGE
_SWITCH = "AELASTIC_WORKER_BOOTSTRAP"


def with_bootstrap(
    env: MutableMapping[str, str], agent_env: Mapping[str, str] | None = None
) -> None:
    """Put the bootstrap directory first on ``env``'s ``PYTHONPATH`` (unless the agent's
    environment says ``AELASTIC_WORKER_BOOTSTRAP=0``)."""
    switch = (os.environ if agent_env is None else agent_env).get(_SWITCH, "1").strip()
    if switch in ("0", "false", "no", "off"):
        return
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entries[:1] != [BOOTSTRAP_DIR]:
        env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *entries])


def without_bootstrap(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as the bootstrap leaves it once it ran: its directory off ``PYTHONPATH``."""
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in entries if p != BOOTSTRAP_DIR]
    if kept == entries:
        return dict(env)
    result = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if kept:
        result["PYTHONPATH"] = os.pathsep.join(kept)
    return result


@dataclass(frozen=True)
class PageReading:
    """What a worker's page says.

    Attributes:
        pid: The process that attached (0: none yet).
        steps: Progress reported so far.
        last_ns: ``time.monotonic_ns()`` of the last progress (the machine's monotonic clock).
        stack_signal: The signal that makes the worker dump its stacks (0: none armed).
        main_thread: The ident of the worker's main thread.
        paused: The worker is in a phase not watched (``aelastic.worker.paused()``, or
            its interpreter's exit).
        torch: Its bootstrap registered torch's optimizer hook (it will step).
    """

    pid: int
    steps: int
    last_ns: int
    stack_signal: int
    main_thread: int
    paused: bool = False
    torch: bool = False

    def last_progress(self) -> float | None:
        """Monotonic time (seconds) of the last progress, or ``None`` when the worker is not
        watched now: no progress yet, paused, or a page read half-written (steps without
        the time of the first one)."""
        if not self.steps or not self.last_ns or self.paused:
            return None
        return self.last_ns / 1e9


def _shared_dir() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class ProgressPages:
    """One page per local rank for an attempt (removed by :meth:`close`).

    Raises:
        OSError: The pages cannot be made.
    """

    def __init__(self, local_world_size: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="aelastic-progress-", dir=_shared_dir())
        self._views: dict[int, tuple[mmap.mmap, memoryview]] = {}
        try:
            for rank in range(local_world_size):
                blank = bytearray(runtime.PAGE_SIZE)
                memoryview(blank).cast("Q")[0] = runtime.MAGIC
                with open(self.path(rank), "wb") as f:
                    f.write(blank)
                open(self.stacks_file(rank), "wb").close()
                with open(self.path(rank), "rb") as f:
                    mapping = mmap.mmap(f.fileno(), runtime.PAGE_SIZE, access=mmap.ACCESS_READ)
                self._views[rank] = (mapping, memoryview(mapping).cast("Q"))
        except BaseException:
            self.close()
            raise

    def path(self, local_rank: int) -> str:
        """The page of ``local_rank``."""
        return os.path.join(self.dir, str(local_rank))

    def stacks_file(self, local_rank: int) -> str:
        """Where the worker of ``local_rank`` dumps its stacks."""
        return runtime.stacks_path(self.path(local_rank))

    def env(self, local_rank: int) -> dict[str, str]:
        """The variables that give the worker of ``local_rank`` its page."""
        return {ENV_PAGE: self.path(local_rank)}

    def read(self, local_rank: int) -> PageReading:
        """The page of ``local_rank`` now (values written concurrently may be one step old)."""
        page = self._views[local_rank][1]
        return PageReading(
            pid=page[runtime.SLOT_PID],
            steps=page[runtime.SLOT_STEPS],
            last_ns=page[runtime.SLOT_TIME],
            stack_signal=page[runtime.SLOT_SIGNAL],
            main_thread=page[runtime.SLOT_MAIN],
            paused=page[runtime.SLOT_PAUSED] > 0,
            torch=page[runtime.SLOT_TORCH] > 0,
        )

    def gaps(self, local_rank: int, steps: int) -> list[float]:
        """The gaps (seconds) before the recent steps of ``local_rank``, given its
        ``steps`` as read: the last 255 (the oldest slot of the ring may be being
        rewritten), without the first step's (the start is no gap) or a paused one's."""
        page = self._views[local_rank][1]
        first = max(2, steps - runtime.GAPS + 2)
        mask = runtime.GAPS - 1
        ring = page[runtime.SLOT_GAPS : runtime.SLOT_GAPS + runtime.GAPS].tolist()
        return [ring[k & mask] / 1e9 for k in range(first, steps + 1) if ring[k & mask]]

    def close(self) -> None:
        """Unmap and remove the pages."""
        views, self._views = self._views, {}
        for mapping, view in views.values():
            view.release()
            mapping.close()
        shutil.rmtree(self.dir, ignore_errors=True)
