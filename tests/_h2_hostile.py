"""A hostile HTTP/2 server for tests: a real process on a loopback port that speaks raw frames
as no etcd member does.

Usage::

    from tests._h2_hostile import HostileServer

    with HostileServer("ping-flood") as server:   # listening, in a process of its own
        server.endpoint                            # "127.0.0.1:PORT"

Run as a script (``python tests/_h2_hostile.py MODE``), it prints its port and serves every
connection in a thread of its own, each by ``MODE``:

* ``oversized-headers``: its settings, then a HEADERS frame of 16 MiB (and its payload);
* ``endless-continuation``: the answer's HEADERS without END_HEADERS, then empty
  CONTINUATION frames without end;
* ``ping-flood`` / ``settings-flood``: never reads anything; its settings, then PING (or
  SETTINGS) frames without end;
* ``endless-answer``: once the request arrived, the answer's headers and a gRPC message as
  large as the client takes, then DATA without end (never the trailers);
* ``huge-message``: the answer's headers, then a gRPC message that says it is 4 GiB, and
  DATA without end;
* ``huffman``: the answer's headers with a Huffman-coded value of 32 KiB (a block the client
  takes and decodes), then a header block of Huffman-coded bytes without end;
* ``empty-data``: the answer's headers, then empty DATA frames without end;
* ``silent``: takes the connection, reads it, never writes a byte.

A connection's thread ends when the client closes it (a write fails). Standard library
only, plus aelastic's Huffman table to write Huffman-coded strings.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

__all__ = ["MODES", "HostileServer"]

MODES = (
    "oversized-headers",
    "endless-continuation",
    "ping-flood",
    "settings-flood",
    "endless-answer",
    "huge-message",
    "huffman",
    "empty-data",
    "silent",
)

DATA, HEADERS, SETTINGS, PING, CONTINUATION = 0, 1, 4, 6, 9
END_STREAM, END_HEADERS = 0x1, 0x4
#: The client's answer headers: ``:status 200``, ``content-type: application/grpc``, each
#: a literal without indexing, its strings raw.
OK = b"\x08\x03200" + b"\x0f\x10\x10application/grpc"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + struct.pack(">I", stream) + payload
    )


def huffman(text: bytes) -> bytes:
    from aelastic.backends.etcd._hpack import CODES

    bits = "".join(format(CODES[b][0], f"0{CODES[b][1]}b") for b in text)
    bits += "1" * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8, "big")


def _integer(value: int, prefix: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1)."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 127 | 128)
        value >>= 7
    return bytes(out) + bytes((value,))


def _huffman_block(size: int) -> bytes:
    """``OK`` and a header ``x`` whose value is ``size`` Huffman-coded bytes ('e' takes 5
    bits: eight of them fill 5 bytes, no padding)."""
    value = huffman(b"e" * (size // 5 * 8))
    return OK + b"\x00\x01x" + _integer(len(value), 7, 0x80) + value


def _request(conn: socket.socket) -> None:
    """Read until the client's first call (stream 1) has begun: its HEADERS frame."""
    data = b""
    while True:
        more = conn.recv(65536)
        if not more:
            raise OSError("the client left")
        data += more
        at = 24  # the client's preface
        while len(data) >= at + 9:
            if data[at + 3] == HEADERS:
                return
            at += 9 + int.from_bytes(data[at : at + 3], "big")


def _forever(conn: socket.socket, chunk: bytes) -> None:
    while True:
        conn.sendall(chunk)


def _serve(conn: socket.socket, mode: str) -> None:
    settings = frame(SETTINGS, 0, 0)
    if mode == "settings-flood":
        _forever(conn, settings * 4096)
    if mode == "ping-flood":
        conn.sendall(settings)
        _forever(conn, frame(PING, 0, 0, b"12345678") * 4096)
    if mode == "silent":
        while conn.recv(65536):
            pass
        return
    conn.sendall(settings)
    if mode == "oversized-headers":  # the largest frame HTTP/2 can say: 16 MiB - 1
        conn.sendall(b"\xff\xff\xff" + bytes((HEADERS, END_HEADERS)) + struct.pack(">I", 1))
        conn.sendall(b"\x00" * ((1 << 24) - 1))
        _forever(conn, b"\x00" * 65536)
    _request(conn)
    if mode == "endless-continuation":
        conn.sendall(frame(HEADERS, 0, 1, OK))
        _forever(conn, frame(CONTINUATION, 0, 1) * 4096)
    if mode == "huffman":
        block = _huffman_block(32 << 10)
        pieces = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        conn.sendall(frame(HEADERS, 0, 1, pieces[0]))
        for piece in pieces[1:-1]:
            conn.sendall(frame(CONTINUATION, 0, 1, piece))
        conn.sendall(frame(CONTINUATION, END_HEADERS, 1, pieces[-1]))
        coded = huffman(b"e" * 25600)  # 16,000 bytes
        conn.sendall(frame(HEADERS, 0, 1, b"\x00\x01y" + _integer(1 << 30, 7, 0x80) + coded))
        _forever(conn, frame(CONTINUATION, 0, 1, coded))
    conn.sendall(frame(HEADERS, END_HEADERS, 1, OK))
    zeros = frame(DATA, 0, 1, b"\x00" * 16384) * 16
    if mode == "endless-answer":
        from aelastic.backends.etcd._limits import MAX_MESSAGE

        conn.sendall(frame(DATA, 0, 1, b"\x00" + MAX_MESSAGE.to_bytes(4, "big")))
        _forever(conn, zeros)
    if mode == "huge-message":
        conn.sendall(frame(DATA, 0, 1, b"\x00\xff\xff\xff\xff"))
        _forever(conn, zeros)
    if mode == "empty-data":
        _forever(conn, frame(DATA, 0, 1) * 4096)
    raise ValueError(f"no mode {mode!r}")


def _connection(conn: socket.socket, mode: str) -> None:
    try:
        _serve(conn, mode)
    except OSError:
        pass  # the client closed it
    finally:
        conn.close()


def main(mode: str) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_connection, args=(conn, mode), daemon=True).start()


class HostileServer:
    """The script above in a process of its own (see the module docstring)."""

    def __init__(self, mode: str) -> None:
        assert mode in MODES, mode
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, mode],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.endpoint = f"127.0.0.1:{self.port}"

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    main(sys.argv[1])
