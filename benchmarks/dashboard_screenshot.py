"""A screenshot of a run's live page (``docs/dashboard.png``), taken from the real thing.

Usage::

    python -m benchmarks.dashboard_screenshot [--out docs/dashboard.png] [--chromium PATH]

How it works: it starts ``aelastic serve`` and three ``aelastic run`` nodes (``--nnodes
2:4``, workers that sleep) on loopback, opens ``/runs/<id>`` in headless Chromium (Playwright
driving the system's ``chromium``, never a downloaded browser), then makes the job move while
the page watches: a fourth node joins (it waits, the job re-forms with four), one node is
killed with SIGKILL (it is lost, the job re-forms with three). Once the page shows three
participants of the new round, it saves a screenshot of the whole page. Needs
``pip install playwright`` and Debian's ``chromium``; about 40 s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "train-llm-7b"
WORKER = "import time\ntime.sleep(3600)\n"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("AELASTIC_HTTP_TOKEN", None)
    return env


def _serve(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aelastic", "serve", "--port", "0"],
        cwd=workdir,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"listening on (http://\S+)", line)
    if not found:
        proc.kill()
        raise SystemExit(f"aelastic serve did not start: {line!r}")
    return proc, found.group(1)


def _node(workdir: Path, endpoint: str) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "aelastic", "run", "--nnodes", "2:4",
        "--rdzv-backend", "http", "--rdzv-endpoint", endpoint, "--rdzv-id", RUN_ID,
        "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,heartbeat_timeout=4",
        "--local-addr", "127.0.0.1", "--max-restarts", "5", "worker.py",
    ]  # fmt: skip
    return subprocess.Popen(
        args,
        cwd=workdir,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: killed whole below
    )


def _stop(proc: subprocess.Popen[Any], sig: signal.Signals = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _members(page: Any, count: int, round_at_least: int, timeout: float) -> None:
    """Wait until the page shows ``count`` participants of a complete round (polled from
    here: the page's Content-Security-Policy refuses Playwright's in-page ``eval``)."""
    check = f"""(() => {{
        const rows = document.querySelectorAll('#participants tbody tr');
        const shown = document.querySelector('#tile-round .value');
        const state = document.querySelector('.title .badge');
        return rows.length === {count} && !!shown && Number(shown.textContent) >= {round_at_least}
            && !!state && state.dataset.state === 'complete';
    }})()"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(check):
        if time.monotonic() > deadline:
            raise SystemExit(f"the page never showed {count} participants")
        time.sleep(0.1)


def take(out: Path, chromium: str) -> None:
    """Start the job, make it move under the page's eyes, save the screenshot at ``out``."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "worker.py").write_text(WORKER)
        server, url = _serve(workdir)
        endpoint = url.removeprefix("http://")
        nodes = [_node(workdir, endpoint) for _ in range(3)]
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch_persistent_context(
                    str(workdir / "profile"),
                    executable_path=chromium,
                    args=CHROMIUM_ARGS,
                    viewport={"width": 1240, "height": 900},
                    device_scale_factor=1,
                )
                page = browser.new_page()
                deadline = time.monotonic() + 60
                while True:  # the run exists once the first node joined
                    response = page.goto(f"{url}/runs/{RUN_ID}")
                    if response is not None and response.status == 200:
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit("the run never appeared")
                    time.sleep(0.5)
                _members(page, 3, 0, 60)
                time.sleep(2)
                nodes.append(_node(workdir, endpoint))  # waits, then the job re-forms
                _members(page, 4, 1, 60)
                time.sleep(3)
                _stop(nodes.pop(1), signal.SIGKILL)  # lost: the others re-form
                _members(page, 3, 2, 60)
                time.sleep(4)
                page.screenshot(path=str(out), full_page=True)
                browser.close()
        finally:
            for node in nodes:
                _stop(node)
            _stop(server)
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the browser to drive")
    args = parser.parse_args()
    take(args.out, args.chromium)


if __name__ == "__main__":
    main()
