"""Fuzz the HTTP rendezvous server: random methods, paths, queries, bodies and headers.

The server runs for real (a subprocess) with a token and a persistence file. Because it
answers only after every change is on disk, the file is an exact picture of everything it
stores: a rejected request (4xx) must leave it byte for byte as it was. Every answer must be a
JSON object (with ``error`` when it is a rejection), never a 5xx, and the server stays up.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests._http_server import HttpServer

TOKEN = "fuzz-token"
RUN = "fuzz-run"
EXPECTED = {200, 400, 401, 404, 405, 409, 413, 417}
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpServer, Path]]:
    path = tmp_path_factory.mktemp("fuzz") / "runs.json"
    with HttpServer(token=TOKEN, persist=path, extra_args=("--max-body", "65536")) as srv:
        seed(srv)
        yield srv, path


def request(
    srv: HttpServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=20)
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
    """A run with a state and some keys for the fuzzer to aim at."""
    base = f"/v1/runs/{RUN}"
    body = json.dumps({"state": b64(b"seed-state"), "token": ""}).encode()
    assert request(srv, "PUT", base + "/state", body, auth())[0] == 200
    for key, value in [("k", b"v"), ("n", b"7"), ("", b"empty")]:
        body = json.dumps({"key": key, "value": b64(value)}).encode()
        assert request(srv, "POST", base + "/kv/set", body, auth())[0] == 200


# -- strategies -----------------------------------------------------------------------------

texts = st.text(max_size=40)
small_seconds = st.one_of(
    st.floats(max_value=0.1, allow_nan=False),
    st.floats(min_value=300.5),
    st.just(math.nan),
    st.integers(max_value=0),
    texts,
)
b64_values = st.one_of(st.binary(max_size=64).map(b64), texts, st.none(), st.integers())
tokens = st.one_of(st.just(""), st.from_regex(r"\A[0-9a-f]{1,16}\.[0-9]{1,5}\Z"), texts)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
fields = st.fixed_dictionaries(
    {},
    optional={
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
    st.just(b"x" * 70000),  # over --max-body
)
runs = st.one_of(st.just(RUN), st.just(RUN), texts.filter(bool), st.sampled_from(["..", "a/b"]))
routes = st.sampled_from(
    ["/state", "/kv/set", "/kv/get", "/kv/add", "/kv/compare_set", "/kv/delete", "/kv/wait", ""]
)
queries = st.dictionaries(
    st.sampled_from(["token", "wait", "x"]),
    st.one_of(tokens, small_seconds.map(str)),
    max_size=3,
)
keys = st.sampled_from(["k", "n", "", "new", "x"])
valid_b64 = st.binary(max_size=64).map(b64)
#: For each route: its method, and a body that fits its schema (before mutation).
PLAUSIBLE: dict[str, tuple[str, st.SearchStrategy[dict[str, Any]]]] = {
    "/state": ("PUT", st.fixed_dictionaries({"state": valid_b64, "token": tokens})),
    "/kv/set": ("POST", st.fixed_dictionaries({"key": keys, "value": valid_b64})),
    "/kv/get": ("POST", st.fixed_dictionaries({"keys": st.lists(keys, min_size=1, max_size=3)})),
    "/kv/add": ("POST", st.fixed_dictionaries({"key": keys, "amount": st.integers(-9, 9)})),
    "/kv/compare_set": (
        "POST",
        st.fixed_dictionaries(
            {"key": keys, "expected": st.none() | valid_b64, "desired": valid_b64}
        ),
    ),
    "/kv/delete": ("POST", st.fixed_dictionaries({"key": keys})),
    "/kv/wait": (
        "POST",
        st.fixed_dictionaries(
            {"keys": st.lists(keys, min_size=1, max_size=3), "timeout": st.floats(0, 0.05)}
        ),
    ),
    "": ("DELETE", st.just({})),
}


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
    method, plausible = PLAUSIBLE[route]
    if route == "/state" and draw(st.booleans()):
        method, body = "GET", None
        query = {"token": draw(tokens), "wait": draw(st.floats(0, 0.05))}
        path += "?" + urlencode(draw(st.one_of(st.just(query), queries)))
    elif draw(st.integers(0, 15)) == 0:
        body = b'{"junk": "' + b"x" * 70000 + b'"}'  # over --max-body
    elif draw(st.integers(0, 3)) > 0:
        body = draw(mutated(draw(plausible)))
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
    srv, persisted = fuzz_server
    method, path, body = target
    before = persisted.read_bytes()
    status, answer = request(srv, method, path, body, hdrs)
    event(f"status {status}")
    assert status in EXPECTED, (status, answer)
    if status >= 400:
        assert persisted.read_bytes() == before
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


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=300))
def test_garbage_on_the_socket_changes_nothing(
    fuzz_server: tuple[HttpServer, Path], data: bytes
) -> None:
    srv, persisted = fuzz_server
    before = persisted.read_bytes()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    assert persisted.read_bytes() == before
    assert request(srv, "GET", "/v1/health", None, auth())[0] == 200


def test_server_is_up_and_the_seeded_run_is_intact(fuzz_server: tuple[HttpServer, Path]) -> None:
    srv, _ = fuzz_server
    assert srv.running
    status, answer = request(srv, "GET", "/v1/health", None, auth())
    assert status == 200 and json.loads(answer)["ok"] is True
    status, answer = request(srv, "GET", f"/v1/runs/{RUN}/state", None, auth())
    assert status == 200
    assert "Traceback" not in srv.stderr, srv.stderr
