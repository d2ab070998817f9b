"""A real ``aelastic serve`` under idle, slow and too many clients: nothing hangs it.

Raw sockets play the bad clients (idle connections, headers or a body one byte a second,
more connections than allowed); the aelastic HTTP client and plain HTTP play the good
ones, which must still be served. The server's log must hold no traceback.
"""

from __future__ import annotations

import asyncio
import json
import resource
import selectors
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from aelastic import RendezvousParameters
from aelastic.backends.http.client import create_backend
from tests._http_server import HttpServer, free_port
from tests._rendezvous_helpers import PROMPT

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
IDLE = 1600


@pytest.fixture
def many_files() -> Iterator[None]:
    """This process may open a few thousand sockets (its soft limit raised to the hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE + 512:
        pytest.skip(f"the hard open-file limit ({hard}) is too low for {IDLE} sockets")
    wanted = 65536 if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def accept_queue(port: int) -> int:
    """Connections the kernel completed on the listener at ``port`` and the server has not
    accepted yet (a listening socket's ``rx_queue`` in ``/proc/net/tcp``)."""
    local = f"0100007F:{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def open_idle(port: int, count: int, batch: int = 64) -> list[socket.socket]:
    """``count`` connected sockets that send nothing, opened ``batch`` at a time (each batch's
    connects in parallel), each batch once the server accepted the one before: past a full
    accept queue the kernel would leave connections the client thinks open and the server
    never saw, which no server could close."""
    socks: list[socket.socket] = []
    deadline = time.monotonic() + 60
    while len(socks) < count:
        sel = selectors.DefaultSelector()
        for _ in range(min(batch, count - len(socks))):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            socks.append(sock)
            sel.register(sock, selectors.EVENT_WRITE)
        pending = len(sel.get_map())
        while pending and time.monotonic() < deadline:
            for key, _ in sel.select(1.0):
                sel.unregister(key.fileobj)
                pending -= 1
        sel.close()
        assert not pending, f"{pending} connects did not finish"
        while accept_queue(port) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not accept_queue(port), "the server stopped accepting connections"
    for sock in socks:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    return socks


def wait_closed(socks: list[socket.socket], within: float) -> dict[int, bytes]:
    """Wait until the server closed every socket; what each received before (by index)."""
    sel = selectors.DefaultSelector()
    for index, sock in enumerate(socks):
        sel.register(sock, selectors.EVENT_READ, index)
    received: dict[int, bytes] = {}
    open_ = len(socks)
    deadline = time.monotonic() + within
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(0.5):
            sock, index = key.fileobj, key.data
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                received[index] = received.get(index, b"") + data
                continue
            sel.unregister(sock)
            open_ -= 1
    sel.close()
    assert not open_, f"{open_} of {len(socks)} idle connections still open after {within} s"
    return received


def server_fds(server: HttpServer) -> int:
    proc = server._proc
    assert proc is not None
    return len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))


def get(url: str, timeout: float = PROMPT) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url)
    return _send(request, timeout)


def post(
    url: str, body: dict[str, object], timeout: float = PROMPT
) -> tuple[int, dict[str, object]]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    return _send(request, timeout)


def _send(request: urllib.request.Request, timeout: float) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_clean_log(server: HttpServer) -> str:
    log = server.stderr
    assert "Traceback" not in log, log
    return log


async def real_client_round_trip(endpoint: str, run_id: str) -> float:
    """A store write and read through the aelastic HTTP client; how long it took."""
    started = time.monotonic()
    params = RendezvousParameters("http", endpoint, run_id, 1, 1, read_timeout=PROMPT)
    backend = create_backend(params)
    try:
        with anyio.fail_after(PROMPT):
            await backend.kv_set("k", b"v")
            assert await backend.kv_get(["k"]) == [b"v"]
    finally:
        await backend.aclose()
    return time.monotonic() - started


async def test_idle_connections_neither_lock_out_clients_nor_stay(
    many_files: None, run_id: str
) -> None:
    read_timeout = 10.0
    with HttpServer(extra_args=("--read-timeout", str(read_timeout))) as server:
        opened = time.monotonic()
        idle = open_idle(server.port, IDLE)
        # On a loaded machine the opening may outlast the timeout: the first ones are gone.
        all_open = time.monotonic() - opened < read_timeout - 1.0
        try:
            held = server_fds(server)
            took = await real_client_round_trip(server.endpoint, run_id)
            assert took < PROMPT
            assert get(server.url + "/v1/health")[0] == 200
            received = await asyncio.to_thread(wait_closed, idle, read_timeout + 3 * PROMPT)
            closed_after = time.monotonic() - opened
        finally:
            for sock in idle:
                sock.close()
        if all_open:
            assert held >= IDLE, f"the server held {held} descriptors, not {IDLE} connections"
        assert received == {}, "an idle connection was answered (refused?)"
        assert closed_after >= read_timeout - 1.0
        # Still serving afterwards, and no traceback (only a line about the slow clients).
        assert get(server.url + "/v1/health")[0] == 200
        log = assert_clean_log(server)
        assert "sent no complete request within 10 s (--read-timeout)" in log, log


