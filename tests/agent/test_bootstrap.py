"""The worker bootstrap and its progress page, in real child interpreters (no torch).

A child started with aelastic's bootstrap first on ``PYTHONPATH`` (as the agent starts every
worker) maps a page the test made from its start, reports progress into it (the steps, the
last time, the gaps between steps), dumps its stacks on the page's signal while its main
thread sleeps in C (before its first step too), writes torch's error file for an uncaught
exception, and leaves no trace on its path: ``PYTHONPATH`` and ``sys.path`` as given, and
the ``sitecustomize`` it shadowed still runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic.agent.health.progress import (
    BOOTSTRAP_DIR,
    ENV_PAGE,
    PageReading,
    ProgressPages,
    with_bootstrap,
)
from aelastic.agent.health.stacks import dump_stacks, in_collective, main_stack, parse_stacks, where

ROOT = str(Path(__file__).resolve().parents[2])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROOT
    env.update(extra or {})
    with_bootstrap(env)
    return env


def run(code: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script)],
        env=child_env(extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def pages() -> Iterator[ProgressPages]:
    made = ProgressPages(1)
    try:
        yield made
    finally:
        made.close()


def test_the_bootstrap_leaves_the_path_as_given_and_runs_the_sitecustomize_it_shadows(
    tmp_path: Path,
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    result = run(
        """
        import json, os, sys
        print(json.dumps({"path": sys.path, "env": os.environ.get("PYTHONPATH"),
                          "theirs": os.environ.get("THEIRS_RAN"),
                          "runtime": "_aelastic_worker" in sys.modules,
                          "guard": "_aelastic_guard" in sys.modules}))
        """,
        tmp_path,
        PYTHONPATH=f"{ROOT}{os.pathsep}{theirs}",
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["env"] == f"{ROOT}{os.pathsep}{theirs}"
    assert BOOTSTRAP_DIR not in seen["path"] and str(theirs) in seen["path"]
    assert seen["theirs"] == "1" and seen["runtime"] and seen["guard"]


def test_progress_goes_to_the_page_and_pausing_and_exiting_stop_the_watch(
    tmp_path: Path, pages: ProgressPages
) -> None:
    assert pages.read(0).pid == 0 and pages.read(0).steps == 0
    result = run(
        """
        import os, sys, time, aelastic.worker as w
        assert w.reporting()  # mapped at the start: stacks can be taken before a step
        for _ in range(3):
            w.progress()
            time.sleep(0.05)
        with w.paused():
            with open(sys.argv[0] + ".paused", "w") as f:
                f.write(open(os.environ["AELASTIC_PROGRESS_FILE"], "rb").read(64).hex())
        print(os.getpid())
        """,
        tmp_path,
        **pages.env(0),
    )
    assert result.returncode == 0, result.stderr
    reading = pages.read(0)
    assert reading.pid == int(result.stdout)
    assert reading.steps == 3 and 0 < reading.last_ns <= time.monotonic_ns()
    assert reading.paused and reading.stack_signal == 0  # the interpreter's exit is not watched
    inside = bytes.fromhex((tmp_path / "child.py.paused").read_text())
    assert int.from_bytes(inside[48:56], sys.byteorder) == 1  # paused inside the block
    assert not reading.torch  # no torch: watched from its first progress only
    gaps = pages.gaps(0, reading.steps)
    assert len(gaps) == 2 and all(0.04 < g < 5.0 for g in gaps)  # the first step has none


def test_the_gaps_are_the_recent_steps_and_a_pause_is_not_one(
    tmp_path: Path, pages: ProgressPages
) -> None:
    result = run(
        """
        import time, aelastic.worker as w
        for _ in range(300):
            w.progress()
        time.sleep(0.3)
        w.progress()  # a slow gap
        with w.paused():
            time.sleep(0.5)
        w.progress()  # counted from the pause's end
        """,
        tmp_path,
        **pages.env(0),
    )
    assert result.returncode == 0, result.stderr
    gaps = pages.gaps(0, pages.read(0).steps)
    assert pages.read(0).steps == 302 and len(gaps) == 255  # the ring's recent window
    assert 0.3 <= max(gaps) < 0.5 and gaps[-2] == max(gaps) and gaps[-1] < 0.3


def test_a_page_read_between_the_workers_two_stores_is_not_a_stall() -> None:
    """The agent may read a page while the worker writes it: steps without a time (the first
    progress half-written) is "not watched yet", never a stall as old as the machine's
    uptime; the worker writes the time first, so a full page has both."""
    from aelastic.agent.health.hang_rule import HangRule, check_stalls, watch_of

    torn = PageReading(pid=7, steps=1, last_ns=0, stack_signal=0, main_thread=1)
    assert torn.last_progress() is None
    now = time.monotonic()
    watch = watch_of(
        HangRule(1.0, None), last_progress=None, steps=1, torch=True, began=0.0,
        renewed=None, learned=None,
    )  # fmt: skip
    assert check_stalls({0: watch}, now).stalled == ()
    whole = PageReading(pid=7, steps=1, last_ns=5_000_000_000, stack_signal=0, main_thread=1)
    assert whole.last_progress() == 5.0
    assert PageReading(7, 1, 5, 0, 1, paused=True).last_progress() is None
    source = Path(sys.modules["aelastic.agent.health.progress"].runtime.__file__).read_text()
    body = source[source.index("def progress()") : source.index("def attached()")]
    assert body.index("page[SLOT_TIME]") < body.index("page[SLOT_STEPS]")


@pytest.mark.anyio
async def test_a_worker_blocked_in_c_dumps_every_thread_on_its_signal(
    tmp_path: Path, pages: ProgressPages
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading, time, aelastic.worker
            def helper():
                time.sleep(60)
            def stuck_in_step():
                print("ready", flush=True)
                time.sleep(60)  # the stuck line
            threading.Thread(target=helper, daemon=True).start()
            stuck_in_step()  # before any progress: the page was mapped at the start
            """
        )
    )
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything awaits
        [sys.executable, str(script)],
        env=child_env(pages.env(0)),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # noqa: ASYNC251 - from print() into the sleep; nothing else runs
        reading = pages.read(0)
        assert reading.pid == proc.pid and reading.stack_signal >= signal.SIGRTMIN
        dumps = await dump_stacks([(proc.pid, reading.stack_signal, pages.stacks_file(0))])
        assert proc.poll() is None  # the dump did not hurt it
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    threads = parse_stacks(dumps[proc.pid])
    assert len(threads) == 2
    main = main_stack(threads, reading.main_thread)
    assert main is not None and main.frames[0].func == "stuck_in_step"
    top, mine = where(main)
    assert top == f"{script}:7 in stuck_in_step" and mine == ""
    assert not in_collective(main)


