"""A worker's error file is shown bounded and escaped, and never read whole into memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ._proc import cli_env

# A 50 MB error file on one line, with terminal escape sequences raw (clear the screen, set
# the window's title, ring the bell), written in pieces so the worker stays small.
BIG = r"""
import os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
    fp.write('{"message": {"message": "ValueError: \x1b[2J\x1b]0;pwned\x07')
    for _ in range(50):
        fp.write("x" * (1 << 20))
    fp.write('"}}')
sys.exit(1)
"""

# The launcher in this process, reporting its own peak memory (VmHWM: of this program only;
# getrusage's maxrss would keep the peak of the process it was forked from, a test worker).
MEASURED = """
import sys
from aelastic.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as fp:
    peak = next(line.split()[1] for line in fp if line.startswith("VmHWM:"))
print("launcher maxrss kB", peak, flush=True)
sys.exit(code)
"""


def test_a_50_mb_error_file_with_escape_sequences_is_shown_bounded(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text(textwrap.dedent(BIG))
    done = subprocess.run(
        [sys.executable, "-c", MEASURED, "run", "--log-dir", "logs", "big.py"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stderr
    assert done.returncode == 1, out[:2000]
    assert len(out) < 20_000, len(out)  # the first lines, not 50 MB
    assert "\x1b" not in out and "\x07" not in out  # nothing a terminal would obey
    [error_file] = (tmp_path / "logs").rglob("error.json")
    path = str(error_file.relative_to(tmp_path))
    assert "too large to read whole>" in out and f"(cut: see {path})" in out, out
    assert f"error_file: {path}" in out, out
    [rss] = [int(x.split()[-1]) for x in done.stdout.splitlines() if "launcher maxrss" in x]
    assert rss < 100 * 1024, rss  # the launcher alone is ~30 MB: the file was not read
