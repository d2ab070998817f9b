#!/usr/bin/env bash
# Refresh tests/requirements.lock, the exact toolchain `bash tests/run.sh` installs: the newest
# releases that pyproject.toml's `dev` extra admits, the frameworks tested under aelastic
# (Lightning, accelerate) and torch 2.13.0's CPU build, resolved in a new virtual environment.
#
#   bash tests/lock.sh          then run `bash tests/run.sh` and commit the lock if it passes
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOCK=tests/requirements.lock

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
# torch first, pinned: a bare "torch" requirement (Lightning's) would pull a multi-GB CUDA build.
"${pip[@]}" install --quiet "torch==2.13.0"
"${pip[@]}" install --quiet "torch==2.13.0" -e ".[dev]" lightning accelerate
{
    echo "# The exact toolchain of \`bash tests/run.sh\` (made by \`bash tests/lock.sh\` on $(date -u +%F),"
    echo "# $("$tmp/venv/bin/python" --version)). Installed with --no-deps: every package is listed."
    # --all: setuptools too (torch requires a newer one than a new venv has); pip is the venv's.
    "${pip[@]}" freeze --all --exclude-editable | grep -v -i '^pip==' | LC_ALL=C sort -f
} >"$LOCK"
echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages)"
