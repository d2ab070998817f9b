"""etcd's wire, below the client: HPACK, the protobuf messages, the HTTP/2 connection.

The connection is driven sans-IO: frames a member would send are fed to it, and what it
writes is read back from a recording transport (the same code talks to a real etcd in
every other etcd test).
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

from aelastic.backends.etcd._answers import EtcdError, Hangup, Misbehaved, NotEtcd, Transient
from aelastic.backends.etcd._frames import (
    CONTINUATION,
    DATA,
    GOAWAY,
    HEADERS,
    PING,
    SETTINGS,
    WINDOW_UPDATE,
)
from aelastic.backends.etcd._h2 import Connection, grpc_message
from aelastic.backends.etcd._hpack import CODES, Decoder, HpackError, encode, huffman_decode
from aelastic.backends.etcd._limits import (
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_HEADER_FRAMES,
    MAX_HEADER_LIST,
    MAX_IDLE,
    MAX_MESSAGE,
    MAX_OWED,
    MAX_UNREAD,
)
from aelastic.backends.etcd._pool import Arrived, answers
from aelastic.backends.etcd._proto import (
    METHODS,
    TXN,
    WATCH,
    WATCH_ANSWER,
    ProtoError,
    decode,
)
from aelastic.backends.etcd._proto import (
    encode as encode_message,
)

pytestmark = pytest.mark.anyio

# -- HPACK --------------------------------------------------------------------------------


def test_the_huffman_code_is_rfc_7541s() -> None:
    assert sum(2.0**-length for _, length in CODES.values()) == 1.0  # a complete code
    known = {0: (0x1FF8, 13), 10: (0x3FFFFFFC, 30), 32: (0x14, 6), 97: (0x3, 5),
             199: (0x1FFFFEC, 25), 255: (0x3FFFFEE, 26), 256: (0x3FFFFFFF, 30)}  # fmt: skip
    assert {s: CODES[s] for s in known} == known
    assert huffman_decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"
    with pytest.raises(HpackError):
        huffman_decode(b"\x00")  # '0' then seven zero bits: not the one-bits padding


def test_header_blocks_decode_as_rfc_7541s_examples() -> None:
    """Appendix C.6: three answers with Huffman-coded strings, one decoder, a 256-octet
    table (entries evicted as they go)."""
    decoder = Decoder(256)
    first = decoder.decode(bytes.fromhex(
        "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad"
        "171863c78f0b97c8e9ae82ae43d3"))  # fmt: skip
    assert first == [(b":status", b"302"), (b"cache-control", b"private"),
                     (b"date", b"Mon, 21 Oct 2013 20:13:21 GMT"),
                     (b"location", b"https://www.example.com")]  # fmt: skip
    second = decoder.decode(bytes.fromhex("4883640effc1c0bf"))
    assert second[0] == (b":status", b"307") and second[1:] == first[1:]
    with pytest.raises(HpackError):
        decoder.decode(b"\xff\x7f")  # an index beyond both tables


def test_literals_sent_are_read_back() -> None:
    headers = [(b":path", b"/etcdserverpb.KV/Range"), (b"token", b"x" * 300)]
    assert Decoder().decode(encode(headers)) == headers


# -- protobuf -----------------------------------------------------------------------------


def test_a_transaction_goes_to_protobuf_and_back_in_the_json_apis_shape() -> None:
    txn = {
        "compare": [{"key": "aA==", "target": "MOD", "result": "EQUAL", "mod_revision": "0"}],
        "success": [{"request_put": {"key": "aA==", "value": "dg==", "lease": "-5"}}],
        "failure": [{"request_range": {"key": "aA==", "count_only": True}}],
    }
    data = encode_message(TXN, txn)
    assert b"\x30\x00" in data  # mod_revision 0 is written: "the key does not exist"
    assert decode(TXN, data) == {
        "compare": [{"key": "aA==", "target": "MOD", "mod_revision": "0"}],  # EQUAL: 0
        "success": [{"request_put": {"key": "aA==", "value": "dg==", "lease": "-5"}}],
        "failure": [{"request_range": {"key": "aA==", "count_only": True}}],
    }
    watch = {"create_request": {"key": "aA==", "filters": ["NOPUT"], "watch_id": 2}}
    assert decode(WATCH, encode_message(WATCH, watch)) == {
        "create_request": {"key": "aA==", "filters": ["NOPUT"], "watch_id": "2"}
    }  # a repeated enum, written unpacked; read either way
    assert decode(WATCH, b"\x0a\x04\x2a\x02\x00\x01")["create_request"]["filters"] == [
        "NOPUT",
        "NODELETE",
    ]
    unknown = b"\xa0\x06\x01" + encode_message(WATCH_ANSWER, {"watch_id": "3"})
    assert decode(WATCH_ANSWER, unknown) == {"watch_id": "3"}  # a newer etcd's field
    for broken in (b"\x0a\x05ab", b"\x08\xff", b"\x0f"):
        with pytest.raises(ProtoError):
            decode(TXN, broken)
    assert all(m.path.startswith("/etcdserverpb.") for m in METHODS.values())


# -- HTTP/2 ---------------------------------------------------------------------------------


class Recorder:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False
        self.reading_paused = False

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def write(self, data: bytes) -> None:
        self.written += data

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        data = bytes(self.written)
        if data.startswith(b"PRI * HTTP/2.0"):
            data = data[24:]
        out = []
        while data:
            size = int.from_bytes(data[:3], "big")
            out.append((data[3], data[4], int.from_bytes(data[5:9], "big"), data[9 : 9 + size]))
            data = data[9 + size :]
        self.written.clear()
        return out


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + struct.pack(">I", stream) + payload
    )


def huffman(text: bytes) -> bytes:
    bits = "".join(format(CODES[b][0], f"0{CODES[b][1]}b") for b in text)
    bits += "1" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))


OK_HEADERS = encode([(b":status", b"200"), (b"content-type", b"application/grpc")])


def connected(settings: bytes = b"") -> tuple[Connection, Recorder]:
    connection = Connection("127.0.0.1:2379", "http")
    transport = Recorder()
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(frame(SETTINGS, 0, 0, settings))
    return connection, transport


async def test_a_call_answered_over_several_frames_ends_with_its_grpc_status() -> None:
    connection, transport = connected()
    sent = transport.frames()
    assert [k for k, *_ in sent] == [SETTINGS, WINDOW_UPDATE, SETTINGS]  # ours, and the ack
    call = connection.call("/etcdserverpb.KV/Range", b"\x0a\x01k")
    (h, _, hs, block), (d, df, ds, body) = transport.frames()
    assert (h, d, hs, ds, df) == (HEADERS, DATA, 1, 1, 1)  # END_STREAM on the message
    assert dict(Decoder().decode(block))[b":path"] == b"/etcdserverpb.KV/Range"
    assert body == grpc_message(b"\x0a\x01k")
    answer = grpc_message(b"\x20\x07")
    connection.data_received(frame(HEADERS, 4, 1, OK_HEADERS) + frame(DATA, 0, 1, answer[:3]))
    connection.data_received(frame(DATA, 0, 1, answer[3:]))
    assert not call.done.done() and call.messages == [b"\x20\x07"]
    connection.data_received(frame(HEADERS, 5, 1, encode([(b"grpc-status", b"0")])))
    assert await call.done == (0, "")
    connection.data_received(frame(PING, 0, 0, b"12345678"))
    assert transport.frames() == [(PING, 1, 0, b"12345678")]


async def test_a_refused_stream_raises_etcds_error_with_its_code() -> None:
    """A trailers-only answer (etcd's refusal of a watch), its message Huffman-coded and
    percent-encoded as gRPC sends it."""
    connection, _ = connected()
    arrived = Arrived()
    call = connection.call("/etcdserverpb.Watch/Watch", b"", end=False, on_message=arrived.append)
    call.done.add_done_callback(lambda _: arrived.woken.set())
    text = huffman(b"etcdserver: no leader%21")
    trailers = OK_HEADERS + encode([(b"grpc-status", b"14")])
    trailers += b"\x00" + encode([(b"grpc-message", b"")])[1:-1] + bytes((0x80 | len(text),)) + text
    connection.data_received(frame(HEADERS, 5, 1, trailers))
    with pytest.raises(EtcdError) as info:
        async for _ in answers(call, arrived, WATCH_ANSWER, None):
            pass
    assert info.value.code == 14 and str(info.value) == "etcdserver: no leader!"


async def test_a_server_that_is_not_http2_fails_the_calls_as_not_etcd() -> None:
    connection = Connection("127.0.0.1:6379", "http")
    connection.connection_made(Recorder())  # type: ignore[arg-type]
    call = connection.call("/etcdserverpb.KV/Range", b"")
    connection.data_received(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with pytest.raises(NotEtcd, match="does not speak HTTP/2"):
        await call.done
    with pytest.raises(NotEtcd):
        connection.call("/etcdserverpb.KV/Range", b"")  # and takes no new call
    other, _ = connected()
    refused = other.call("/etcdserverpb.KV/Range", b"")
    other.data_received(frame(HEADERS, 5, 1, encode([(b":status", b"404")])))
    with pytest.raises(NotEtcd, match="HTTP status 404"):
        await refused.done


async def test_what_is_sent_waits_for_the_members_window() -> None:
    connection, transport = connected(struct.pack(">HI", 4, 10))  # stream windows of 10
    transport.frames()
    call = connection.call("/etcdserverpb.Lease/LeaseKeepAlive", b"x" * 25, end=False)
    data = [f for f in transport.frames() if f[0] == DATA]
    assert [len(f[3]) for f in data] == [10]  # 30 bytes framed: 10 now
    connection.data_received(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
    assert [len(f[3]) for f in transport.frames()] == [20]
    call.send(b"y", end=True)
    assert transport.frames() == [(DATA, 1, 1, grpc_message(b"y"))]


async def test_goaway_fails_the_calls_etcd_will_not_answer_and_takes_no_new_one() -> None:
    connection, _ = connected()
    first = connection.call("/etcdserverpb.KV/Range", b"")
    second = connection.call("/etcdserverpb.KV/Range", b"")
    connection.data_received(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0) + b"bye"))
    with pytest.raises(Transient, match="bye"):
        await second.done
    assert not first.done.done() and not connection.usable
    with pytest.raises(Transient):
        connection.call("/etcdserverpb.KV/Range", b"")


async def test_a_connection_lost_before_any_answer_is_a_hangup_after_one_transient() -> None:
    silent = Connection("127.0.0.1:2379", "http")
    silent.connection_made(Recorder())  # type: ignore[arg-type]
    waiting = silent.call("/etcdserverpb.KV/Range", b"")
    silent.connection_lost(None)
    with pytest.raises(Hangup):
        await waiting.done
    heard, _ = connected()
    cut: Any = heard.call("/etcdserverpb.KV/Range", b"")
    heard.connection_lost(ConnectionResetError())
    with pytest.raises(Transient) as info:
        await cut.done
    assert not isinstance(info.value, Hangup)


async def test_an_oversized_message_or_a_second_unary_message_closes_the_connection() -> None:
    connection, transport = connected()
    call = connection.call("/etcdserverpb.KV/Range", b"")
    other = connection.call("/etcdserverpb.KV/Range", b"")
    prefix = b"\x00" + (MAX_MESSAGE + 1).to_bytes(4, "big")
    connection.data_received(frame(HEADERS, 4, 1, OK_HEADERS) + frame(DATA, 0, 1, prefix))
    with pytest.raises(Misbehaved, match=f"gRPC message of {MAX_MESSAGE + 1} bytes"):
        await call.done
    with pytest.raises(Misbehaved):
        await other.done  # the connection is closed: every call on it fails
    assert transport.closed and not connection.usable
    twice, _ = connected()
    unary = twice.call("/etcdserverpb.KV/Range", b"")
    answer = grpc_message(b"\x20\x07")
    twice.data_received(frame(HEADERS, 4, 1, OK_HEADERS) + frame(DATA, 0, 1, answer * 2))
    with pytest.raises(Misbehaved, match="second gRPC message in a unary"):
        await unary.done


async def test_a_frame_over_the_advertised_size_is_refused_from_its_head() -> None:
    connection, transport = connected()
    sent = transport.frames()
    settings = dict(struct.unpack_from(">HI", sent[0][3], i) for i in range(0, len(sent[0][3]), 6))
    assert settings[5] == MAX_FRAME and settings[6] == MAX_HEADER_LIST  # advertised
    call = connection.call("/etcdserverpb.KV/Range", b"")
    head = (MAX_FRAME + 1).to_bytes(3, "big") + bytes((HEADERS, 4)) + struct.pack(">I", 1)
    connection.data_received(head + b"\x00" * 100)  # its payload never needed
    with pytest.raises(Misbehaved, match=f"HEADERS frame of {MAX_FRAME + 1} bytes"):
        await call.done
    assert transport.closed


@pytest.mark.parametrize(
    ("fragments", "said"),
    [
        ([b""] * (MAX_HEADER_FRAMES + 5), "more than 16 frames"),
        ([b"\x00" * MAX_FRAME] * 5, f"more than {MAX_HEADER_BLOCK} bytes"),
    ],
    ids=["empty-continuations", "oversized-block"],
)
async def test_a_header_block_is_bounded_in_bytes_and_in_frames(
    fragments: list[bytes], said: str
) -> None:
    connection, _ = connected()
    waiting = connection.call("/etcdserverpb.KV/Range", b"")
    connection.data_received(frame(HEADERS, 0, 1, OK_HEADERS))
    connection.data_received(b"".join(frame(CONTINUATION, 0, 1, f) for f in fragments))
    with pytest.raises(Misbehaved, match=said):
        await waiting.done


async def test_a_header_list_is_bounded_once_decoded() -> None:
    """A small block of one-byte references to a large dynamic-table entry."""
    connection, _ = connected()
    waiting = connection.call("/etcdserverpb.KV/Range", b"")
    entry = b"\x40\x01x\x64" + b"v" * 100  # a literal of 100 bytes, kept as entry 62
    block = OK_HEADERS + entry + b"\xbe" * 600  # 600 references to it: 80 KB decoded
    connection.data_received(frame(HEADERS, 4, 1, block))
    with pytest.raises(Misbehaved, match="header list of more than"):
        await waiting.done


@pytest.mark.parametrize("kind", [PING, SETTINGS], ids=["ping", "settings"])
async def test_a_flood_of_frames_asking_for_acks_closes_the_connection(kind: int) -> None:
    connection, transport = connected()
    call = connection.call("/etcdserverpb.KV/Range", b"")
    transport.frames()
    payload = b"12345678" if kind == PING else b""
    connection.data_received(frame(kind, 0, 0, payload) * (MAX_IDLE + 10))
    with pytest.raises(Misbehaved, match="flood"):
        await call.done
    assert transport.closed
    acks = transport.frames()
    assert 0 < len(acks) <= MAX_IDLE + 1  # never more acks than the budget


async def test_a_member_that_reads_nothing_stops_this_side_reading_and_owes_few_acks() -> None:
    connection, transport = connected()
    call = connection.call("/etcdserverpb.KV/Range", b"")
    transport.frames()
    connection.pause_writing()  # the transport's buffer is full: the member reads nothing
    assert transport.reading_paused and connection.writing_paused
    connection.data_received(frame(PING, 0, 0, b"12345678") * MAX_OWED)
    assert not connection.closed and len(transport.frames()) == MAX_OWED
    connection.resume_writing()
    assert not transport.reading_paused
    connection.pause_writing()
    connection.data_received(frame(PING, 0, 0, b"12345678") * (MAX_OWED + 1))
    with pytest.raises(Misbehaved, match="reads nothing"):
        await call.done


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)), "WINDOW_UPDATE of 0"),
        (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 31) - 1)), "over 2\\^31-1"),
        (frame(PING, 0, 0, b"1234"), "PING frame of 4 bytes"),
        (frame(PING, 0, 1, b"12345678"), "PING frame on stream 1"),
        (frame(DATA, 0, 0, b"x"), "DATA frame on stream 0"),
        (frame(DATA, 8, 1, b"\x05ab"), "padding is longer"),
        (frame(SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff"), "initial window"),
        (frame(SETTINGS, 0, 0, b"\x00\x04\x00"), "SETTINGS frame of 3 bytes"),
        (frame(CONTINUATION, 4, 1, b""), "CONTINUATION frame"),
        (frame(GOAWAY, 0, 0, b"\x00"), "GOAWAY frame of 1 bytes"),
    ],
    ids=[
        "zero-window-update",
        "window-overflow",
        "short-ping",
        "ping-on-a-stream",
        "data-on-stream-0",
        "padding",
        "initial-window",
        "settings-size",
        "lone-continuation",
        "short-goaway",
    ],
)
async def test_frames_that_break_http2_close_the_connection(data: bytes, said: str) -> None:
    connection, transport = connected()
    call = connection.call("/etcdserverpb.KV/Range", b"")
    connection.data_received(frame(HEADERS, 4, 1, OK_HEADERS) + data)
    with pytest.raises(Misbehaved, match=said):
        await call.done
    assert transport.closed and not connection.usable


async def test_a_connection_ended_by_goaway_closes_once_its_last_call_ends() -> None:
    connection, transport = connected()
    call = connection.call("/etcdserverpb.KV/Range", b"")
    connection.data_received(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
    assert not transport.closed
    trailers = encode([(b"grpc-status", b"0")])
    connection.data_received(frame(HEADERS, 4, 1, OK_HEADERS) + frame(HEADERS, 5, 1, trailers))
    assert await call.done == (0, "")
    assert transport.closed


async def test_a_streams_unread_answers_are_bounded() -> None:
    """A watch whose answers come faster than they are read (never, here)."""
    connection, _ = connected()
    arrived = Arrived()
    call = connection.call("/etcdserverpb.Watch/Watch", b"", end=False, on_message=arrived.append)
    connection.data_received(frame(HEADERS, 4, 1, OK_HEADERS))
    message = grpc_message(b"\x00" * (MAX_FRAME - 5))
    for _ in range(MAX_UNREAD // len(message)):
        connection.data_received(frame(DATA, 0, 1, message))
    assert not call.done.done() and arrived
    connection.data_received(frame(DATA, 0, 1, message) * 2)
    with pytest.raises(Misbehaved, match="faster than they were read"):
        await call.done
