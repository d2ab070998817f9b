"""The Redis backend's own connection: the protocol's encoding, and connections to a real
redis-server (pipelining, lost connections, a silent server, the login)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio
import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import (
    AuthenticationError,
    InvalidResponse,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from aelastic.backends.redis import _resp, parse_endpoint
from aelastic.backends.redis._codec import Incomplete, pack, parse
from tests._redis_server import RedisServer, free_port, redis_server_fixture
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio

server = redis_server_fixture()
auth_server = redis_server_fixture(password="pw-resp")


# -- encoding -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("PING",),
        ("EVALSHA", "a" * 40, 2, "k:{1}:a", "k:{1}:b", b"\x00\xff\r\n", 1.5, -3, "é", 0),
        ("SET", "key", b"", "PX", 86_400_000),
        ("SCRIPT", "LOAD", "return 1\r\n" * 100),
        ("X", bytearray(b"ba"), memoryview(b"mv"), 2**70),
    ],
)
def test_commands_are_packed_as_redis_py_packs_them(args: tuple[Any, ...]) -> None:
    # redis-py before 5.1 refuses a bytearray or memoryview: its bytes, packed, are the same.
    plain = [bytes(a) if isinstance(a, bytearray | memoryview) else a for a in args]
    expected = b"".join(Connection().pack_command(*plain))
    assert pack(args) == expected
    assert pack(args) == expected  # the second time from the cache of encoded arguments


def test_unsendable_arguments_are_type_errors() -> None:
    for bad in (None, True, ["x"]):
        with pytest.raises(TypeError):
            pack(("SET", "k", bad))


REPLIES: list[tuple[bytes, Any]] = [
    (b"+OK\r\n", b"OK"),
    (b":-42\r\n", -42),
    (b"$5\r\nhe\r\no\r\n", b"he\r\no"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n+x\r\n", [1, [b"a", None], b"x"]),
]


@pytest.mark.parametrize(("data", "value"), REPLIES)
def test_replies_parse_whole_and_are_incomplete_when_cut_anywhere(data: bytes, value: Any) -> None:
    buf = bytearray(data + b"+next\r\n")
    assert parse(buf, 0) == (value, len(data))
    assert parse(buf, len(data)) == (b"next", len(buf))
    for cut in range(len(data)):
        with pytest.raises(Incomplete):
            parse(bytearray(data[:cut]), 0)


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (b"-NOSCRIPT No matching script.", NoScriptError),
        (b"-READONLY You can't write against a read only replica.", ReadOnlyError),
        (b"-WRONGPASS invalid username-password pair", AuthenticationError),
        (b"-ERR unknown command 'x'", ResponseError),
    ],
)
def test_error_replies_are_redis_py_exception_objects(line: bytes, kind: type) -> None:
    error, end = parse(bytearray(line + b"\r\n"), 0)
    assert type(error) is kind and end == len(line) + 2
    assert str(error) in line.decode()


@pytest.mark.parametrize("data", [b"HTTP/1.1 400 Bad Request\r\n", b"$x\r\n", b"*?\r\n"])
def test_bytes_that_are_not_the_protocol_are_invalid_responses(data: bytes) -> None:
    with pytest.raises(InvalidResponse, match="Protocol Error"):
        parse(bytearray(data), 0)


# -- connections ----------------------------------------------------------------------------


async def _open(url: str, **config: Any) -> _resp.RespConnection:
    endpoint = parse_endpoint(url, config, environ={})
    return await _resp.Dialer(endpoint).open((endpoint.host, endpoint.port))


async def test_pipelined_calls_are_answered_in_order(server: RedisServer) -> None:
    conn = await _open(server.url)
    try:
        calls = [
            conn.request(pack(("SET", f"resp:{i}", i)) + pack(("GET", f"resp:{i}")), 2)
            for i in range(50)
        ]
        answers = await asyncio.gather(*calls)
        assert answers == [[b"OK", str(i).encode()] for i in range(50)]
        [error] = await conn.request(pack(("EVALSHA", "0" * 40, 0)), 1)
        assert isinstance(error, NoScriptError)  # an error reply is a value, not a failure
        assert await conn.request(pack(("PING",)), 1) == [b"PONG"]
    finally:
        conn.close()


async def test_a_lost_connection_fails_its_calls_and_tells_its_hooks(server: RedisServer) -> None:
    conn = await _open(server.url)
    reasons: list[BaseException] = []
    conn.on_lost(reasons.append)
    blocked = asyncio.ensure_future(conn.request(pack(("BLPOP", "resp:never", 0)), 1))
    await asyncio.sleep(0.1)
    with server.client() as client:
        client.client_kill_filter(_type="normal", skipme=True)
    with anyio.fail_after(PROMPT), pytest.raises(RedisConnectionError):
        await blocked
    assert conn.closed and len(reasons) == 1 and isinstance(reasons[0], RedisConnectionError)
    with pytest.raises(RedisConnectionError, match="closed"):
        conn.call(pack(("PING",)), 1, lambda replies, error: None)
    late: list[BaseException] = []
    conn.on_lost(late.append)  # lost already: told at once
    assert late == reasons


async def test_a_silent_server_times_a_call_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts and never answers (a half-open socket, in effect): the call
    fails with a timeout once the watchdog finds it unanswered for CONNECT_TIMEOUT."""
    monkeypatch.setattr(_resp, "CONNECT_TIMEOUT", 0.3)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        conn = await _open(f"redis://127.0.0.1:{port}/0")
        started = asyncio.get_running_loop().time()
        with anyio.fail_after(PROMPT), pytest.raises(RedisTimeoutError, match="Timeout reading"):
            await conn.request(pack(("PING",)), 1)
        assert asyncio.get_running_loop().time() - started >= 0.3
        assert conn.closed


