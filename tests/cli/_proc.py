"""Run the ``aelastic`` command in a subprocess and watch its output line by line."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child ``aelastic`` (this checkout first on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


#: The signals a child's behaviour on a stop depends on. A test's child starts with each at
#: its default, never with what this process inherited (``nohup`` ignores SIGHUP, a
#: background job of a shell script SIGINT and SIGQUIT), unless the test says otherwise.
STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)


def signals_as(ignored: Collection[signal.Signals] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` starting a child with the :data:`STOP_SIGNALS` at their default,
    but ``ignored`` (as ``nohup`` or a shell's background job would start it)."""

    def setup() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)

    return setup


def sigint_as(disposition: str | None) -> Callable[[], None]:
    """A ``preexec_fn`` starting a child with SIGINT ``"default"`` or ``"ignored"`` (as a
    background job of a shell script inherits it), the other stop signals at their
    default; ``None``: ``"default"``."""
    ignored = {"default": (), None: (), "ignored": (signal.SIGINT,)}[disposition]
    return signals_as(ignored)


def _then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


class Cli:
    """``python -m aelastic <args>`` with stdout and stderr merged, read by a thread.

    It starts with the stop signals at their default (:data:`STOP_SIGNALS`); ``sigint``
    ``"ignored"`` starts it with SIGINT ignored (see :func:`sigint_as`), ``preexec`` with
    what that ``preexec_fn`` sets (run after the defaults are set).
    ``session`` starts it in a session (and process group) of its own, so that
    ``os.killpg(cli.proc.pid, ...)`` reaches it and nothing else.
    """

    def __init__(
        self,
        args: Sequence[str],
        cwd: Path,
        env: dict[str, str] | None = None,
        *,
        sigint: str | None = None,
        session: bool = False,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aelastic", *args],
            preexec_fn=_then(sigint_as(sigint), preexec),
            start_new_session=session,
            cwd=cwd,
            env=cli_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def _pump(self, timeout: float) -> bool:
        try:
            line = self._new.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if line is None:
            self._new.put(None)
            return False
        self.lines.append(line)
        return True

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float = 60) -> None:
        """Block until ``predicate(lines so far)`` holds (AssertionError on timeout or exit)."""
        deadline = time.monotonic() + timeout
        while not predicate(self.lines):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._pump(remaining):
                if predicate(self.lines):
                    return
                raise AssertionError("output never matched:\n" + self.output)

    def wait(self, timeout: float = 60) -> int:
        """Wait for the exit; the exit code (the output is complete afterwards)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self._reader.join(5.0)
            while self._pump(0):  # what it printed before it was killed
                pass
            raise AssertionError("aelastic did not exit:\n" + self.output) from None
        self._reader.join(timeout)
        while self._pump(0):
            pass
        return code

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def __enter__(self) -> Cli:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run_cli(
    args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, str]:
    """Run ``python -m aelastic <args>`` to the end; (exit code, merged output)."""
    with Cli(args, cwd, env) as cli:
        code = cli.wait(timeout)
        return code, cli.output


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            state = fp.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
