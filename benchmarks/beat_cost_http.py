"""What one held heartbeat costs ``aelastic serve``: its CPU per beat, bytes per beat.

The server is ``aelastic serve`` itself, in its own process, on a loopback port. N nodes,
each with its own WebSocket channel, join one run (min = max = N) and then send held
keep-alives as aelastic's client does (``hold`` = the 1 s interval, ``seen`` = the status's
token, ``beat`` = its beat key; the next beat goes when the answer comes), for an idle window
(``--idle`` s, after ``--settle`` s). Measured over the window: the server process's CPU
seconds (``/proc``) divided by the beats it answered, the bytes per beat (the answers'
WebSocket frames, counted by the nodes), the beats per node per second, whether any answer
was not brief (a change nobody caused), the server's memory (RSS) per node, and the shares
of its CPU spent in the kernel and in Python's garbage collector.

The nodes are light drivers spread over ``--procs`` processes (a bare WebSocket client on
uvloop, answers only counted), not aelastic handlers: this isolates the server's per-beat
work, the cost that bounds how many nodes one server core carries at 1 s beats (the whole
client, its watch and its news, is measured by ``rdzv_scale.py``).

Run: ``python benchmarks/beat_cost_http.py --nodes 4096 --idle 20 --runs 3``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from benchmarks._scale_servers import cpu_seconds, rss_bytes

_SECRET = "5ec2e7" * 6
_RUN = "beat-cost"


def _request(op: str, i: int, n: int) -> dict[str, Any]:
    return {
        "op": op, "node": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}_{1000 + i}_0",
        "min": n, "max": n, "last_call": 600_000, "window": 600_000, "expired": False,
        "finished": False, "port": 0, "secret": _SECRET,
    }  # fmt: skip


class _Socket:
    """A node's WebSocket channel, as lean as a client can be (the drivers share the
    machine's 2 cores with the server: aiohttp's client cost them more than the server)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Socket:
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET /v1/channel HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101 "):
            writer.close()
            raise ConnectionError(f"no channel: {head[:40]!r}")
        return cls(reader, writer)

    def send(self, text: str) -> None:
        payload = text.encode()
        size = len(payload)  # a client's frame is masked: with a key of zeros here
        head = bytes((0x81, 0x80 | size)) if size < 126 else b"\x81\xfe" + size.to_bytes(2, "big")
        self.writer.write(head + b"\0\0\0\0" + payload)

    async def receive(self) -> str:
        first, second = await self.reader.readexactly(2)
        size = second & 0x7F
        if size == 126:
            size = int.from_bytes(await self.reader.readexactly(2), "big")
        elif size == 127:
            size = int.from_bytes(await self.reader.readexactly(8), "big")
        data = await self.reader.readexactly(size)
        if first & 0x0F != 1:  # not text: the channel closes
            raise ConnectionError(f"frame of opcode {first & 0x0F}")
        return data.decode()


async def _nodes(endpoint: str, first: int, count: int, n: int, conn: Any) -> None:
    """Drive nodes ``first`` .. ``first + count - 1``: join, then beat until told to stop."""
    from aelastic.core.brief import beat_key
    from aelastic.core.wire import reply_from_json

    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    sockets: list[_Socket | None] = [None] * count
    opening = asyncio.Semaphore(64)

    async def join(k: int) -> Any:
        request = _request("join", first + k, n)
        for msg_id in range(100):  # held until the round completes (or 60 s)
            try:
                ws = sockets[k]
                if ws is None:  # (again if a loaded machine made it time out)
                    async with opening:
                        ws = sockets[k] = await _Socket.open(host, int(port))
                doc = {"id": msg_id, "run": _RUN, "request": request, "hold": 60}
                ws.send(json.dumps(doc))
                answer = json.loads(await ws.receive())
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                sockets[k] = None
                await asyncio.sleep(0.5)
                continue
            if "reply" not in answer:
                raise RuntimeError(f"join refused: {answer}")
            reply = reply_from_json(answer["reply"])
            if reply.status.complete:
                return reply
        raise RuntimeError("the round did not complete")

    replies = await asyncio.gather(*(join(k) for k in range(count)))
    status = max((r.status for r in replies), key=lambda s: s.now_ms)
    assert status.complete and status.world == n, status
    conn.send("joined")
    answers = [0, 0, 0]  # brief, whole, frame bytes

    async def beat(k: int) -> None:
        ws = sockets[k]
        assert ws is not None
        req = _request("keep_alive", first + k, n)
        msg_id = 1
        while True:  # as aelastic's client sends it: id first, compact
            doc = {"id": msg_id, "run": _RUN, "request": req, "hold": 1.0}
            doc.update(seen=status.token, beat=beat_key(status))
            ws.send(json.dumps(doc, separators=(",", ":")))
            text = await ws.receive()
            answers[0 if '"brief"' in text else 1] += 1
            size = len(text.encode())
            answers[2] += size + (2 if size < 126 else 4 if size < 65536 else 10)
            msg_id += 1

    tasks = [asyncio.create_task(beat(k)) for k in range(count)]
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command != "count":
            break
        conn.send(list(answers))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ws in sockets:
        if ws is not None:
            ws.writer.close()