async def test_login_and_database_in_one_round_trip(auth_server: RedisServer) -> None:
    conn = await _open(auth_server.url.replace("/0", "/5"), password="pw-resp")
    try:
        [info] = await conn.request(pack(("CLIENT", "INFO")), 1)
        assert b" db=5 " in info
    finally:
        conn.close()
    with pytest.raises(AuthenticationError):
        await _open(auth_server.url, password="wrong")
    conn = await _open(auth_server.url)  # no login: commands are refused
    try:
        [refused] = await conn.request(pack(("GET", "x")), 1)
        assert isinstance(refused, AuthenticationError)
    finally:
        conn.close()


async def test_unreachable_and_refusing_servers_are_redis_py_errors() -> None:
    port = free_port()
    with pytest.raises(RedisConnectionError, match=f"connecting to 127.0.0.1:{port}"):
        await _open(f"redis://127.0.0.1:{port}/0")


async def test_a_subscriber_gets_every_reply_and_ends_on_an_error_reply(
    server: RedisServer,
) -> None:
    endpoint = parse_endpoint(server.url, environ={})
    got: list[Any] = []
    arrived = asyncio.Event()

    def push(reply: Any) -> None:
        got.append(reply)
        arrived.set()

    conn = await _resp.Dialer(endpoint).open((endpoint.host, endpoint.port), push)
    conn.send(pack(("SUBSCRIBE", "resp:channel")))
    with anyio.fail_after(PROMPT):
        await arrived.wait()
        arrived.clear()
        with server.client() as client:
            client.publish("resp:channel", "hello")
        await arrived.wait()
    assert got == [[b"subscribe", b"resp:channel", 1], [b"message", b"resp:channel", b"hello"]]
    lost = asyncio.Event()
    reasons: list[BaseException] = []
    conn.on_lost(lambda reason: (reasons.append(reason), lost.set()))
    conn.send(pack(("GET", "x")))  # not allowed while subscribed: an error reply
    with anyio.fail_after(PROMPT):
        await lost.wait()
    assert isinstance(reasons[0], ResponseError) and not isinstance(reasons[0], WatchError)


# -- one connection per client (RESP3) ------------------------------------------------------


async def _one_node_joins_and_is_woken(
    url: str, run_id: str, admin: str | None = None, **config: Any
) -> int:
    """A backend of its own joins, waits, is woken by another node's join; the number of
    connections it held meanwhile, its named one (``_presence``: how the server knows the
    node lives) included: on RESP3 that name is on its one connection."""
    from aelastic import RendezvousParameters
    from aelastic.backends.redis import create_backend
    from aelastic.core.params import Rules
    from aelastic.core.state import NodeDesc, Op, Request

    rules = Rules(2, 2, last_call_ms=60_000, window_ms=60_000)
    params = RendezvousParameters("redis", url, run_id, 2, 2, share_connections=0, **config)
    first, second = create_backend(params), create_backend(params)
    try:
        with server_client(url, admin) as client:
            before = len(client.client_list())
            reply = await first.apply(
                Request(Op.JOIN, NodeDesc("10.0.0.1", 1, 0), rules, secret=SECRET)
            )
            waiting = asyncio.ensure_future(first.wait_for_change(reply.status.token, 30))
            await asyncio.sleep(0.2)
            listed = client.client_list()
            named = [c for c in listed if ":p:" in c.get("name", "")]
            assert len(named) == 1  # the node's named connection
            held = len(listed) - before
            await second.apply(Request(Op.JOIN, NodeDesc("10.0.0.2", 2, 0), rules, secret=SECRET))
            with anyio.fail_after(PROMPT):
                status = await waiting
            assert status is not None and status.complete
        return held
    finally:
        await first.aclose()
        await second.aclose()


def server_client(url: str, password: str | None) -> Any:
    import redis

    return redis.Redis.from_url(url, password=password, protocol=2)


async def test_a_node_holds_one_connection_to_a_server_speaking_resp3(
    server: RedisServer, run_id: str
) -> None:
    assert await _one_node_joins_and_is_woken(server.url, run_id) == 1


async def test_a_server_without_hello_gets_two_connections(run_id: str) -> None:
    """Before Redis 6 (or behind a proxy without it): RESP2, and the subscriber takes no
    command, so commands have a connection of their own (and the name one more)."""
    with RedisServer(extra_args=("--rename-command", "HELLO", "")) as old:
        assert await _one_node_joins_and_is_woken(old.url, run_id) == 3
