"""Fuzz the HTTP rendezvous server: random methods, paths, queries, bodies and headers.

The server runs for real (a subprocess) with a token and a journal. Because it answers only
after every change is in the journal, and heartbeats are the only changes it leaves out, the
journal together with the seeded run's snapshot is an exact picture of what a request
changed: a rejected request (4xx) must leave both as they were. Every answer must be a JSON
object (with ``error`` when it is a rejection), never a 5xx, and the server stays up.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import itertools
import json
import math
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.core.wire import request_to_json
from tests._http_server import HttpServer

TOKEN = "fuzz-token"
RUN = "fuzz-run"
EXPECTED = {200, 400, 401, 404, 405, 409, 413, 417}
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
#: The server's largest body: small, so that a larger one fits the socket buffers and the
#: server's answer can be read although it never reads the body.
MAX_BODY = 65536
#: A body the server refuses as too large (413).
OVERSIZED = b'{"junk": "' + b"x" * (MAX_BODY + 4096) + b'"}'
#: Seeded nodes: long rules, so that the seeded run stays as it is unless a request changes it.
SEED_RULES = Rules(2, 3, last_call_ms=86_400_000, window_ms=86_400_000)
NODES = [NodeDesc("10.1.2.3", 100 + i, 0).key for i in range(3)]
#: The seeded node's secret, and another client's.
SECRETS = ["5eed" * 8, "f0e" * 8]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpServer, Path]]:
    path = tmp_path_factory.mktemp("fuzz") / "runs.json"
    with HttpServer(token=TOKEN, persist=path, max_body=MAX_BODY) as srv:
        seed(srv)
        yield srv, path


_sources = itertools.count()


def source_address() -> tuple[str, int]:
    """A loopback address of its own for each request (127.0.1.0-255, in turn): the server
    makes a client that failed many token checks wait (429), and the fuzzer's wrong tokens
    must not make its other requests wait."""
    return f"127.0.1.{next(_sources) % 256}", 0


def request(
    srv: HttpServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(
        "127.0.0.1", srv.port, timeout=20, source_address=source_address()
    )
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def seed(srv: HttpServer) -> None:
    """A run with a member and some keys for the fuzzer to aim at."""
    base = f"/v1/runs/{RUN}"
    join = Request(Op.JOIN, NodeDesc.from_key(NODES[0]), SEED_RULES, port=29500, secret=SECRETS[0])
    sent = json.dumps(request_to_json(join)).encode()
    assert request(srv, "POST", base + "/rendezvous", sent, auth())[0] == 200
    for key, value in [("k", b"v"), ("n", b"7"), ("", b"empty")]:
        sent = json.dumps({"key": key, "value": b64(value)}).encode()
        assert request(srv, "POST", base + "/kv/set", sent, auth())[0] == 200


def seeded(srv: HttpServer) -> tuple[int, Any]:
    """The seeded run's snapshot (without the time it was made) and keys."""
    status, answer = request(srv, "GET", f"/v1/runs/{RUN}", None, auth())
    doc = json.loads(answer)
    if status == 200:
        del doc["status"]["now"]
    keys = json.dumps({"keys": ["k", "n", "", "new", "x"]}).encode()
    _, values = request(srv, "POST", f"/v1/runs/{RUN}/kv/get", keys, auth())
    return status, (doc, json.loads(values))


# -- strategies -----------------------------------------------------------------------------


def _held_long(text: str) -> bool:
    """Whether the server would take ``text`` as a wait of more than a moment."""
    try:
        value = float(text)
    except ValueError:
        return False
    return 0.1 < value <= 300


