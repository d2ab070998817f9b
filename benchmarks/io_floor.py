"""The machine's floor for one message: what bare asyncio code pays per message here, beside
what aelastic pays.

Why: the per-beat targets (a server's CPU per held beat; the nodes' CPU per beat, which sets
how many simulated nodes two cores can run) are partly the kernel's and the event loop's
price of a poll, a read and a write on loopback, which no code above them removes. This
measures that price on the machine at hand, with nothing of aelastic in the way:

- **server**: one process answers N connections, each sending a small message once a second
  at a phase of its own (the clients: bare protocol clients on uvloop, in two other
  processes); the server's CPU (user, system) per message, for a bare asyncio ``Protocol``
  echo on asyncio's loop and on uvloop, and for a bare aiohttp WebSocket echo on uvloop (what
  ``aelastic serve`` stands on: aiohttp, uvloop, a task per channel; its own figure per held
  beat is ``beat_cost_http.py``'s).
- **node**: one process holds N connections to a real redis-server, each sending one small
  command a second at a phase of its own from a timer callback (no task); its CPU per
  message on both loops. Then aelastic's own nodes in the same shape: N handlers over Redis
  (``share_connections=0``), formed, idle at 1 s beats with their watches waiting; CPU per
  beat, on both loops.

Run: ``python benchmarks/io_floor.py [--server-nodes 4096] [--client-nodes 2048] [--idle 10]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MESSAGE = b'{"op":"keep_alive","hold":1.0,"seen":"3f2a.17","beat":"k1"}'
COMMAND = b"*3\r\n$3\r\nSET\r\n$4\r\nbeat\r\n$13\r\n1700000000000\r\n"
SETTLE = 3.0  # seconds between the last connection and the window


def use_loop(kind: str) -> None:
    """Make ``asyncio.run`` use ``kind``'s loop (``asyncio`` or ``uvloop``)."""
    if kind == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class Usage:
    """CPU seconds (user, system) of this process between :meth:`start` and :meth:`stop`."""

    def start(self) -> None:
        self._before = resource.getrusage(resource.RUSAGE_SELF)
        self._wall = time.monotonic()

    def stop(self, messages: int) -> dict[str, Any]:
        after = resource.getrusage(resource.RUSAGE_SELF)
        user = after.ru_utime - self._before.ru_utime
        system = after.ru_stime - self._before.ru_stime
        count = max(messages, 1)
        return {
            "messages": messages,
            "seconds": round(time.monotonic() - self._wall, 2),
            "user_us": round(1e6 * user / count, 1),
            "system_us": round(1e6 * system / count, 1),
            "total_us": round(1e6 * (user + system) / count, 1),
        }


class _Counted(asyncio.Protocol):
    answered = 0
    goal = 0  # messages after which ``reached`` is set
    reached: asyncio.Event | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        _Counted.count()

    @staticmethod
    def count() -> None:
        _Counted.answered += 1
        if _Counted.reached is not None and _Counted.answered >= _Counted.goal:
            _Counted.reached.set()


class _Echo(_Counted):
    def data_received(self, data: bytes) -> None:
        _Counted.count()
        self.transport.write(data)


def _beat(loop: asyncio.AbstractEventLoop, protocol: _Counted, data: bytes) -> None:
    if protocol.transport.is_closing():
        return
    protocol.transport.write(data)
    loop.call_later(1.0, _beat, loop, protocol, data)


async def _spread(host: str, port: int, count: int, data: bytes) -> list[_Counted]:
    """``count`` bare connections, each writing ``data`` once a second at its own phase."""
    loop = asyncio.get_running_loop()
    made: list[_Counted] = []
    for _ in range(count):
        _, protocol = await loop.create_connection(_Counted, host, port)
        loop.call_later(random.random(), _beat, loop, protocol, data)
        made.append(protocol)
    return made


