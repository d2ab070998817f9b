"""The agent's health check (``TORCHELASTIC_HEALTH_CHECK_PORT``), answered on its event loop.

How it works: torch 2.13's ``LocalElasticAgent`` reads ``TORCHELASTIC_HEALTH_CHECK_PORT``
and hands its ``HealthCheckServer`` a callback giving the agent's last progress time (the
file-timer watchdog's, or the current time while there is none, during the rendezvous and
at the exit barrier) with a 60 s timeout; the open-source server starts nothing (it only
logs "No health check server started"). aelastic serves it: from before the first rendezvous
until the agent ends, every connection to the port gets one HTTP/1.1 answer, whatever the
method or path, so both a TCP probe (connect) and an HTTP probe (``GET /healthz``) work::

    200 {"alive": true, "last_progress_time": 1732500000, "timeout": 60, "state": "HEALTHY",
         "restart_count": 0, "run_id": "job"}

The answer is written by the agent's own loop: an agent whose loop is stuck does not answer,
which is what the probe is for. While the node's workers are stalled (``--stall-timeout``)
or after workers outlived SIGKILL, the answer is ``503`` with ``"alive": false`` and a
``reason``. The progress time is the current time (the watchdog runs on
the same loop; there is no separate thread to fall behind). Hand-written on
``asyncio.start_server`` (about 40 lines) rather than aiohttp: the probe must work with the
base install, whose only dependency is anyio.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping

from ...core.race import wait_within

__all__ = ["PORT_VAR", "TIMEOUT", "HealthServer", "health_port"]

log = logging.getLogger("aelastic.agent")

#: The agent's environment variable naming the port (torch's name).
PORT_VAR = "TORCHELASTIC_HEALTH_CHECK_PORT"
#: Seconds without progress after which torch's server calls the agent dead.
TIMEOUT = 60

_MAX_REQUEST = 16 * 1024
_READ_TIMEOUT = 5.0


def health_port(env: Mapping[str, str] | None = None) -> int | None:
    """The port of ``TORCHELASTIC_HEALTH_CHECK_PORT`` (``None``: unset).

    Raises:
        ValueError: Not a port number (the message names the variable).
    """
    raw = (os.environ if env is None else env).get(PORT_VAR)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{PORT_VAR}={raw!r} is not a port number")
    return port


class HealthServer:
    """Answers health probes on ``port`` (see the module docstring).

    Args:
        port: The TCP port (0: any free one, see :attr:`port`).
        status: Extra fields of the answer (the agent's state, restart count, run id).
        host: The address to bind (default: every interface).
    """

    def __init__(
        self, port: int, status: Callable[[], Mapping[str, object]], host: str | None = None
    ) -> None:
        self.port = port
        self._status = status
        self._host = host
        self._server: asyncio.Server | None = None
        self._on_close: list[Callable[[], object]] = []

    def on_close(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the server closes."""
        self._on_close.append(callback)

    async def start(self) -> None:
        """Listen on the port.

        Raises:
            OSError: The port cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._answer, self._host, self.port, limit=_MAX_REQUEST
        )
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health check at port %d", self.port)

    async def aclose(self) -> None:
        """Stop listening (answers under way are cut)."""
        server, self._server = self._server, None
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await wait_within(server.wait_closed(), 1.0)

    def body(self) -> dict[str, object]:
        """The answer's JSON document."""
        return {
            "alive": True,
            "last_progress_time": int(time.time()),
            "timeout": TIMEOUT,
            **self._status(),
        }

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await wait_within(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                head = b""
            if not head:
                return  # a TCP probe (connect, close) or a client that said nothing
            body = self.body()
            payload = json.dumps(body).encode()
            head_only = head.startswith(b"HEAD ")
            status = b"200 OK" if body.get("alive", True) else b"503 Service Unavailable"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if head_only else payload)
            )
            await writer.drain()
        except OSError:
            pass  # the client went away
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