texts = st.text(max_size=40)
#: Seconds that are invalid or at most a moment (a valid long wait would stall the fuzzer).
small_seconds = st.one_of(
    st.floats(max_value=0.1, allow_nan=False),
    st.floats(min_value=300.5),
    st.just(math.nan),
    st.integers(max_value=0),
    texts.filter(lambda t: not _held_long(t)),
)
b64_values = st.one_of(st.binary(max_size=64).map(b64), texts, st.none(), st.integers())
tokens = st.one_of(st.just(""), st.from_regex(r"\A[0-9a-f]{1,16}\.[0-9]{1,5}\Z"), texts)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
node_names = st.one_of(st.sampled_from(NODES), texts, st.integers())
ops = st.sampled_from([op.value for op in Op])
fields = st.fixed_dictionaries(
    {},
    optional={
        "op": st.one_of(ops, texts),
        "node": node_names,
        "min": st.one_of(st.integers(), st.floats()),
        "window": st.one_of(st.integers(), texts),
        "state": b64_values,
        "token": tokens,
        "key": st.one_of(st.sampled_from(["k", "n", "", "new"]), texts, st.integers()),
        "keys": st.one_of(st.lists(st.sampled_from(["k", "n", "x"]), max_size=3), json_values),
        "value": b64_values,
        "amount": st.one_of(st.integers(), st.floats(), st.booleans(), texts),
        "expected": b64_values,
        "desired": b64_values,
        "timeout": small_seconds,
        "junk": json_values,
    },
)
bodies = st.one_of(
    st.none(),
    st.binary(max_size=200),
    fields.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.just(OVERSIZED),
)
runs = st.one_of(st.just(RUN), st.just(RUN), texts.filter(bool), st.sampled_from(["..", "a/b"]))
routes = st.sampled_from(
    [
        "/rendezvous",
        "/rendezvous",
        "/rendezvous",
        "/status",
        "/status",
        "",
        "/state",
        "/kv/set",
        "/kv/get",
        "/kv/add",
        "/kv/compare_set",
        "/kv/delete",
        "/kv/wait",
    ]
)
queries = st.dictionaries(
    st.sampled_from(["token", "wait", "hold", "x"]),
    st.one_of(tokens, small_seconds.map(str)),
    max_size=3,
)
moments = st.floats(0, 0.05).map(lambda s: f"{s:.3f}")
keys = st.sampled_from(["k", "n", "", "new", "x"])
valid_b64 = st.binary(max_size=64).map(b64)
rendezvous_requests = st.fixed_dictionaries(
    {
        "op": ops,
        "node": st.sampled_from(NODES),
        "min": st.integers(1, 3),
        "max": st.integers(3, 4),
        "last_call": st.integers(1, 100_000),
        "window": st.integers(1, 10**9),
        "expired": st.booleans(),
        "finished": st.booleans(),
        "port": st.integers(0, 65535),
        "secret": st.sampled_from(SECRETS),
    }
)
#: For each route: a method, a query and a body that fit its schema (before mutation).
PLAUSIBLE: dict[str, tuple[str, st.SearchStrategy[dict[str, str]], st.SearchStrategy[Any]]] = {
    "/rendezvous": (
        "POST",
        st.just({}) | st.fixed_dictionaries({"hold": moments}),
        rendezvous_requests,
    ),
    "/status": (
        "GET",
        st.just({}) | st.fixed_dictionaries({"token": tokens, "wait": moments}),
        st.none(),
    ),
    "": ("GET", st.just({}), st.none()),
    "/state": (
        "PUT",
        st.just({}),
        st.fixed_dictionaries({"state": valid_b64, "token": tokens}),
    ),
    "/kv/set": ("POST", st.just({}), st.fixed_dictionaries({"key": keys, "value": valid_b64})),
    "/kv/get": (
        "POST",
        st.just({}),
        st.fixed_dictionaries({"keys": st.lists(keys, min_size=1, max_size=3)}),
    ),
    "/kv/add": (
        "POST",
        st.just({}),
        st.fixed_dictionaries({"key": keys, "amount": st.integers(-9, 9)}),
    ),
    "/kv/compare_set": (
        "POST",
        st.just({}),
        st.fixed_dictionaries(
            {"key": keys, "expected": st.none() | valid_b64, "desired": valid_b64}
        ),
    ),
    "/kv/delete": ("POST", st.just({}), st.fixed_dictionaries({"key": keys})),
    "/kv/wait": (
        "POST",
        st.just({}),
        st.fixed_dictionaries(
            {"keys": st.lists(keys, min_size=1, max_size=3), "timeout": st.floats(0, 0.05)}
        ),
    ),
}
#: Other methods a route answers (without a body).
ALSO = {"": "DELETE", "/state": "GET"}


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> bytes:
    """``body``, often as it is, else with one field dropped, replaced or added."""
    choice = draw(st.integers(0, 5))
    if choice == 1 and body:
        body.pop(draw(st.sampled_from(sorted(body))))
    elif choice == 2 and body:
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    elif choice == 3:
        body[draw(texts)] = draw(json_values)
    return json.dumps(body).encode()


