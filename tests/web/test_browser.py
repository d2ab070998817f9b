"""The live pages in a real browser: headless Chromium (Debian's, driven by Playwright)
against a real ``aelastic serve`` or ``aelastic dashboard`` and real nodes.

tests/run.sh installs ``chromium`` (apt) and Playwright (the dev extra); like the Redis
tests without ``redis-server``, these are skipped when either is missing. Playwright never
downloads a browser here: it drives ``/usr/bin/chromium``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import re
import shutil
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from aelastic import RendezvousParameters
from aelastic.backends import create_backend
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.rendezvous import RendezvousSettings
from tests._rendezvous_helpers import SECRET
from tests.cli._proc import Cli

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("aiohttp")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip("chromium is not installed (tests/run.sh installs it)", allow_module_level=True)

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The nodes' keep-alive interval (s); a member silent for three is pruned (the window).
INTERVAL = 1.0
WINDOW = 3 * INTERVAL
#: Margin on a shared, loaded machine (the point is seconds without a reload).
MARGIN = 20.0
SLEEP = """
import time
time.sleep(600)
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A fresh headless Chromium profile for this module's tests."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with playwright_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=ARGS, headless=True
        )
        context.set_default_timeout(30_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    opened = browser.new_page()
    try:
        yield opened
    finally:
        opened.close()
        browser.clear_cookies()


def _serve(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[Cli, str]:
    server = Cli(["serve", "--port", "0"], tmp_path, env)
    server.wait_for(lambda lines: any("listening on http://" in line for line in lines))
    return server, re.findall(r"listening on (http://\S+)", server.output)[0]


def _node(tmp_path: Path, endpoint: str, run_id: str) -> Cli:
    conf = f"last_call_timeout=0.5,keep_alive_interval={INTERVAL:g}"
    args = [
        "run", "--nnodes", "2:3", "--rdzv-backend", "http", "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id, "--rdzv-conf", conf, "--local-addr", "127.0.0.1",
        "--max-restarts", "3", "sleep.py",
    ]  # fmt: skip
    return Cli(args, tmp_path, session=True)  # its own process group, killed whole below


def _stop(cli: Cli, sig: signal.Signals = signal.SIGTERM, *, group: bool = False) -> None:
    """Signal ``cli`` (``group``: its whole process group) and wait for its exit."""
    if cli.proc.poll() is None:
        if group:
            os.killpg(cli.proc.pid, sig)
        else:
            cli.proc.send_signal(sig)
    try:
        cli.wait(60)
    finally:
        cli.__exit__(None, None, None)  # kills what is left, closes its output


def _until(page: Any, expression: str, timeout: float = 30.0) -> float:
    """Look at ``expression`` in the page until it is true; the seconds it took.

    Polled from here (``page.evaluate``): Playwright's own waiting evaluates strings in the
    page, which the page's Content-Security-Policy (no ``eval``) rightly refuses.
    """
    started = time.monotonic()
    while not page.evaluate(expression):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"still not true after {timeout:g} s: {expression}")
        time.sleep(0.05)
    return time.monotonic() - started


def _rows(page: Any, table: str) -> list[tuple[str, str]]:
    """(rank or "", node) of each row of a member table."""
    found: list[list[str]] = page.eval_on_selector_all(
        f"#{table} tbody tr",
        "rows => rows.map(r => [(r.querySelector('.rank') || {}).textContent || '',"
        " r.dataset.node])",
    )
    return [(rank, node) for rank, node in found]


def test_a_run_page_follows_the_job_and_drops_a_killed_member_without_reloading(
    tmp_path: Path, page: Any, run_id: str
) -> None:
    (tmp_path / "sleep.py").write_text(textwrap.dedent(SLEEP))
    server, url = _serve(tmp_path)
    nodes: list[Cli] = []
    try:
        endpoint = url.removeprefix("http://")
        nodes = [_node(tmp_path, endpoint, run_id) for _ in range(3)]
        page.goto(url + "/")
        link = page.locator(f'#runs tr[data-run="{run_id}"] a')
        link.wait_for()  # the run appears on the list by itself
        link.click()
        page.wait_for_url(f"**/runs/{run_id}")
        navigations: list[str] = []
        page.on("framenavigated", lambda frame: navigations.append(frame.url))
        loaded_at = page.evaluate("window.aelasticLoadedAt")
        _until(
            page,
            "document.querySelectorAll('#participants tbody tr').length === 3"
            " && document.querySelector('.title .badge').dataset.state === 'complete'",
        )
        rows = _rows(page, "participants")
        assert sorted(rank for rank, _ in rows) == ["0", "1", "2"], rows
        by_pid = {node.proc.pid: node for node in nodes}
        victim_key = rows[-1][1]
        victim = by_pid[int(victim_key.split("_")[-2])]

        _stop(victim, signal.SIGKILL, group=True)  # the agent's whole process group
        gone_after = _until(
            page,
            f"!document.querySelector('#participants tr[data-node=\"{victim_key}\"]')"
            " && document.querySelectorAll('#participants tbody tr').length === 2",
            WINDOW + MARGIN,
        )
        assert gone_after < WINDOW + MARGIN
        assert page.evaluate("window.aelasticLoadedAt") == loaded_at  # never reloaded
        assert navigations == []
        events = page.inner_text("#events")
        # Lost after the window, or sooner once the server saw its channel end (the page
        # cannot tell that from a leave then: "left").
        assert re.search(rf"{victim_key} (was lost \(silent for|left$)", events, re.M), events
        # The survivors form the next round, ranked 0 and 1, still without a reload.
        _until(
            page,
            "document.querySelector('.title .badge').dataset.state === 'complete'"
            " && [...document.querySelectorAll('#participants .rank')]"
            ".map(r => r.textContent).sort().join() === '0,1'",
        )
        assert page.evaluate("window.aelasticLoadedAt") == loaded_at
    finally:
        for node in nodes:
            _stop(node, group=True)
        _stop(server)


def _join(backend: str, endpoint: str, run_id: str, pid: int, **config: Any) -> None:
    """One node of ``run_id`` (1 to 2 nodes) joins, from a short-lived loop."""

    async def join() -> None:
        params = RendezvousParameters(
            backend, endpoint, run_id, 1, 2, last_call_timeout=600, **config
        )
        made = create_backend(params)
        try:
            rules = RendezvousSettings.from_parameters(params).rules
            await made.apply(Request(Op.JOIN, NodeDesc("10.1.2.3", pid, 0), rules, secret=SECRET))
        finally:
            await made.aclose()

    # Playwright's sync API keeps an event loop running in this thread: join from another.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, join()).result(timeout=60)


def test_the_login_form_opens_the_pages_in_the_browser(
    tmp_path: Path, page: Any, run_id: str
) -> None:
    token = "browser-s3cret"
    server, url = _serve(tmp_path, {"AELASTIC_HTTP_TOKEN": token})
    try:
        _join("http", url, run_id, 7, token=token)
        page.goto(f"{url}/runs/{run_id}")
        assert "Log in" in page.inner_text("h1")
        assert page.locator("#participants").count() == 0  # nothing of the run shows
        page.fill("#token", "not-it")
        page.click("button[type=submit]")
        assert "not the right one" in page.inner_text("#login-message")
        page.fill("#token", token)
        page.click("button[type=submit]")
        page.wait_for_url(f"**/runs/{run_id}")
        page.locator('#participants tr[data-node="10.1.2.3_7_0"]').wait_for()
        assert page.inner_text("#run-id") == run_id
        assert page.evaluate("document.cookie") == ""  # http-only: no script reads it
        (cookie,) = page.context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert token not in cookie["value"]
    finally:
        _stop(server)


@contextlib.contextmanager
def _other_site(page_html: str) -> Iterator[str]:
    """Serve ``page_html`` at ``/`` on another origin (a free port); yield its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page_html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}/"
    finally:
        site.shutdown()
        site.server_close()


def test_another_site_cannot_log_out_and_a_logout_ends_the_session(
    tmp_path: Path, page: Any
) -> None:
    token = "browser-s3cret"
    server, url = _serve(tmp_path, {"AELASTIC_HTTP_TOKEN": token})
    try:
        page.goto(url + "/")
        page.fill("#token", token)
        page.click("button[type=submit]")
        page.locator("form.logout").wait_for()
        (session,) = page.context.cookies()
        # A page elsewhere posts the logout form for the user (same site, another origin:
        # the SameSite cookie goes along, the Origin check refuses it).
        attack = (
            f'<form method="post" action="{url}/logout"></form>'
            "<script>document.forms[0].submit()</script>"
        )
        with _other_site(attack) as elsewhere:
            page.goto(elsewhere)
            page.wait_for_url(f"{url}/logout")
            assert "Refused" in page.inner_text("h1")
        page.goto(url + "/")
        page.locator("form.logout").wait_for()  # still logged in
        # The page's own button logs out; the old cookie, replayed, opens nothing.
        page.click("form.logout button")
        page.locator("#token").wait_for()
        assert page.context.cookies() == []
        page.context.add_cookies([session])
        page.goto(url + "/")
        assert "Log in" in page.inner_text("h1")
    finally:
        _stop(server)


def test_the_dashboard_shows_a_redis_job_live(tmp_path: Path, page: Any, run_id: str) -> None:
    from tests._redis_server import RedisServer

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with RedisServer() as redis:
        _join("redis", redis.url, run_id, 1)
        args = ["dashboard", "--rdzv-backend", "redis", "--rdzv-endpoint", redis.url]
        dashboard = Cli([*args, "--port", "0"], tmp_path)
        try:
            dashboard.wait_for(lambda lines: any("listening on http://" in x for x in lines))
            url = re.findall(r"listening on (http://\S+)", dashboard.output)[0]
            page.goto(url + "/")
            page.locator(f'#runs tr[data-run="{run_id}"] a').click()
            page.locator('#participants tr[data-node="10.1.2.3_1_0"]').wait_for()
            assert page.locator(".title .badge").get_attribute("data-state") == "forming"
            loaded_at = page.evaluate("window.aelasticLoadedAt")
            _join("redis", redis.url, run_id, 2)  # max nodes: the round completes
            _until(page, "document.querySelector('.title .badge').dataset.state === 'complete'")
            assert sorted(_rows(page, "participants")) == [
                ("0", "10.1.2.3_1_0"),
                ("1", "10.1.2.3_2_0"),
            ]
            assert page.evaluate("window.aelasticLoadedAt") == loaded_at
            page.goto(url + "/runs/no-such-run")
            assert "No such run" in page.inner_text("h1")
        finally:
            _stop(dashboard)