def test_a_worker_without_a_page_reports_nothing(tmp_path: Path) -> None:
    result = run(
        """
        import aelastic.worker as w
        w.progress()
        with w.paused():
            pass
        print(w.reporting())
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert ENV_PAGE not in child_env()


def test_an_uncaught_exception_writes_torchs_error_file_once(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    result = run(
        "raise ValueError('the shard is corrupt')\n",
        tmp_path,
        TORCHELASTIC_ERROR_FILE=str(error_file),
    )
    assert result.returncode == 1
    assert "ValueError: the shard is corrupt" in result.stderr  # printed as before
    doc = json.loads(error_file.read_text())
    assert doc["message"]["message"] == "ValueError: the shard is corrupt"
    assert "Traceback" in doc["message"]["extraInfo"]["py_callstack"]
    # An error file written already (torch's @record) is left alone; SystemExit writes none.
    error_file.write_text('{"message": "from @record"}')
    run("raise ValueError('x')\n", tmp_path, TORCHELASTIC_ERROR_FILE=str(error_file))
    assert json.loads(error_file.read_text()) == {"message": "from @record"}
    error_file.unlink()
    assert (
        run(
            "import sys; sys.exit(3)\n", tmp_path, TORCHELASTIC_ERROR_FILE=str(error_file)
        ).returncode
        == 3
    )
    assert not error_file.exists()
