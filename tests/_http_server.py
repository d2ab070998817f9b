"""Real aelastic HTTP rendezvous servers for tests: in a subprocess, or in the test's loop.

``HttpServer`` runs ``python -m aelastic serve`` on a free loopback port::

    with HttpServer(token="s3cret", persist="/tmp/runs.json") as server:
        params = RendezvousParameters("http", server.endpoint, run_id, 1, 1, token="s3cret")
        ...
        server.stop()     # SIGTERM, waits for the exit (the persistence file is flushed)
        server.kill()     # SIGKILL: a crash
        server.start()    # again, on the same port (same url)

* ``HttpServer(token=None, persist=None, port=None, max_body=None)``: ``token`` sets
  AELASTIC_HTTP_TOKEN for the server (``None``: no auth); ``persist`` is a path for
  ``--persist``; ``port`` defaults to a free one, kept across restarts. ``max_body`` (which
  ``aelastic serve`` has no flag for) runs ``run_server(max_body=...)`` the way the command
  does instead. ``host`` (default ``127.0.0.1``) is the loopback address it listens on
  (``127.0.0.2``: not ``localhost``, as a server on another machine).
* ``start(timeout=30)`` returns once the server printed that it listens (it then accepts
  connections); it raises ``RuntimeError`` with the server's stderr if it exits instead.
  ``url`` is ``http://127.0.0.1:PORT``, ``endpoint`` is ``127.0.0.1:PORT``.
* ``stop(timeout=30)`` / ``kill()`` return the exit status; ``running``; ``stderr`` (text so
  far). The context manager starts it and always kills what is left.

``serve_in_loop(**create_app_kwargs)`` is an async context manager running the server's
app in the current event loop on a free loopback port; it yields the URL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests._ports import free_port

__all__ = ["HttpServer", "free_port", "serve_in_loop"]

_ROOT = Path(__file__).resolve().parent.parent
_READY = "aelastic rendezvous server listening on "
#: ``aelastic serve`` with a ``max_body``: argv is host, port, persist ("" for none), max_body.
_SERVE_WITH_MAX_BODY = (
    "import logging, sys\n"
    "from aelastic.backends.http.server import run_server\n"
    "logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(name)s: %(message)s')\n"
    "host, port, persist, max_body = sys.argv[1:]\n"
    "run_server(host, int(port), persist_path=persist or None, max_body=int(max_body))\n"
)


class HttpServer:
    """A real rendezvous server in a subprocess (see the module docstring)."""

    def __init__(
        self,
        token: str | None = None,
        persist: str | os.PathLike[str] | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        max_body: int | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.token = token
        self.host = host
        self.persist = None if persist is None else str(persist)
        self.port = free_port() if port is None else port
        self.extra_args = extra_args
        self.max_body = max_body
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: Any = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` (what ``--rdzv-endpoint`` takes)."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's id (it must have been started)."""
        assert self._proc is not None, "the server was never started"
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def stderr(self) -> str:
        """What the server wrote to stderr so far (this start and the earlier ones)."""
        if self._stderr is None:
            return ""
        self._stderr.flush()
        return Path(self._stderr.name).read_text(errors="replace")

    def start(self, timeout: float = 30.0) -> HttpServer:
        """Start the server and wait until it listens.

        Raises:
            RuntimeError: It is already running, exited, or did not get ready in time.
        """
        if self.running:
            raise RuntimeError("the server is already running")
        env = dict(os.environ)
        env.pop("AELASTIC_HTTP_TOKEN", None)
        if self.token is not None:
            env["AELASTIC_HTTP_TOKEN"] = self.token
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        if self.max_body is not None:
            cmd = [sys.executable, "-c", _SERVE_WITH_MAX_BODY, self.host, str(self.port)]
            cmd += [self.persist or "", str(self.max_body)]
        else:
            cmd = [sys.executable, "-m", "aelastic", "serve", "--host", self.host]
            cmd += ["--port", str(self.port), *self.extra_args]
            if self.persist is not None:
                cmd += ["--persist", self.persist]
        if self._stderr is None:
            self._stderr = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in kill())
                "w+", prefix="aelastic-http-", suffix=".log"
            )
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env, cwd=_ROOT
        )
        ready = threading.Event()
        listening: list[bool] = []
        watcher = threading.Thread(target=self._watch, args=(self._proc, ready, listening))
        watcher.daemon = True
        watcher.start()
        if not ready.wait(timeout) or not listening:
            status = self.kill()
            raise RuntimeError(
                f"the HTTP rendezvous server did not start (exit status {status}):\n{self.stderr}"
            )
        return self

    @staticmethod
    def _watch(proc: subprocess.Popen[str], ready: threading.Event, listening: list[bool]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(_READY):
                listening.append(True)
                ready.set()
        ready.set()  # exited before listening: start() raises

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait for the exit (SIGKILL after ``timeout``); the exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return self._reap()

    def kill(self) -> int | None:
        """SIGKILL the server (a crash); the exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        return self._reap()

    def _reap(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def close(self) -> None:
        """Kill the server if it runs and remove its log."""
        self.kill()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> HttpServer:
        try:
            return self.start()
        except BaseException:
            self.close()  # (its log file too: __exit__ is not called)
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.asynccontextmanager
async def serve_in_loop(**kwargs: Any) -> AsyncIterator[str]:
    """Run ``create_app(**kwargs)`` in this event loop on a free loopback port; yield its URL."""
    from aiohttp import web

    from aelastic.backends.http.server import create_app

    kwargs.setdefault("token", "")
    runner = web.AppRunner(create_app(**kwargs), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
