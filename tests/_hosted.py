"""A node hosting torch's ``c10d`` rendezvous as an agent does, for tests that need the host
to outlive their own nodes: the hosting backend runs on an event loop of its own, in a
thread of the test process."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aelastic import RendezvousParameters
from aelastic.backends import create_backend
from tests._ports import free_port


class HostingAgent:
    """``with HostingAgent("c10d") as host:`` serves at ``host.endpoint`` until the block ends."""

    def __init__(self, name: str = "c10d") -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        params = RendezvousParameters(
            name, self.endpoint, "hosting-agent", 1, 1, is_host="true", close_timeout=0
        )
        self._backend: Any = create_backend(params)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def __enter__(self) -> HostingAgent:
        self._thread.start()
        self._call(self._backend.snapshot())  # the first request makes it host
        assert self._backend.hosts, "the hosting agent did not host"
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self._backend.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()