@st.composite
def targets(draw: st.DrawFn) -> tuple[str, str, bytes | None]:
    """(method, path, body): mostly plausible requests for a route, sometimes anything."""
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.text(max_size=60))
        return draw(methods), "/" + quote(raw, safe="/?=&"), draw(bodies)
    route = draw(routes)
    path = f"/v1/runs/{quote(draw(runs), safe='')}{route}"
    method, plausible_query, plausible_body = PLAUSIBLE[route]
    query = draw(st.one_of(plausible_query, plausible_query, queries))
    if query:
        path += "?" + urlencode(query)
    plain = draw(plausible_body)
    if route in ALSO and draw(st.booleans()):
        method, body = ALSO[route], None
    elif draw(st.integers(0, 15)) == 0:
        body = OVERSIZED
    elif plain is None:
        body = draw(st.one_of(st.none(), st.none(), bodies))
    elif draw(st.integers(0, 3)) > 0:
        body = draw(mutated(plain))
    else:
        method, body = draw(methods), draw(bodies)
    return method, path, body


header_names = st.from_regex(r"\AX-[A-Za-z0-9-]{1,20}\Z") | st.sampled_from(
    ["Accept", "Content-Type", "Idempotency-Key", "Cookie", "Expect"]
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.strip
)
authorizations = st.one_of(
    st.just(f"Bearer {TOKEN}x"),
    st.just(f"bearer {TOKEN}"),
    st.just(TOKEN),
    header_values,
)


@st.composite
def headers(draw: st.DrawFn) -> dict[str, str]:
    made = draw(st.dictionaries(header_names, header_values, max_size=3))
    if "Expect" in made and draw(st.booleans()):
        made["Expect"] = "100-continue"
    choice = draw(st.integers(0, 9))
    if choice < 7:
        made["Authorization"] = f"Bearer {TOKEN}"
    elif choice < 9:
        made["Authorization"] = draw(authorizations)
    return made


STANDARD_METHODS = ["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS", "TRACE"]
methods = st.one_of(
    st.sampled_from(STANDARD_METHODS),
    st.from_regex(r"\A[A-Z]{1,10}\Z"),
)


# -- properties -----------------------------------------------------------------------------


@FUZZ
@given(target=targets(), hdrs=headers())
def test_rejected_requests_change_nothing(
    fuzz_server: tuple[HttpServer, Path],
    target: tuple[str, str, bytes | None],
    hdrs: dict[str, str],
) -> None:
    srv, journal = fuzz_server
    method, path, body = target
    before = journal.read_bytes(), seeded(srv)
    status, answer = request(srv, method, path, body, hdrs)
    event(f"status {status}")
    assert status in EXPECTED, (status, answer)
    if status >= 400:
        assert (journal.read_bytes(), seeded(srv)) == before
    if status in (400, 417) and not answer.startswith(b"{"):
        # aiohttp refused the request before routing it (a method its parser does not know,
        # an 'Expect' header on a path that is no route): plain text, the API never ran.
        assert method not in STANDARD_METHODS or "Expect" in hdrs, answer
    elif method != "HEAD":
        doc: Any = json.loads(answer)
        assert isinstance(doc, dict)
        assert status < 400 or isinstance(doc.get("error"), str), answer
    if status == 401:
        assert hdrs.get("Authorization") != f"Bearer {TOKEN}"
    assert srv.running


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=300))
def test_garbage_on_the_socket_changes_nothing(
    fuzz_server: tuple[HttpServer, Path], data: bytes
) -> None:
    srv, journal = fuzz_server
    before = journal.read_bytes(), seeded(srv)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    assert (journal.read_bytes(), seeded(srv)) == before
    assert request(srv, "GET", "/v1/health", None, auth())[0] == 200


