"""The aiohttp application of the rendezvous server: routes, validation, auth, errors.

How it works: two middlewares wrap every route. The outer one turns every failure into a
JSON ``{"error": ...}`` answer with the right status (a bug gives 500, never a dropped
connection); the inner one checks the bearer token. Each handler validates its query and
body completely (``wire.require_*``) before touching the :class:`RunStore`, so a rejected
request changes nothing; it then applies its change at once (the store lives in this event
loop) and, when persistence is on, awaits the snapshot holding it before it answers.
Mutating requests may carry an ``Idempotency-Key``: a retry of one that was applied gets
the first answer again instead of applying twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from ._runs import PersistenceError, Run, RunStore
from .wire import (
    API_PREFIX,
    MAX_BODY,
    TOKEN_ENV,
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

__all__ = ["DEFAULT_RUN_TTL", "create_app", "resolve_token"]

log = logging.getLogger("aelastic.backends.http.server")

#: Runs nobody changed for this long (seconds) are forgotten.
DEFAULT_RUN_TTL = 24 * 3600.0

_STORE: web.AppKey[RunStore] = web.AppKey("aelastic_run_store", RunStore)
_MAX_REPLAYS = 8192
_MAX_REPLAY_SIZE = 1024
_MAX_IDEMPOTENCY_KEY = 128
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Reply = tuple[int, dict[str, Any]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SchemaError as exc:
        return _error(400, str(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(413, f"the request body is too large ({exc.text})")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except PersistenceError as exc:
        return _error(503, str(exc))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("internal error answering %s %s", request.method, request.path)
        return _error(500, "internal server error")


def _auth_middleware(token: str) -> Any:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: _Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            return web.json_response(
                {"error": "unauthorized: a valid 'Authorization: Bearer <token>' is required"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="aelastic"'},
            )
        return await handler(request)

    return auth


class _Replays:
    """Answers of recent mutating requests, by idempotency key (bounded, oldest out).

    A change is applied synchronously, so the answer is known (and cached) before any
    duplicate can arrive; a duplicate gets the cached answer and, like the first, waits
    until the change is on disk. Large answers (a lost compare-and-set carries the whole
    state) are not kept: their requests change nothing, or are naturally idempotent
    (``compare_set``), so a retry may simply be evaluated again.
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


_REPLAYS = web.AppKey("aelastic_replays", _Replays)


def _store(request: web.Request) -> RunStore:
    return request.app[_STORE]


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


