"""A TCP proxy for tests that cut connections without killing the processes at either end.

``TcpProxy(upstream_port)`` listens on a free loopback port and passes bytes both ways (two
threads per connection). ``cut()`` closes every connection through it (both ends read the
end of the stream, as when a proxy restarts) and stops listening; ``listen()`` listens again
on the same port; ``restart(down_for)`` is both.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

__all__ = ["TcpProxy"]


class TcpProxy:
    """See the module docstring."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream = (host, upstream_port)
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.listen()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            socks, self._socks = self._socks, set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restart(self, down_for: float) -> None:
        self.cut()
        time.sleep(down_for)
        self.listen()

    def close(self) -> None:
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
