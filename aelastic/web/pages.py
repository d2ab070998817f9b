"""The live pages: ``/`` (the runs) and ``/runs/<run id>`` (one run), streamed to the browser.

How it works: :func:`install_pages` adds the routes to an aiohttp application (the HTTP
rendezvous server's, or the dashboard's). A page is a small HTML shell; the browser's
script (``static/app.js``) opens the page's event stream (server-sent events:
``<page>/stream``) and draws each view it receives (:mod:`.model`, from the page's
:class:`~.feeds.Feed`) without reloading. A run the source does not know is a 404 page;
a route that does not exist stays the API's 404 JSON.

With a token, the pages and their streams need it: a request carrying ``Authorization:
Bearer <token>`` or a session's cookie is let in, any other gets a login form (``POST
/login``; ``POST /logout`` ends the session): :mod:`._gate`. The static files (style,
script) are public: they hold no data. Pages send a strict Content-Security-Policy (no
inline script, nothing from elsewhere).

Event streams are bounded: a client (its address, or the one a trusted proxy names) holds
at most :data:`MAX_STREAMS_PER_CLIENT` at once (more: ``429``), a stream is opened only
for a run that exists (``404``), and a stream whose browser went away is noticed within a
second (its place is free again).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import cache
from html import escape
from importlib import resources
from string import Template
from urllib.parse import quote

from aiohttp import web

from ..backends._engine import Engine
from ..backends.http.server import CLIENTS, OWN_AUTH, THROTTLE, AuthThrottle, Clients
from ..backends.http.wire import SchemaError, require_run_id
from ._gate import COOKIE, SESSION_TTL, Gate, Throttled, login_form, next_page
from .feeds import Feed, FeedHub, FeedLimitError
from .sources import EngineSource, RunSource

__all__ = ["COOKIE", "HUB", "MAX_STREAMS_PER_CLIENT", "Gate", "install_pages", "serve_pages"]

#: The hub of an application's pages.
HUB = web.AppKey("aelastic_feed_hub", FeedHub)
#: Seconds between two keep-alive comments of an idle stream.
KEEPALIVE = 15.0
#: Seconds between two looks at whether a stream's browser went away.
_GONE_EVERY = 1.0
#: Event streams one client may hold at once. A browser holds at most six per server
#: (HTTP/1.1's connections per host), so this leaves room for a few people behind one
#: address (a NAT; behind a proxy, name it with --trusted-proxy).
MAX_STREAMS_PER_CLIENT = 16
_STATIC = {"style.css": "text/css", "app.js": "text/javascript", "favicon.svg": "image/svg+xml"}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make a form's Origin "null"
    "Cache-Control": "no-store",
}
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@cache
def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static").joinpath(name).read_bytes()


@cache
def _version() -> str:
    return hashlib.sha256(_static("app.js") + _static("style.css")).hexdigest()[:12]


def _render(name: str, **fields: str) -> str:
    return Template(_static(name).decode()).substitute(fields)


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", headers=_HEADERS)


def _message_page(root: str, title: str, message: str, status: int) -> web.Response:
    return _html(
        _render("message.html", root=root, title=escape(title), message=escape(message)),
        status,
    )


def _login_page(root: str, next_path: str, message: str, status: int = 401) -> web.Response:
    text = _render(
        "login.html", root=root, next=escape(next_path, quote=True), message=escape(message)
    )
    return _html(text, status)


def _run_path(run_id: str) -> str:
    return "runs/" + quote(run_id, safe="")


def _throttled(root: str, exc: Throttled, json_answer: bool = False) -> web.Response:
    seconds = str(max(math.ceil(exc.retry_after), 1))
    message = f"Too many failed token checks from this address: retry in {seconds} s."
    if json_answer:
        response = web.json_response({"error": message}, status=429)
    else:
        response = _message_page(root, "Too many attempts", message, 429)
    response.headers["Retry-After"] = seconds
    return response


class _Pages:
    def __init__(self, hub: FeedHub, gate: Gate) -> None:
        self.hub = hub
        self.gate = gate
        self.streams: Counter[str] = Counter()  # open event streams per client

    def _shell(self, root: str, view: str, run_id: str, stream: str) -> web.Response:
        logout = ""
        if self.gate.token is not None:
            logout = (
                f'<form class="logout" method="post" action="{root}logout">'
                '<button type="submit">Log out</button></form>'
            )
        title = "aelastic · runs" if view == "runs" else f"aelastic · {run_id}"
        text = _render(
            "page.html",
            root=root,
            title=escape(title),
            view=view,
            run_id=escape(run_id, quote=True),
            stream=escape(stream, quote=True),
            where=escape(self.hub.source.where),
            version=_version(),
            logout=logout,
        )
        return _html(text)

    async def runs_page(self, request: web.Request) -> web.Response:
        try:
            if not self.gate.allows(request):
                return _login_page("./", "", "Log in to see the runs.")
        except Throttled as exc:
            return _throttled("./", exc)
        return self._shell("./", "runs", "", "stream")

    async def run_page(self, request: web.Request) -> web.Response:
        raw = request.match_info["run_id"]
        try:
            run_id = require_run_id(raw)
        except SchemaError as exc:
            return _message_page("../", "Not a run id", f"{raw[:80]!r}: {exc}.", 404)
        try:
            if not self.gate.allows(request):
                return _login_page("../", _run_path(run_id), f"Log in to see run {run_id!r}.")
        except Throttled as exc:
            return _throttled("../", exc)
        if not await self.hub.exists(run_id):
            message = f"No run {run_id!r} has a rendezvous state at {self.hub.source.where}."
            return _message_page("../", "No such run", message, 404)
        return self._shell("../", "run", run_id, quote(run_id, safe="") + "/stream")

    def _refused(self, request: web.Request) -> web.Response | None:
        """The answer to a stream's request that may not open one (``None``: it may)."""
        try:
            if not self.gate.allows(request):
                return web.json_response({"error": "log in first"}, status=401)
        except Throttled as exc:
            return _throttled("./", exc, json_answer=True)
        return self._full(request)

    def _full(self, request: web.Request) -> web.Response | None:
        if self.streams[self.gate.clients.key(request)] < MAX_STREAMS_PER_CLIENT:
            return None
        return web.json_response(
            {"error": f"this address holds {MAX_STREAMS_PER_CLIENT} event streams of these "
             "pages already: close a page first"},
            status=429,
            headers={"Retry-After": "5"},
        )  # fmt: skip

    async def runs_stream(self, request: web.Request) -> web.StreamResponse:
        refused = self._refused(request)
        if refused is not None:
            return refused
        return await self._stream(request, self.hub.runs())

    async def run_stream(self, request: web.Request) -> web.StreamResponse:
        try:
            run_id = require_run_id(request.match_info["run_id"])
        except SchemaError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not await self.hub.exists(run_id):  # a made-up run gets no reader
            return web.json_response({"error": f"no run {run_id!r}"}, status=404)
        try:
            feed = self.hub.run(run_id)
        except FeedLimitError as exc:
            return web.json_response({"error": str(exc)}, status=503)
        return await self._stream(request, feed)

    async def _stream(self, request: web.Request, feed: Feed) -> web.StreamResponse:
        full = self._full(request)  # again: a source's read may have let others in meanwhile
        if full is not None:
            return full
        client = self.gate.clients.key(request)
        self.streams[client] += 1
        try:
            return await self._send_stream(request, feed)
        finally:
            self.streams[client] -= 1
            if self.streams[client] <= 0:
                del self.streams[client]

    async def _send_stream(self, request: web.Request, feed: Feed) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # proxies: pass each event on at once
            }
        )
        await response.prepare(request)
        seen = 0
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + KEEPALIVE
        try:
            await response.write(b"retry: 2000\n\n")
            async with self.hub.watching(feed):
                while not (self.hub.closing or feed.stopped):
                    # Woken every second: a browser gone is noticed by its closed socket,
                    # not only by a keep-alive that fails to go out.
                    news = await feed.next(seen, _GONE_EVERY)
                    if self.hub.closing or feed.stopped or _gone(request):
                        break
                    if news is None:
                        if loop.time() >= quiet_until:
                            quiet_until = loop.time() + KEEPALIVE
                            await response.write(b": keep-alive\n\n")
                        continue
                    quiet_until = loop.time() + KEEPALIVE
                    seen, view = news
                    data = json.dumps(view, separators=(",", ":"), allow_nan=False)
                    await response.write(b"data: " + data.encode() + b"\n\n")
        except ConnectionResetError:
            pass  # the browser went away
        return response

    async def login(self, request: web.Request) -> web.Response:
        if not self.gate.from_here(request):
            return _message_page("./", "Refused", _ELSEWHERE, 403)
        try:
            form = await login_form(request)
            next_path = next_page(form.get("next"))
        except SchemaError as exc:
            return _message_page("./", "Bad request", f"Not a login: {exc}.", 400)
        if self.gate.token is None:
            return _redirect(next_path)
        try:
            session = self.gate.login(request, form.get("token", ""))
        except Throttled as exc:
            return _throttled("./", exc)
        if session is None:
            await asyncio.sleep(0.25)  # a guess costs time
            return _login_page("./", next_path, "That token is not the right one.")
        response = _redirect(next_path)
        response.set_cookie(
            COOKIE,
            session,
            path="/",
            max_age=int(SESSION_TTL),
            httponly=True,
            samesite="Strict",
            secure=self.gate.secure(request),
        )
        return response

    async def logout(self, request: web.Request) -> web.Response:
        if not self.gate.from_here(request):
            return _message_page("./", "Refused", "A logout must come from these pages.", 403)
        self.gate.logout(request)
        response = _redirect("")
        response.del_cookie(COOKIE, path="/", secure=self.gate.secure(request), samesite="Strict")
        return response

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = _STATIC.get(name)
        if kind is None:
            return web.json_response({"error": f"no static file {name!r}"}, status=404)
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        return web.Response(body=_static(name), content_type=kind, headers=headers)