async def test_the_open_file_limit_is_raised_and_fits_the_connections(
    many_files: None, tmp_path: Path, run_id: str
) -> None:
    """The incident: a soft limit of 1,024 and 1,100 idle sockets. The server lifts its soft
    limit to the hard one; with a hard limit of 1,024 too, it holds what fits, refuses the
    rest with 503 and one line, and serves a real client once idle ones time out."""
    port = free_port()
    log_path = tmp_path / "serve.log"

    def low_limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    # Long enough for the idle ones to be opened before the first of them times out, on a
    # loaded machine too: the limit must be reached while they are all there.
    read_timeout = 8
    cmd = [sys.executable, "-m", "aelastic", "serve", "--port", str(port)]
    cmd += ["--read-timeout", str(read_timeout)]
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before the loop is busy
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, text=True,
            preexec_fn=low_limits,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            assert "listening on" in proc.stdout.readline()
            idle = open_idle(port, 1100)
            try:
                took = await real_client_round_trip(f"127.0.0.1:{port}", run_id)
                assert took < read_timeout + PROMPT
                received = await asyncio.to_thread(wait_closed, idle, read_timeout + 3 * PROMPT)
            finally:
                for sock in idle:
                    sock.close()
            refused = [data for data in received.values() if data]
            assert refused, "no connection was refused past the limit"
            assert all(data.startswith(b"HTTP/1.1 503 ") for data in refused)
            assert b"limit of open connections" in refused[0]
        finally:
            proc.terminate()
            status = proc.wait(PROMPT * 3)
            assert proc.stdout is not None
            proc.stdout.close()
        assert status == 0
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert "the open-file limit (1024) leaves room for 576 connections, not 10000" in log
    assert 1 <= log.count("refused ") <= 5, log


def test_a_server_lifts_its_soft_open_file_limit(tmp_path: Path) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard open-file limit is too low to lower the soft one")

    def lower_soft() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    port = free_port()
    cmd = [sys.executable, "-m", "aelastic", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        preexec_fn=lower_soft,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        new_soft, new_hard = line.split()[3:5]
        assert new_soft == new_hard, line
    finally:
        proc.terminate()
        status = proc.wait(PROMPT * 3)
        proc.stdout.close()
    assert status == 0


def _slowly(port: int, data: bytes, gap: float, limit: float) -> tuple[int, bytes, float]:
    """Send ``data`` one byte each ``gap`` s until the server closes the connection (or
    ``limit`` s pass); the bytes sent, what came back, and when it closed."""
    started = time.monotonic()
    sent = 0
    received = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(gap)
        while time.monotonic() - started < limit:
            if sent < len(data):
                try:
                    sock.sendall(data[sent : sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += 1
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        return sent, received, time.monotonic() - started


async def test_slow_headers_and_a_slow_body_are_dropped() -> None:
    head = b"GET /v1/health HTTP/1.1\r\nHost: x\r\nUser-Agent: one-byte-a-second\r\n\r\n"
    body = b'{"key": "k", "value": "dg=="}'
    slow_body_head = (
        b"POST /v1/runs/r/kv/set HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with HttpServer(extra_args=("--read-timeout", "2")) as server:
        # Headers at one byte a second: dropped after 2 s, unanswered.
        sent, received, after = await asyncio.to_thread(_slowly, server.port, head, 1.0, 60)
        assert sent < len(head) and received == b""
        assert 1.5 <= after < 2 + PROMPT
        # A whole head at once, then the body at one byte a second: 408 after 2 s.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(slow_body_head)
            port_free = sock.getsockname()
            assert port_free
            sent, received, after = await asyncio.to_thread(_slowly_on, sock, body, 1.0, 60)
        assert received.startswith(b"HTTP/1.1 408 "), received
        assert b"did not arrive within 2 s" in received
        assert b"Connection: close" in received
        assert sent < len(body) and 1.5 <= after < 2 + PROMPT + 10
        # Nothing of the slow body was applied; the server still answers at once.
        status, doc = post(server.url + "/v1/runs/r/kv/get", {"keys": ["k"]})
        assert (status, doc) == (200, {"values": [None]})
        assert_clean_log(server)


async def test_a_client_gone_mid_body_is_no_error_in_the_log() -> None:
    body = b'{"key": "k", "value": "dg=="}'
    head = (
        b"POST /v1/runs/r/kv/set HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with HttpServer() as server:
        for _ in range(3):  # a node killed while sending its request
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(head + body[:5])
                await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        status, doc = post(server.url + "/v1/runs/r/kv/get", {"keys": ["k"]})
        assert (status, doc) == (200, {"values": [None]})
        assert_clean_log(server)


async def test_a_client_gone_in_its_channels_handshake_is_no_error_in_the_log() -> None:
    upgrade = (
        b"GET /v1/channel HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with HttpServer() as server:
        for _ in range(20):  # a node killed as its channel opens: the handshake meets a reset
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(upgrade)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        await asyncio.sleep(0.5)
        status, doc = post(server.url + "/v1/runs/r/kv/get", {"keys": ["k"]})
        assert (status, doc) == (200, {"values": [None]})
        assert_clean_log(server)


def _slowly_on(
    sock: socket.socket, data: bytes, gap: float, limit: float
) -> tuple[int, bytes, float]:
    started = time.monotonic()
    sent = 0
    received = b""
    sock.settimeout(gap)
    while time.monotonic() - started < limit:
        if sent < len(data):
            try:
                sock.sendall(data[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return sent, received, time.monotonic() - started


def test_a_new_run_past_max_runs_gets_a_clear_503(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "aelastic", "serve", "--port", str(port), "--max-runs", "2"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}/v1/runs"
        body = {"key": "k", "value": "dmFsdWU="}
        assert post(f"{url}/one/kv/set", body)[0] == 200
        assert post(f"{url}/two/kv/set", body)[0] == 200
        assert post(f"{url}/one/kv/set", body)[0] == 200  # a run it holds: still served
        status, answer = post(f"{url}/three/kv/set", body)
        assert status == 503, answer
        assert "runs" in str(answer["error"]), answer
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err
