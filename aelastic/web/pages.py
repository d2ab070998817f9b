"""The live pages: ``/`` (the runs) and ``/runs/<run id>`` (one run), streamed to the browser.

How it works: :func:`install_pages` adds the routes to an aiohttp application (the HTTP
rendezvous server's, or the dashboard's). A page is a small HTML shell; the browser's
script (``static/app.js``) opens the page's event stream (server-sent events:
``<page>/stream``) and draws each view it receives (:mod:`.model`, from the page's
:class:`~.feeds.Feed`) without reloading. A run the source does not know is a 404 page;
a route that does not exist stays the API's 404 JSON.

With a token, the pages and their streams need it: a request carrying ``Authorization:
Bearer <token>`` or the session cookie is let in, any other gets a login form (``POST
/login``). The cookie holds a digest of the token (HMAC-SHA256), never the token, and is
``HttpOnly`` and ``SameSite=Strict``; every comparison is constant-time. The static files
(style, script) are public: they hold no data. Pages send a strict Content-Security-Policy
(no inline script, nothing from elsewhere).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable
from functools import cache
from html import escape
from importlib import resources
from string import Template
from urllib.parse import quote

from aiohttp import web

from ..backends._engine import Engine
from ..backends.http.server import OWN_AUTH
from ..backends.http.wire import SchemaError, require_run_id
from .feeds import Feed, FeedHub, FeedLimitError
from .sources import EngineSource, RunSource

__all__ = ["COOKIE", "HUB", "Gate", "install_pages", "serve_pages"]

#: The session cookie's name.
COOKIE = "aelastic_session"
#: The hub of an application's pages.
HUB = web.AppKey("aelastic_feed_hub", FeedHub)
#: Seconds between two keep-alive comments of an idle stream.
KEEPALIVE = 15.0
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
#: Where a login may send the browser back to (a path below the pages' root).
_NEXT = re.compile(r"(runs/[^/?#\\]+)?")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@cache
def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static").joinpath(name).read_bytes()


@cache
def _version() -> str:
    return hashlib.sha256(_static("app.js") + _static("style.css")).hexdigest()[:12]


def _render(name: str, **fields: str) -> str:
    return Template(_static(name).decode()).substitute(fields)


class Gate:
    """Who may read the pages (see the module docstring).

    Args:
        token: The token; ``None`` or empty lets everybody in.
    """

    def __init__(self, token: str | None) -> None:
        self.token = token or None
        secret = (token or "").encode("utf-8", "surrogateescape")
        self.session = hmac.new(secret, b"aelastic pages, session 1", hashlib.sha256).hexdigest()

    def allows(self, request: web.Request) -> bool:
        """Whether ``request`` carries the bearer token or the session cookie."""
        if self.token is None:
            return True
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, f"Bearer {self.token}".encode("utf-8", "surrogateescape")):
            return True
        cookie = request.cookies.get(COOKIE, "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(cookie, self.session.encode())

    def matches(self, given: str) -> bool:
        """Whether ``given`` is the token (constant-time)."""
        expected = (self.token or "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected)


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


class _Pages:
    def __init__(self, hub: FeedHub, gate: Gate) -> None:
        self.hub = hub
        self.gate = gate

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
        if not self.gate.allows(request):
            return _login_page("./", "", "Log in to see the runs.")
        return self._shell("./", "runs", "", "stream")

    async def run_page(self, request: web.Request) -> web.Response:
        raw = request.match_info["run_id"]
        try:
            run_id = require_run_id(raw)
        except SchemaError as exc:
            return _message_page("../", "Not a run id", f"{raw[:80]!r}: {exc}.", 404)
        if not self.gate.allows(request):
            return _login_page("../", _run_path(run_id), f"Log in to see run {run_id!r}.")
        if not await self.hub.exists(run_id):
            message = f"No run {run_id!r} has a rendezvous state at {self.hub.source.where}."
            return _message_page("../", "No such run", message, 404)
        return self._shell("../", "run", run_id, quote(run_id, safe="") + "/stream")

    async def runs_stream(self, request: web.Request) -> web.StreamResponse:
        if not self.gate.allows(request):
            return web.json_response({"error": "log in first"}, status=401)
        return await self._stream(request, self.hub.runs())

    async def run_stream(self, request: web.Request) -> web.StreamResponse:
        try:
            run_id = require_run_id(request.match_info["run_id"])
        except SchemaError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        if not self.gate.allows(request):
            return web.json_response({"error": "log in first"}, status=401)
        try:
            feed = self.hub.run(run_id)
        except FeedLimitError as exc:
            return web.json_response({"error": str(exc)}, status=503)
        return await self._stream(request, feed)

    async def _stream(self, request: web.Request, feed: Feed) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # proxies: pass each event on at once
            }
        )
        await response.prepare(request)
        seen = 0
        try:
            await response.write(b"retry: 2000\n\n")
            async with self.hub.watching(feed):
                while not (self.hub.closing or feed.stopped):
                    news = await feed.next(seen, KEEPALIVE)
                    if self.hub.closing or feed.stopped:
                        break
                    if news is None:
                        await response.write(b": keep-alive\n\n")
                        continue
                    seen, view = news
                    data = json.dumps(view, separators=(",", ":"), allow_nan=False)
                    await response.write(b"data: " + data.encode() + b"\n\n")
        except ConnectionResetError:
            pass  # the browser went away
        return response

    async def login(self, request: web.Request) -> web.Response:
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            return _message_page("./", "Refused", "A login must come from this page.", 403)
        form = await request.post()
        given, next_path = form.get("token"), form.get("next", "")
        if not isinstance(next_path, str) or not _NEXT.fullmatch(next_path):
            next_path = ""
        if self.gate.token is None:
            return _redirect(next_path)
        if not isinstance(given, str) or not self.gate.matches(given):
            await asyncio.sleep(0.25)  # a guess costs time
            return _login_page("./", next_path, "That token is not the right one.")
        response = _redirect(next_path)
        response.set_cookie(
            COOKIE,
            self.gate.session,
            path="/",
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
        return response

    async def logout(self, request: web.Request) -> web.Response:
        response = _redirect("")
        response.del_cookie(COOKIE, path="/")
        return response

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = _STATIC.get(name)
        if kind is None:
            return web.json_response({"error": f"no static file {name!r}"}, status=404)
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        return web.Response(body=_static(name), content_type=kind, headers=headers)


def _redirect(next_path: str) -> web.Response:
    return web.Response(status=303, headers={"Location": "./" + next_path, **_HEADERS})


def _own_auth(handler: _Handler) -> _Handler:
    setattr(handler, OWN_AUTH, True)
    return handler


def install_pages(app: web.Application, source: RunSource, token: str | None) -> FeedHub:
    """Serve the pages of the runs ``source`` reads on ``app`` (before it starts).

    Args:
        app: The application (its own middlewares answer unknown routes).
        source: Where the runs are.
        token: The token the pages need (``None``: none).

    Returns:
        The hub of the pages' feeds (closed with the application).
    """
    hub = FeedHub(source)
    pages = _Pages(hub, Gate(token))
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

    app.on_shutdown.append(stop)
    return hub


def serve_pages(app: web.Application, engine: Engine, token: str | None) -> None:
    """The pages of an ``aelastic serve`` (its :class:`~aelastic.backends.http.server.Pages`
    hook): the runs it keeps, behind its token."""
    install_pages(app, EngineSource(engine), token)
