"""What a run holds for its whole length: its directories, its fork server, its seat.

How it works: a :class:`RunPlace` is made with the agent and opened when ``run()`` starts:
a scratch directory for the payloads of callable workers, the run's own log directory
(torch's ``<log_dir>/<run_id>_<random>``), the fork server of a callable under ``fork``
(made before the event loop's threads exist when the run is blocking: :meth:`prefork`). It
remembers whether this node joined the rendezvous and its current round
(:class:`~.membership.RoundGroup`), and removes what the run made when it closes (the
scratch, a log root that holds only error files already read).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from ..api import ProcessFailure, WorkerSpec
from ..health.errors import kept_failures, logs_disposable
from ..output.logs import run_log_dir
from ..processes.forks import ForkServer, fork_server_for
from .membership import RoundGroup

__all__ = ["RunPlace"]


@dataclass(eq=False)
class RunPlace:
    """The run's directories, fork server and seat in the rendezvous (see the module
    docstring).

    Attributes:
        spec: What the run runs.
        run_dir: The run's own log directory (``None``: no files, ``os.devnull``).
        scratch: Where callables' payloads go (``None``: a command runs).
        forks: The fork server of a callable under ``fork`` (``None``: none).
        joined: This node joined the rendezvous (it leaves it at the end).
        round: The round of this node's current group, once one formed.
    """

    spec: WorkerSpec
    run_dir: str | None = None
    scratch: str | None = None
    forks: ForkServer | None = None
    joined: bool = False
    round: RoundGroup | None = None
    _own_log_root: str | None = None

    def prefork(self) -> None:
        """Start the fork server now, if the run needs one and has none (before an event
        loop's threads exist: a safe state to fork from)."""
        self.forks = self.forks or fork_server_for(self.spec)

    def open(self, run_id: str) -> None:
        """Make the run's directories (and its fork server, if not made before)."""
        self.prefork()
        if not isinstance(self.spec.entrypoint, str):  # payloads of callables
            self.scratch = tempfile.mkdtemp(prefix="aelastic_agent_")
        self.run_dir, self._own_log_root = run_log_dir(self.spec, run_id)

    def kept(self, failures: Mapping[int, ProcessFailure]) -> dict[int, ProcessFailure]:
        """``failures`` as reported: error files removed with the run named so."""
        return kept_failures(self.spec, self._own_log_root, failures)

    async def close(self) -> None:
        """Close the fork server and remove what the run made."""
        forks, self.forks = self.forks, None
        if forks is not None:
            await forks.aclose()
        own = self._own_log_root if logs_disposable(self.spec) else None
        for path in (self.scratch, own):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        self.scratch = None
