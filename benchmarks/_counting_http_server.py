"""aelastic's HTTP rendezvous server with traffic counters, for ``rdzv_scale.py``.

Serves the same application as ``aelastic serve`` (``create_app()``, no token, no
persistence; the same event loop and collector settings) on a loopback port, with one more
middleware, outermost, that counts every answered request and the bytes of its answer: the
body exactly, the head (status line and headers) as aiohttp writes it, up to a few bytes;
opening a rendezvous channel (a WebSocket) is a request (its ``101`` answer the bytes), and
so is each answer on it (its frame the bytes). ``GET /_bench/stats`` (not counted itself)
answers ``{"requests", "bytes_out", "connections"}``, where ``connections`` is the number of
distinct client sockets that sent a request.

Run: ``python -m benchmarks._counting_http_server [--port 0]``; prints
``listening on http://127.0.0.1:PORT`` once it accepts connections, serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import http, web

from aelastic.backends.http.server import create_app
from aelastic.backends.http.server._channel import TAPS
from aelastic.backends.http.server._loop import run
from aelastic.backends.http.wire import CHANNEL_PATH
from benchmarks._scale_node import raise_fd_limit

STATS_PATH = "/_bench/stats"

#: Head bytes aiohttp adds when it sends an answer: ``Date: <29 chars>\r\n`` and ``Server``.
_ADDED_HEAD = len("Date: Sun, 06 Nov 1994 08:49:37 GMT\r\n") + len(
    f"Server: {http.SERVER_SOFTWARE}\r\n"
)

#: Bytes of the answer opening a channel: ``101 Switching Protocols`` and its headers.
_UPGRADE_HEAD = (
    len("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n")
    + len("Sec-WebSocket-Accept: \r\n")
    + 28  # base64 of a SHA-1
    + _ADDED_HEAD
    + 2
)


def answer_size(response: web.StreamResponse) -> int:
    """Bytes aiohttp writes for ``response``: status line, headers, blank line, body."""
    body = getattr(response, "body", None)
    length = len(body) if isinstance(body, bytes | bytearray) else (response.content_length or 0)
    head = len(f"HTTP/1.1 {response.status} {response.reason}\r\n") + 2 + _ADDED_HEAD
    head += sum(len(k) + len(v) + 4 for k, v in response.headers.items())
    if "Content-Length" not in response.headers:
        head += len(f"Content-Length: {length}\r\n")
    return head + length


class Counters:
    """Requests answered, bytes written, client sockets seen."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes_out = 0
        self.peers: set[Any] = set()

    def middleware(self) -> Any:
        @web.middleware
        async def counting(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            if request.path.endswith(CHANNEL_PATH):  # counted when it opens, not when it ends
                self.requests += 1
                self.bytes_out += _UPGRADE_HEAD
                if request.transport is not None:
                    self.peers.add(request.transport.get_extra_info("peername"))
                return await handler(request)
            response = await handler(request)
            if request.path != STATS_PATH:
                self.requests += 1
                self.bytes_out += answer_size(response)
                transport = request.transport
                if transport is not None:
                    self.peers.add(transport.get_extra_info("peername"))
            return response

        return counting

    def channel_answer(self, status: int, size: int) -> None:
        """An answer on a channel (WebSocket): counted as a request, its frame as bytes."""
        self.requests += 1
        self.bytes_out += size + (2 if size < 126 else 4 if size < 65536 else 10)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"requests": self.requests, "bytes_out": self.bytes_out, "connections": len(self.peers)}
        )


async def serve(port: int, also: list[str]) -> None:
    counters = Counters()
    app = create_app(token="")
    app.middlewares.insert(0, counters.middleware())
    app[TAPS].append(counters.channel_answer)
    app.router.add_get(STATS_PATH, counters.stats)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
        await site.start()
        chosen = runner.addresses[0][1]
        for address in also:  # the same server on more loopback addresses, the same port
            await web.TCPSite(runner, address, chosen, backlog=4096).start()
        print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--also", nargs="*", default=[], help="more addresses to listen on")
    args = parser.parse_args()
    raise_fd_limit()
    run(serve(args.port, args.also))  # as aelastic serve runs: uvloop when installed, its collector
    return 0


if __name__ == "__main__":
    sys.exit(main())