@st.composite
def channel_messages(draw: st.DrawFn) -> str | bytes:
    """A message for ``/v1/channel``: mostly a plausible request (maybe mutated), sometimes
    anything."""
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.binary(max_size=60))
    if choice == 1:
        return draw(st.one_of(st.text(max_size=60), json_values.map(json.dumps)))
    message: dict[str, Any] = {
        "id": draw(st.integers(0, 2**53 - 1) if draw(st.integers(0, 4)) else json_scalars),
        "run": draw(runs),
        "request": draw(rendezvous_requests),
    }
    if draw(st.booleans()):
        message["hold"] = draw(st.one_of(st.floats(0, 0.05), small_seconds))
    if draw(st.booleans()):
        message["seen"] = draw(tokens)
    return draw(mutated(message)).decode()


async def _on_channel(port: int, message: str | bytes) -> tuple[str, Any]:
    """Send ``message`` on a fresh channel: ("answer", doc) or ("closed", close code)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"http://127.0.0.1:{port}/v1/channel"
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.ws_connect(url) as ws,
    ):
        if isinstance(message, bytes):
            await ws.send_bytes(message)
        else:
            await ws.send_str(message)
        answer = await asyncio.wait_for(ws.receive(), 20)
        if answer.type is aiohttp.WSMsgType.TEXT:
            return "answer", json.loads(answer.data)
        return "closed", ws.close_code


def _valid_id(message: str | bytes) -> Any:
    try:
        doc = json.loads(message)
    except ValueError:
        return None
    value = doc.get("id") if isinstance(doc, dict) else None
    return value if type(value) is int and 0 <= value < 2**53 else None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=channel_messages())
def test_rejected_channel_messages_change_nothing(
    fuzz_server: tuple[HttpServer, Path], message: str | bytes
) -> None:
    srv, journal = fuzz_server
    before = journal.read_bytes(), seeded(srv)
    kind, what = asyncio.run(_on_channel(srv.port, message))
    msg_id = None if isinstance(message, bytes) else _valid_id(message)
    event(f"{kind} {what.get('status') if kind == 'answer' else what}")
    if msg_id is None:  # not the channel's protocol: closed, the reason given
        assert (kind, what) in [("closed", 1003), ("closed", 1007)], (kind, what)
        assert (journal.read_bytes(), seeded(srv)) == before
    else:
        assert kind == "answer" and what["id"] == msg_id, (kind, what)
        if "reply" not in what:
            assert what["status"] == 400 and isinstance(what["error"], str), what
            assert (journal.read_bytes(), seeded(srv)) == before
    assert srv.running


def test_server_is_up_and_answers_every_route(fuzz_server: tuple[HttpServer, Path]) -> None:
    srv, journal = fuzz_server
    assert srv.running
    status, answer = request(srv, "GET", "/v1/health", None, auth())
    assert status == 200 and json.loads(answer)["ok"] is True
    base = f"/v1/runs/{RUN}"
    assert request(srv, "GET", f"{base}/status", None, auth())[0] == 200
    assert request(srv, "GET", base, None, auth())[0] in (200, 404)  # the fuzzer may delete it
    assert request(srv, "GET", f"{base}/state", None, auth())[0] == 200
    assert json.loads(journal.read_bytes().splitlines()[0])["format"] == "aelastic.http.runs"
    for record in re.split(r"\n(?=\d{4}-\d\d-\d\d )", srv.stderr):
        # The only tracebacks: aiohttp's parser refusing a request that is not HTTP.
        assert "Traceback" not in record or (
            "aiohttp.server: Error handling request" in record
            and "aiohttp.http_exceptions." in record
        ), record
    assert "internal error" not in srv.stderr, srv.stderr
