"""The routes of the rendezvous server: validate, apply at once, wait until durable, answer.

How it works: each handler validates its query and body completely (``wire.require_*``,
:mod:`aelastic.core.wire`) before touching the :class:`~._runs.RunStore`, so a rejected
request changes nothing. It then applies its change at once (the runs live in this event
loop) and, when persistence is on, awaits the journal commit holding it before it answers.
Rendezvous requests are idempotent by nature (joining twice is joining once); store writes
may carry an ``Idempotency-Key`` so that a retried ``kv/add`` counts once (:class:`Replays`).
Long-polls (``status?token=&wait=``, ``kv/wait``) are held until the change, the timeout,
or the server's shutdown (then ``503``, and clients retry against the restarted server).
A request that may make a new run is first admitted by the store (``503`` past its limit
of runs) and by the quotas of runs its client and its scoped token may make (``429``:
:mod:`._tenancy.creations`), a join that adds a node by its client's quota (``429``:
:mod:`._quota`), a store write by the stores' limits (``413``: :mod:`._tenancy.sizes`,
checked in the step that applies it); a body must arrive within ``BODY_TIMEOUT``
(``408``). A scoped token reaches its own runs only (checked by the bearer middleware), and
lists only them. The operator's routes (closing and deleting a run) are checked by
:mod:`._operator`.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from ....core.race import wait_within
from ....core.state import FORMAT, FORMAT_VERSION, Request, Transition
from ....core.wire import (
    WireError,
    health_to_json,
    reply_to_json,
    request_from_json,
    snapshot_to_json,
    status_to_json,
)
from ..._engine import add_int64, now_ms
from ..wire import (
    API_PREFIX,
    API_VERSION,
    MAX_LISTED_RUNS,
    SchemaError,
    b64encode,
    require_bytes,
    require_int,
    require_key,
    require_keys,
    require_object,
    require_optional_bytes,
    require_run_id,
    require_seconds,
    require_token,
)
from ._answer import answer
from ._operator import require_operator
from ._quota import QUOTA
from ._runs import RunStore
from ._tenancy import RUN_QUOTA, STORE_QUOTA, scope_of

__all__ = ["BODY_TIMEOUT", "REPLAYS", "STORE", "Replays", "add_routes"]

_MAX_REPLAYS = 8192
_MAX_REPLAY_SIZE = 1024
_MAX_IDEMPOTENCY_KEY = 128
_Reply = tuple[int, dict[str, Any]]

#: What a node of the first state format reads at the old state route: a state of this
#: format version, so that it fails with an error naming both versions.
_V1_MARKER = b64encode(
    json.dumps({"format": FORMAT, "version": FORMAT_VERSION}, separators=(",", ":")).encode()
)


class Replays:
    """Answers of recent store writes, by idempotency key (bounded, oldest out).

    A change is applied synchronously, so the answer is known (and kept) before any
    duplicate can arrive; a duplicate gets the kept answer and, like the first, waits until
    the change is on disk. Large answers are not kept: their requests are naturally
    idempotent (``compare_set``), so a retry may simply be evaluated again.
    """

    def __init__(self) -> None:
        self._answers: OrderedDict[str, _Reply] = OrderedDict()

    def once(self, key: str | None, apply: Callable[[], _Reply]) -> _Reply:
        """Apply a request once per ``key``; a repeat gets the first answer."""
        if key is None:
            return apply()
        reply = self._answers.get(key)
        if reply is None:
            reply = apply()
            if sum(len(v) for v in reply[1].values() if isinstance(v, str)) <= _MAX_REPLAY_SIZE:
                self._answers[key] = reply
                if len(self._answers) > _MAX_REPLAYS:
                    self._answers.popitem(last=False)
        return reply


STORE: web.AppKey[RunStore] = web.AppKey("aelastic_run_store", RunStore)
REPLAYS = web.AppKey("aelastic_replays", Replays)
#: Seconds a request's body may take to arrive.
BODY_TIMEOUT = web.AppKey("aelastic_body_timeout", float)


def _store(request: web.Request) -> RunStore:
    return request.app[STORE]


def _admitted(request: web.Request, run_id: str) -> RunStore:
    """The store, once it is known that the request may make ``run_id``."""
    request.app[RUN_QUOTA].admit(request, run_id)
    return _store(request)


def _run_id(request: web.Request) -> str:
    return require_run_id(request.match_info["run_id"])


def _query(request: web.Request, allowed: set[str]) -> Mapping[str, str]:
    query = request.query
    for name in query:
        if name not in allowed:
            raise SchemaError(f"unknown query parameter '{name}'")
        if len(query.getall(name)) > 1:
            raise SchemaError(f"query parameter '{name}' is given more than once")
    return query


async def _json(request: web.Request) -> Any:
    if request.content.is_eof():  # the whole body came with the head (the usual case)
        return _parse(await request.read())
    timeout = request.app[BODY_TIMEOUT]
    try:
        raw = await wait_within(request.read(), timeout)
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {timeout:g} s"
        ) from None
    except ConnectionResetError:  # the client went away mid-body (a node killed meanwhile)
        raise web.HTTPBadRequest(reason="the client closed the connection mid-body") from None
    return _parse(raw)


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise SchemaError("the body must be JSON (UTF-8)") from None


async def _body(request: web.Request, fields: set[str]) -> Mapping[str, Any]:
    body = require_object(await _json(request))
    unknown = set(body) - fields
    if unknown:
        raise SchemaError(f"unknown field(s): {', '.join(sorted(map(repr, unknown)))}")
    return body


def _idempotency_key(request: web.Request) -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= _MAX_IDEMPOTENCY_KEY:
        raise SchemaError(f"'Idempotency-Key' must have 1 to {_MAX_IDEMPOTENCY_KEY} characters")
    return None if key is None else f"{request.method} {request.path} {key}"


async def _mutate(request: web.Request, apply: Callable[[], _Reply]) -> web.Response:
    """Apply a change (once per idempotency key), wait until it is durable, answer.

    If the journal cannot be written the answer is 503: the change is kept in memory, and a
    retry with the same key gets the same answer once the journal is written.
    """
    reply = request.app[REPLAYS].once(_idempotency_key(request), apply)
    await _store(request).durable()
    status, body = reply
    return web.json_response(body, status=status)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# -- health and the rendezvous ------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "service": "aelastic-rendezvous", "api": API_VERSION})


async def _rendezvous(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    query = _query(request, {"hold", "seen"})
    hold = require_seconds(query["hold"], "'hold'") if "hold" in query else 0.0
    seen = require_token(query["seen"], "'seen'") if "seen" in query else None
    try:
        rdzv_request = request_from_json(await _json(request))
    except WireError as exc:
        raise SchemaError(str(exc)) from None

    def gone() -> bool:
        return request.transport is None or request.transport.is_closing()

    request.app[RUN_QUOTA].admit(request, run_id)
    request.app[QUOTA].admit(request, run_id, rdzv_request)
    reply = await answer(_store(request), run_id, rdzv_request, hold, seen, gone)
    return web.json_response(reply_to_json(reply))


async def _status(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    query = _query(request, {"wait", "token"})
    wait = require_seconds(query["wait"], "'wait'") if "wait" in query else 0.0
    token = require_token(query["token"]) if "token" in query else None
    if "wait" in query and token is None:
        raise SchemaError("'wait' needs the 'token' to wait for a change from")
    store = _store(request)
    engine = store.engine
    if wait > 0 and token is not None:
        request.app[RUN_QUOTA].admit(request, run_id)  # waiting makes the run
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while engine.status(run_id, 0).token == token and loop.time() < deadline:
            if store.closing:
                return _error(503, "the server is shutting down")
            await engine.wait_status(run_id, token, deadline - loop.time())
            if store.closing and engine.status(run_id, 0).token == token:
                return _error(503, "the server is shutting down")
    await store.durable()
    return web.json_response(status_to_json(engine.status(run_id, now_ms())))


async def _snapshot(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    _query(request, set())
    snapshot = _store(request).engine.snapshot(run_id, now_ms())
    if snapshot is None:
        return _error(404, f"no run {run_id!r} on this server")
    return web.json_response(snapshot_to_json(snapshot))


async def _job_health(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    _query(request, set())
    health = _store(request).engine.health(run_id)
    if health is None:
        return _error(404, f"no run {run_id!r} on this server")
    return web.json_response(health_to_json(health))


async def _list_runs(request: web.Request) -> web.Response:
    query = _query(request, {"limit"})
    limit = 1000
    if "limit" in query:
        text = query["limit"]
        digits = text.isascii() and text.isdigit() and len(text) <= 6
        if not digits or not 1 <= int(text) <= MAX_LISTED_RUNS:
            raise SchemaError(f"'limit' must be a whole number from 1 to {MAX_LISTED_RUNS}")
        limit = int(text)
    prefix = scope_of(request).prefix or ""
    runs = _store(request).engine.list_runs(now_ms(), limit, prefix)
    body = [{"run_id": run_id, "status": status_to_json(status)} for run_id, status in runs]
    return web.json_response({"runs": body})


async def _close_run(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    _query(request, set())
    require_operator(request)
    engine = _store(request).engine

    def apply() -> _Reply:
        reply = engine.apply(run_id, Request.operator_close(), now_ms())
        closed = reply.transition is Transition.MARK_CLOSED
        return 200, {"closed": closed, "status": status_to_json(reply.status)}

    return await _mutate(request, apply)


async def _delete_run(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    _query(request, set())
    require_operator(request)
    store = _store(request)
    return await _mutate(request, lambda: (200, {"deleted": store.delete(run_id)}))


async def _first_format_state(request: web.Request) -> web.Response:
    """The route of the first state format: answer a state of this version, never apply."""
    status = 200 if request.method == "GET" else 409
    body = {"state": _V1_MARKER, "token": "0.1", "error": "rendezvous state format 2"}
    return web.json_response(body, status=status)


# -- the members' store -------------------------------------------------------------------


async def _kv_set(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"key", "value"})
    key, value = require_key(body), require_bytes(body, "value")
    sizes = request.app[STORE_QUOTA]
    sizes.check_value(value)
    engine = _admitted(request, run_id).engine

    def apply() -> _Reply:
        sizes.check_write(run_id, key, len(value))
        engine.kv_set(run_id, key, value)
        return 200, {}

    return await _mutate(request, apply)


async def _kv_get(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    keys = require_keys(await _body(request, {"keys"}))
    store = _store(request)
    values = [None if v is None else b64encode(v) for v in store.engine.kv_get(run_id, keys)]
    await store.durable()
    return web.json_response({"values": values})


async def _kv_add(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"key", "amount"})
    key, amount = require_key(body), require_int(body, "amount")
    sizes = request.app[STORE_QUOTA]
    engine = _admitted(request, run_id).engine

    def apply() -> _Reply:
        try:
            total = add_int64(engine.kv_get(run_id, [key])[0], amount, key)
            sizes.check_write(run_id, key, len(str(total)))
            return 200, {"value": engine.kv_add(run_id, key, amount)}
        except ValueError as exc:
            return 409, {"error": str(exc)}

    return await _mutate(request, apply)


async def _kv_compare_set(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"key", "expected", "desired"})
    key = require_key(body)
    expected = require_optional_bytes(body, "expected")
    desired = require_bytes(body, "desired")
    sizes = request.app[STORE_QUOTA]
    sizes.check_value(desired)
    engine = _admitted(request, run_id).engine

    def apply() -> _Reply:
        if engine.kv_get(run_id, [key])[0] == expected:  # it will write
            sizes.check_write(run_id, key, len(desired))
        value = engine.kv_compare_set(run_id, key, expected, desired)
        return 200, {"value": b64encode(value)}

    return await _mutate(request, apply)


async def _kv_delete(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    key = require_key(await _body(request, {"key"}))
    engine = _store(request).engine
    return await _mutate(request, lambda: (200, {"deleted": engine.kv_delete(run_id, key)}))


async def _kv_wait(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"keys", "timeout"})
    keys = require_keys(body)
    timeout = require_seconds(body.get("timeout"), "'timeout'")
    store = _admitted(request, run_id)
    if store.closing:
        return _error(503, "the server is shutting down")
    ready = await store.engine.kv_wait(run_id, keys, timeout)
    if not ready and store.closing:
        return _error(503, "the server is shutting down")
    await store.durable()
    return web.json_response({"ready": ready})


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue`` goes on; any other expectation fails with a JSON 417."""
    expect = request.headers.get("Expect", "")
    if request.version != (1, 1):
        return None
    if expect.lower() != "100-continue":
        return _error(417, f"unsupported 'Expect: {expect}' (only 100-continue)")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0
    return None


def add_routes(app: web.Application) -> None:
    """Add the API's routes (under ``/v1``) to ``app``."""
    run = API_PREFIX + "/runs/{run_id:[^/]+}"  # aiohttp's default pattern refuses braces
    routes = [
        ("GET", API_PREFIX + "/health", _health),
        ("GET", API_PREFIX + "/runs", _list_runs),
        ("POST", run + "/rendezvous", _rendezvous),
        ("GET", run + "/status", _status),
        ("GET", run, _snapshot),
        ("GET", run + "/health", _job_health),
        ("DELETE", run, _delete_run),
        ("POST", run + "/close", _close_run),
        ("GET", run + "/state", _first_format_state),
        ("PUT", run + "/state", _first_format_state),
        ("POST", run + "/kv/set", _kv_set),
        ("POST", run + "/kv/get", _kv_get),
        ("POST", run + "/kv/add", _kv_add),
        ("POST", run + "/kv/compare_set", _kv_compare_set),
        ("POST", run + "/kv/delete", _kv_delete),
        ("POST", run + "/kv/wait", _kv_wait),
    ]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler, expect_handler=_expect)