def _user_system(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _driver(endpoint: str, first: int, count: int, n: int, conn: Any) -> None:
    import uvloop

    from benchmarks._scale_node import raise_fd_limit

    raise_fd_limit()
    uvloop.run(_nodes(endpoint, first, count, n, conn))


#: ``aelastic serve``, counting the CPU its garbage collector spends (written to the file
#: named by ``BEAT_COST_GC`` every second: collections and seconds per generation).
_SERVE = """
import gc, json, os, sys, threading, time
spent, start = [[0, 0.0] for _ in range(3)], [0.0]
def track(phase, info):
    if phase == 'start':
        start[0] = time.thread_time()
    else:
        spent[info['generation']][0] += 1
        spent[info['generation']][1] += time.thread_time() - start[0]
def dump():
    while True:
        time.sleep(1)
        with open(os.environ['BEAT_COST_GC'], 'w') as f:
            json.dump(spent, f)
if os.environ.get('BEAT_COST_GC'):
    gc.callbacks.append(track)
    threading.Thread(target=dump, daemon=True).start()
from aelastic.cli import main
sys.exit(main(['serve', *sys.argv[1:]]))
"""


#: A loaded machine may take long to send 4,096 upgrade requests: not what is measured.
_FLAGS = ["--read-timeout", "120", "--keepalive-timeout", "120"]


class _Server:
    """``aelastic serve`` on a free loopback port, in its own process."""

    def __init__(self, loop: str = "auto") -> None:
        self.gc_file = Path(tempfile.mkdtemp(prefix="beat-cost-")) / "gc.json"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SERVE,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *_FLAGS,
                *([] if loop == "auto" else ["--loop", loop]),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            cwd=self.gc_file.parent,  # aelastic from the installed package (or PYTHONPATH)
            env={
                **{k: v for k, v in os.environ.items() if k != "AELASTIC_HTTP_TOKEN"},
                "BEAT_COST_GC": str(self.gc_file),
            },
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if "listening on" not in line:
            self.process.kill()
            raise RuntimeError(f"aelastic serve did not start: {line!r}")
        self.endpoint = line.split()[-1]
        self.pid = self.process.pid

    def gc_seconds(self) -> list[list[float]]:
        """Collections and CPU seconds of each generation so far (up to a second old)."""
        try:
            return json.loads(self.gc_file.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return [[0, 0.0]] * 3

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def measure(
    n: int, procs: int, idle: float, settle: float, profile: Path | None = None, loop: str = "auto"
) -> dict[str, Any]:
    server = _Server(loop)
    ctx = multiprocessing.get_context("spawn")
    drivers = []
    try:
        empty = rss_bytes(server.pid)
        share = -(-n // procs)
        t0 = time.perf_counter()
        for first in range(0, n, share):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_driver, args=(server.endpoint, first, min(share, n - first), n, child)
            )
            p.start()
            drivers.append((p, parent))
        for _, conn in drivers:
            if conn.recv() != "joined":
                raise RuntimeError("a driver did not join")
        formed = time.perf_counter() - t0
        time.sleep(settle)

        def counts() -> list[int]:
            total = [0, 0, 0]
            for _, conn in drivers:
                conn.send("count")
                total = [a + b for a, b in zip(total, conn.recv(), strict=True)]
            return total

        c0, cpu0, t1 = counts(), cpu_seconds(server.pid), time.perf_counter()
        us0, gc0 = _user_system(server.pid), server.gc_seconds()
        load0 = os.getloadavg()[0]
        if profile is None:
            time.sleep(idle)
        elif profile.suffix == ".perf":  # perf samples the server, native frames included
            subprocess.run(
                ["perf", "record", "-F", "499", "-p", str(server.pid), "-o", str(profile),
                 "--", "sleep", str(idle)],
                check=True, capture_output=True,
            )  # fmt: skip
        else:  # py-spy samples the server over the window (its own CPU is not the server's)
            subprocess.run(
                ["py-spy", "record", "--pid", str(server.pid), "--duration", str(round(idle)),
                 "--rate", "200", "--format", "raw", "--output", str(profile), "--nonblocking"],
                check=True, capture_output=True,
            )  # fmt: skip
        c1, cpu1, t2 = counts(), cpu_seconds(server.pid), time.perf_counter()
        us1, gc1 = _user_system(server.pid), server.gc_seconds()
        load1 = os.getloadavg()[0]
        memory = rss_bytes(server.pid)
        beats, whole, size = (b - a for a, b in zip(c0, c1, strict=True))
        beats += whole
        cpu = cpu1 - cpu0
        return {
            "n": n,
            "loop": loop,
            "procs": procs,
            "formed_s": formed,
            "window_s": t2 - t1,
            "beats": beats,
            "server_cpu_s": cpu,
            "server_cpu_us_per_beat": cpu / beats * 1e6 if beats else None,
            "server_busy": cpu / (t2 - t1),
            "server_system_share": (us1[1] - us0[1]) / cpu if cpu else None,
            "server_gc_share": sum(b[1] - a[1] for a, b in zip(gc0, gc1, strict=True)) / cpu
            if cpu
            else None,
            "gc_collections": [
                [b[0] - a[0], round(b[1] - a[1], 3)] for a, b in zip(gc0, gc1, strict=True)
            ],
            "bytes_per_beat": size / beats if beats else None,
            "beats_per_node_s": beats / n / (t2 - t1),
            "whole_answers": whole,
            "rss_per_node": (memory - empty) / n,
            "load": [load0, load1],
        }
    finally:
        for _, conn in drivers:
            with contextlib.suppress(OSError):
                conn.send("stop")
        for p, _ in drivers:
            p.join(30)
            if p.is_alive():
                p.kill()
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4096])
    parser.add_argument("--procs", type=int, default=2, help="driver processes")
    parser.add_argument("--idle", type=float, default=20.0, help="the measured window (s)")
    parser.add_argument("--settle", type=float, default=3.0, help="pause before it (s)")
    parser.add_argument("--runs", type=int, default=1, help="runs per N (medians reported)")
    parser.add_argument("--label", default="run")
    parser.add_argument("--loop", default="auto", help="aelastic serve --loop")
    parser.add_argument("--json", type=Path, help="save the results here")
    parser.add_argument("--profile", type=Path, help="py-spy's samples of the server (raw)")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"label": args.label, "cases": []}
    for n in args.nodes:
        runs = []
        for _ in range(args.runs):
            r = measure(n, args.procs, args.idle, args.settle, args.profile, args.loop)
            runs.append(r)
            print(
                f"N={n}: server CPU {r['server_cpu_us_per_beat']:.1f} us/beat "
                f"({r['server_busy']:.0%} busy, {r['server_system_share']:.0%} in the kernel, "
                f"{r['server_gc_share']:.0%} collecting garbage {r['gc_collections']}), "
                f"{r['bytes_per_beat']:.0f} B/beat, "
                f"{r['beats_per_node_s']:.2f} beats/node/s, {r['whole_answers']} whole, "
                f"RSS {r['rss_per_node'] / 1024:.1f} KB/node, formed {r['formed_s']:.1f} s, "
                f"load {r['load'][0]:.1f}-{r['load'][1]:.1f}",
                flush=True,
            )
        median = statistics.median(r["server_cpu_us_per_beat"] for r in runs)
        print(f"N={n}: median server CPU {median:.1f} us/beat over {len(runs)} run(s)")
        results["cases"].append({"n": n, "median_us_per_beat": median, "runs": runs})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