async def _ws_clients(port: int, count: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            ws = await session.ws_connect(f"http://127.0.0.1:{port}/ws", autoping=False)
            await asyncio.sleep(random.random())
            while True:
                await ws.send_bytes(MESSAGE)
                await ws.receive()
                await asyncio.sleep(1.0)

        await asyncio.gather(*(one() for _ in range(count)))


async def _clients(kind: str, port: int, count: int) -> None:
    if kind == "ws":
        await _ws_clients(port, count)
    else:
        await _spread("127.0.0.1", port, count, MESSAGE)
        await asyncio.sleep(1e9)


async def _serve(kind: str, nodes: int, idle: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    if kind == "ws":
        from aiohttp import WSMsgType, web

        async def channel(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(autoping=False)
            await ws.prepare(request)
            async for message in ws:
                if message.type is WSMsgType.BINARY:
                    _Counted.count()
                    await ws.send_bytes(message.data)
            return ws

        app = web.Application()
        app.router.add_get("/ws", channel)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
    else:
        server = await loop.create_server(_Echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    _Counted.goal, _Counted.reached = nodes, asyncio.Event()
    halves = [nodes // 2, nodes - nodes // 2]
    procs = [_spawn("clients", "ws" if kind == "ws" else "raw", str(port), str(n)) for n in halves]
    try:
        await _Counted.reached.wait()  # as many messages as connections: all are up
        await asyncio.sleep(SETTLE)
        usage, before = Usage(), _Counted.answered
        usage.start()
        await asyncio.sleep(idle)
        return usage.stop(_Counted.answered - before)
    finally:
        for proc in procs:
            proc.kill()


async def _bare_nodes(endpoint: str, nodes: int, idle: float) -> dict[str, Any]:
    host, port = endpoint.split("//")[1].split("/")[0].rsplit(":", 1)
    made = await _spread(host, int(port), nodes, COMMAND)
    await asyncio.sleep(SETTLE)
    usage, before = Usage(), _Counted.answered
    usage.start()
    await asyncio.sleep(idle)
    result = usage.stop(_Counted.answered - before)
    for protocol in made:
        protocol.transport.close()
    return result


async def _aelastic_nodes(endpoint: str, nodes: int, idle: float) -> dict[str, Any]:
    from aelastic import RendezvousParameters
    from aelastic.rendezvous import create_handler

    run_id = "floor-" + uuid.uuid4().hex[:8]
    handlers = [
        create_handler(
            RendezvousParameters(
                "redis", endpoint, run_id, nodes, nodes, local_addr="127.0.0.1",
                keep_alive_interval=1.0, share_connections=0, join_timeout=300,
            )
        )
        for _ in range(nodes)
    ]  # fmt: skip
    await asyncio.gather(*(h.next_rendezvous() for h in handlers))

    async def watch(handler: Any) -> None:
        view = None
        while True:
            view = await handler.watch(since=view)

    watches = [asyncio.ensure_future(watch(h)) for h in handlers]
    await asyncio.sleep(SETTLE)
    usage, before = Usage(), sum(h.stats.requests for h in handlers)
    usage.start()
    await asyncio.sleep(idle)
    result = usage.stop(sum(h.stats.requests for h in handlers) - before)
    for task in watches:
        task.cancel()
    await asyncio.gather(*watches, return_exceptions=True)
    await asyncio.gather(*(h.aclose() for h in handlers), return_exceptions=True)
    return result


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", *args], stdout=subprocess.PIPE
    )  # fmt: skip


def _measured(*args: str) -> dict[str, Any]:
    proc = _spawn(*args)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"io_floor {' '.join(args)} failed ({proc.returncode})")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def _role(argv: list[str]) -> None:
    role, rest = argv[0], argv[1:]
    if role == "clients":  # kind port count
        use_loop("uvloop")
        asyncio.run(_clients(rest[0], int(rest[1]), int(rest[2])))
    elif role == "server":  # kind loop nodes idle
        use_loop(rest[1])
        print(json.dumps(asyncio.run(_serve(rest[0], int(rest[2]), float(rest[3])))))
    elif role == "nodes":  # kind loop endpoint nodes idle
        use_loop(rest[1])
        run = _bare_nodes if rest[0] == "bare" else _aelastic_nodes
        print(json.dumps(asyncio.run(run(rest[2], int(rest[3]), float(rest[4])))))


def _row(what: str, loop: str, result: dict[str, Any], nodes: int, idle: float) -> str:
    rate = result["messages"] / max(result["seconds"], 1e-9) / nodes
    return (
        f"{what:<36} {loop:<8} {nodes:>6} {rate:>8.2f} {result['user_us']:>8.1f} "
        f"{result['system_us']:>8.1f} {result['total_us']:>8.1f}"
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        _role(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-nodes", type=int, default=4096)
    parser.add_argument("--client-nodes", type=int, default=2048)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from benchmarks._scale_node import raise_fd_limit
    from benchmarks._servers import server_endpoint

    raise_fd_limit()
    rows: list[dict[str, Any]] = []
    head = (
        f"{'what':<36} {'loop':<8} {'N':>6} {'msg/N/s':>8} {'user us':>8} {'sys us':>8} "
        f"{'CPU us':>8}"
    )
    print("CPU per message of the process named (user + system), N connections at 1 msg/s each")
    print(head + "\n" + "-" * len(head))
    cases = [
        ("server: bare asyncio echo", "raw", "asyncio"),
        ("server: bare asyncio echo", "raw", "uvloop"),
        ("server: bare aiohttp WebSocket echo", "ws", "uvloop"),
    ]
    for what, kind, loop in cases:
        n = args.server_nodes
        result = _measured("server", kind, loop, str(n), str(args.idle))
        rows.append({"what": what, "loop": loop, "nodes": n, **result})
        print(_row(what, loop, result, n, args.idle), flush=True)
    with server_endpoint("redis") as endpoint:
        nodes = (("node: bare command a second", "bare"), ("node: aelastic handler", "h"))
        for what, kind in nodes:
            for loop in ("asyncio", "uvloop"):
                n = args.client_nodes
                result = _measured("nodes", kind, loop, endpoint, str(n), str(args.idle))
                rows.append({"what": what, "loop": loop, "nodes": n, **result})
                print(_row(what, loop, result, n, args.idle), flush=True)
    if args.json:
        meta = {"load_average": list(os.getloadavg()), "idle": args.idle}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
