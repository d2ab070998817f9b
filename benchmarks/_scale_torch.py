"""torch's c10d rendezvous for ``rdzv_scale.py``: the store host and the nodes.

``python -m benchmarks._scale_torch host``: a ``TCPStore`` server on a loopback port and, in
front of it, a TCP proxy that counts the bytes the store sends to its clients (and the
connections). Prints ``proxy on 127.0.0.1:PORT``; on each ``stats`` line of stdin it prints
``{"bytes_out", "bytes_in", "connections"}``; ends with its stdin.

``python -m benchmarks._scale_torch nodes SPEC``: N nodes as threads, each torch's own
``DynamicRendezvousHandler`` over ``C10dRendezvousBackend`` with its own ``TCPStore`` client
(``get_rendezvous_handler`` with backend ``c10d`` and ``is_host=False``, as torchrun builds
it), all pointed at the proxy. Speaks the protocol of ``benchmarks/_scale_node.py``
(``ready``, ``form``, ``formed``/``failed``, ``exit``); no watch, no stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

from benchmarks._scale_node import Emitter, raise_fd_limit

_CHUNK = 1 << 16


class ByteCountingProxy:
    """Forwards every client connection to ``upstream`` and counts what flows."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self.bytes_out = 0  # store -> clients
        self.bytes_in = 0  # clients -> store
        self.connections = 0

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, outbound: bool
    ) -> None:
        try:
            while data := await reader.read(_CHUNK):
                if outbound:
                    self.bytes_out += len(data)
                else:
                    self.bytes_in += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, outbound=False),
            self._pump(up_reader, writer, outbound=True),
        )

    async def serve(self, started: threading.Event, port: list[int]) -> None:
        server = await asyncio.start_server(self._client, "127.0.0.1", 0, backlog=4096)
        port.append(server.sockets[0].getsockname()[1])
        started.set()
        async with server:
            await server.serve_forever()


def host() -> int:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    proxy = ByteCountingProxy(("127.0.0.1", store.port))
    started, port = threading.Event(), []
    thread = threading.Thread(target=lambda: asyncio.run(proxy.serve(started, port)), daemon=True)
    thread.start()
    started.wait()
    print(f"proxy on 127.0.0.1:{port[0]}", flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            stats = {
                "bytes_out": proxy.bytes_out,
                "bytes_in": proxy.bytes_in,
                "connections": proxy.connections,
            }
            print(json.dumps(stats), flush=True)
    os._exit(0)


def nodes(spec: dict[str, Any]) -> int:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    emit = Emitter()
    n = spec["nodes"]
    handlers = [
        get_rendezvous_handler(
            RendezvousParameters(
                "c10d",
                spec["endpoint"],
                spec["run_id"],
                n,
                n,
                local_addr="127.0.0.1",
                is_host=False,
                **spec["config"],
            )
        )
        for _ in range(spec["count"])
    ]
    at: list[float] = []
    go = threading.Event()

    def node(index: int, handler: Any) -> None:
        go.wait()
        time.sleep(max(at[0] - time.time(), 0.0))
        try:
            info = handler.next_rendezvous()
        except Exception as exc:
            emit(ev="failed", i=index, t=time.time(), error=repr(exc))
            return
        emit(ev="formed", i=index, t=time.time(), rank=info.rank, world=info.world_size, node="")

    for index, handler in enumerate(handlers):
        threading.Thread(target=node, args=(index, handler), daemon=True).start()
    emit(ev="ready", pid=os.getpid(), count=len(handlers))
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "form":
            at.append(command["at"])
            go.set()
        elif command["cmd"] == "stats":
            emit(ev="stats", wakeups=-1, t=time.time())
        elif command["cmd"] == "exit":
            break
    emit(ev="bye", clean=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(0)  # torch's heartbeat timers and store clients are not torn down one by one


def main() -> int:
    raise_fd_limit()
    if sys.argv[1] == "host":
        return host()
    return nodes(json.loads(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