async def _body(request: web.Request, fields: set[str]) -> Mapping[str, Any]:
    raw = await request.read()
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise SchemaError("the body must be JSON (UTF-8)") from None
    body = require_object(doc)
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

    If the persistence file cannot be written the answer is 503: the change is kept in
    memory, and a retry with the same key gets the same answer once the file is written.
    """
    reply = request.app[_REPLAYS].once(_idempotency_key(request), apply)
    await _store(request).durable()
    status, body = reply
    return web.json_response(body, status=status)


def _state_reply(run: Run) -> dict[str, Any]:
    return {"state": None if run.state is None else b64encode(run.state), "token": run.token}


# -- routes -------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "service": "aelastic-rendezvous", "api": 1})


async def _get_state(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    query = _query(request, {"wait", "token"})
    wait = require_seconds(query["wait"], "'wait'") if "wait" in query else 0.0
    token = require_token(query["token"]) if "token" in query else None
    if "wait" in query and token is None:
        raise SchemaError("'wait' needs the 'token' to wait for a change from")
    store = _store(request)
    if wait > 0 and token is not None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        run = store.run(run_id)
        while run.token == token and not store.closing and loop.time() < deadline:
            await store.wait_state(run, deadline - loop.time())
            run = store.run(run_id)
        if run.token == token and store.closing:
            return _error(503, "the server is shutting down")
    run = store.runs.get(run_id) or Run()
    reply = _state_reply(run)
    await store.durable()
    return web.json_response(reply)


async def _put_state(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    _query(request, set())
    body = await _body(request, {"state", "token"})
    state = require_bytes(body, "state")
    token = require_token(body.get("token"))
    store = _store(request)

    def apply() -> _Reply:
        run = store.run(run_id)
        if run.token != token:
            return 409, {"error": "the stored token differs", **_state_reply(run)}
        store.state_written(run, state)
        return 200, {"token": run.token}

    return await _mutate(request, apply)


async def _delete_run(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    _query(request, set())
    store = _store(request)
    return await _mutate(request, lambda: (200, {"deleted": store.delete(run_id)}))


async def _kv_set(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"key", "value"})
    key, value = require_key(body), require_bytes(body, "value")
    store = _store(request)

    def apply() -> _Reply:
        run = store.run(run_id)
        run.kv[key] = value
        store.kv_changed(run)
        return 200, {}

    return await _mutate(request, apply)


async def _kv_get(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    keys = require_keys(await _body(request, {"keys"}))
    store = _store(request)
    kv = run.kv if (run := store.runs.get(run_id)) is not None else {}
    values = [None if (v := kv.get(k)) is None else b64encode(v) for k in keys]
    await store.durable()
    return web.json_response({"values": values})


async def _kv_add(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"key", "amount"})
    key, amount = require_key(body), require_int(body, "amount")
    store = _store(request)

    def apply() -> _Reply:
        run = store.run(run_id)
        current = run.kv.get(key)
        try:
            value = (0 if current is None else int(current)) + amount
        except ValueError:
            return 409, {"error": f"the value of key {key!r} is not an integer"}
        run.kv[key] = str(value).encode()
        store.kv_changed(run)
        return 200, {"value": value}

    return await _mutate(request, apply)


async def _kv_compare_set(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"key", "expected", "desired"})
    key = require_key(body)
    expected = require_optional_bytes(body, "expected")
    desired = require_bytes(body, "desired")
    store = _store(request)

    def apply() -> _Reply:
        run = store.run(run_id)
        current = run.kv.get(key)
        if current is None and expected is not None:
            return 200, {"value": b64encode(expected)}
        if current != expected:
            assert current is not None
            return 200, {"value": b64encode(current)}
        run.kv[key] = desired
        store.kv_changed(run)
        return 200, {"value": b64encode(desired)}

    return await _mutate(request, apply)


async def _kv_delete(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    key = require_key(await _body(request, {"key"}))
    store = _store(request)

    def apply() -> _Reply:
        run = store.runs.get(run_id)
        if run is None or run.kv.pop(key, None) is None:
            return 200, {"deleted": False}
        store.kv_changed(run)
        return 200, {"deleted": True}

    return await _mutate(request, apply)


async def _kv_wait(request: web.Request) -> web.Response:
    run_id = _run_id(request)
    body = await _body(request, {"keys", "timeout"})
    keys = require_keys(body)
    timeout = require_seconds(body.get("timeout"), "'timeout'")
    store = _store(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    run = store.run(run_id)
    while not all(k in run.kv for k in keys):
        if store.closing:
            return _error(503, "the server is shutting down")
        if loop.time() >= deadline:
            break
        await store.wait_kv(run, deadline - loop.time())
        run = store.run(run_id)
    ready = all(k in run.kv for k in keys)
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


def _routes(app: web.Application) -> None:
    run = API_PREFIX + "/runs/{run_id}"
    routes = [
        ("GET", API_PREFIX + "/health", _health),
        ("GET", run + "/state", _get_state),
        ("PUT", run + "/state", _put_state),
        ("DELETE", run, _delete_run),
        ("POST", run + "/kv/set", _kv_set),
        ("POST", run + "/kv/get", _kv_get),
        ("POST", run + "/kv/add", _kv_add),
        ("POST", run + "/kv/compare_set", _kv_compare_set),
        ("POST", run + "/kv/delete", _kv_delete),
        ("POST", run + "/kv/wait", _kv_wait),
    ]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler, expect_handler=_expect)


def resolve_token(token: str | None) -> str | None:
    """``token`` itself, or the ``AELASTIC_HTTP_TOKEN`` environment variable when ``None``.

    An empty string means no authentication.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return token or None


def create_app(
    *,
    token: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    max_body: int = MAX_BODY,
    run_ttl: float = DEFAULT_RUN_TTL,
) -> web.Application:
    """Create the rendezvous server's aiohttp application (mountable with ``add_subapp``).

    Args:
        token: Bearer token every request must carry; ``None`` reads ``AELASTIC_HTTP_TOKEN``
            from the environment, ``""`` disables authentication.
        persist_path: JSON file keeping the runs across restarts (``None``: memory only).
        max_body: Largest request body accepted, in bytes (larger: ``413``).
        run_ttl: Seconds after which a run nobody changed or waits on is forgotten
            (``0``: never).

    Returns:
        The application; its routes live under ``/v1``.

    Raises:
        PersistenceError: ``persist_path`` exists but is not a valid runs file.
        ValueError: ``max_body`` or ``run_ttl`` is out of range.
    """
    if max_body < 1024:
        raise ValueError(f"max_body ({max_body}) must be at least 1024 bytes")
    if not run_ttl >= 0:
        raise ValueError(f"run_ttl ({run_ttl}) must be a non-negative number of seconds")
    secret = resolve_token(token)
    middlewares: list[Any] = [_errors]
    if secret is not None:
        middlewares.append(_auth_middleware(secret))
    app = web.Application(client_max_size=max_body, middlewares=middlewares)
    store = RunStore(persist_path)
    app[_STORE] = store
    app[_REPLAYS] = _Replays()
    _routes(app)

    async def on_shutdown(app: web.Application) -> None:
        store.close()

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        sweeper = asyncio.get_running_loop().create_task(_sweep(store, run_ttl))
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        with contextlib.suppress(PersistenceError):
            await store.durable()

    app.on_shutdown.append(on_shutdown)
    app.cleanup_ctx.append(lifetime)
    return app


async def _sweep(store: RunStore, ttl: float) -> None:
    if not ttl:
        return
    while True:
        await asyncio.sleep(min(ttl / 4, 600.0))
        if store.expire(ttl):
            with contextlib.suppress(PersistenceError):
                await store.durable()