_ELSEWHERE = (
    "A login must come from this server's own page. Behind a TLS proxy, start aelastic "
    "serve with --trusted-proxy <the proxy's address> so that it knows the page's origin."
)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _redirect(next_path: str) -> web.Response:
    return web.Response(status=303, headers={"Location": "./" + next_path, **_HEADERS})


def _own_auth(handler: _Handler) -> _Handler:
    setattr(handler, OWN_AUTH, True)
    return handler


def install_pages(
    app: web.Application, source: RunSource, token: str | None, clients: Clients | None = None
) -> FeedHub:
    """Serve the pages of the runs ``source`` reads on ``app`` (before it starts).

    Args:
        app: The application (its own middlewares answer unknown routes).
        source: Where the runs are.
        token: The token the pages need (``None``: none).
        clients: How clients are named (trusted proxies); the application's (an HTTP
            rendezvous server's) when ``None``, else the peers' addresses. Failed token
            checks are counted with the application's API's when it has one.

    Returns:
        The hub of the pages' feeds (closed with the application).
    """
    hub = FeedHub(source)
    clients = clients or app.get(CLIENTS) or Clients()
    throttle = app.get(THROTTLE) or AuthThrottle()
    pages = _Pages(hub, Gate(token, clients, throttle))
    app[HUB] = hub
    run = "/runs/{run_id:[^/]+}"
    for method, path, handler in (
        ("GET", "/", pages.runs_page),
        ("GET", "/stream", pages.runs_stream),
        ("GET", run, pages.run_page),
        ("GET", run + "/stream", pages.run_stream),
        ("POST", "/login", pages.login),
        ("POST", "/logout", pages.logout),
        ("GET", "/static/{name}", pages.static),
    ):

        async def bound(request: web.Request, handler: _Handler = handler) -> web.StreamResponse:
            return await handler(request)

        app.router.add_route(method, path, _own_auth(bound))

    async def stop(app: web.Application) -> None:
        await hub.aclose()
        if THROTTLE not in app:  # the pages' own (a dashboard): its last counts
            throttle.close()

    app.on_shutdown.append(stop)
    return hub


def serve_pages(app: web.Application, engine: Engine, token: str | None) -> None:
    """The pages of an ``aelastic serve`` (its :class:`~aelastic.backends.http.server.Pages`
    hook): the runs it keeps, behind its token."""
    install_pages(app, EngineSource(engine), token)
