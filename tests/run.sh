#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine, then lint, type-check and test.
#
#   bash tests/run.sh [pytest args]            the whole suite on the locked toolchain
#   bash tests/run.sh --newest [pytest args]   backend, rendezvous, agent and launcher tests on
#                                              the newest redis, aiohttp and anyio the registry serves
#   bash tests/run.sh --oldest [pytest args]   the same on the oldest releases pyproject.toml admits
#
# Each mode installs into a virtual environment of its own under .venv-test/ (made once,
# reused while tests/requirements.lock, pyproject.toml and this script are unchanged), so the
# packages of the machine or of an activated environment never decide a run. Refresh the lock
# with `bash tests/lock.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOCK=tests/requirements.lock
MODE=locked
case "${1:-}" in
--newest | --oldest)
    MODE="${1#--}"
    shift
    ;;
esac

# The Redis tests start their own redis-server, and redis-sentinel for failover (Debian ships
# it as a package of its own); the etcd tests their own etcd (Debian's etcd-server: 3.4, the
# v3 API); the NUMA binding tests use numactl as torchrun does; the pages are tested in a real
# browser, Debian's chromium, driven by Playwright (which never downloads a browser here).
missing=()
for tool in redis-server:redis-server redis-sentinel:redis-sentinel etcd:etcd-server \
    numactl:numactl chromium:chromium; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    # The tests start their own servers; the packaged services are not needed.
    for service in redis-server redis-sentinel etcd; do
        $SUDO service "$service" stop >/dev/null 2>&1 || true
    done
fi

# The environment: keyed on what decides its contents (and, for --newest, the day).
key_of() {
    {
        cat "$LOCK" pyproject.toml tests/run.sh
        "$PY" --version
        echo "$MODE"
        [ "$MODE" != newest ] || date -u +%F
    } | sha256sum | cut -c1-12
}
VENV="${AELASTIC_TEST_VENVS:-.venv-test}/$MODE-$(key_of)"
pip=(pip_in "$VENV")
pip_in() {
    local venv="$1"
    shift
    # This machine's pip configuration may name package indexes that are not there: pip
    # says so for every package, which says nothing about the run.
    "$venv/bin/python" -m pip --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
same_freeze() {
    # What is installed is the lock, no more, no less (checked at every run: an environment
    # someone installed into since is not the lock any more).
    diff <(grep -v -E '^(#|$)' "$LOCK" | LC_ALL=C sort -f) \
        <("${pip[@]}" freeze --all --exclude-editable | grep -v -i '^pip==' | LC_ALL=C sort -f)
}
python_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }
locked_python=$(sed -n 's/^# Python \([0-9]*\.[0-9]*\).*/\1/p' "$LOCK")
if [ "$MODE" = locked ] && [ "$(python_of "$PY")" != "$locked_python" ]; then
    echo "tests/run.sh: the lock was made on Python $locked_python, this is Python" \
        "$(python_of "$PY"); some of its wheels may not exist here (PYTHON= picks another" \
        "interpreter; \`bash tests/lock.sh\` makes a lock for this one)" >&2
fi
mkdir -p "$(dirname "$VENV")"
# One run makes an environment at a time (another waits for it, then reuses it).
exec 9>"$(dirname "$VENV")/.$(basename "$VENV").lock"
flock 9
if [ ! -f "$VENV/.ready" ]; then
    echo "tests/run.sh: making the $MODE test environment $VENV" >&2
    rm -rf "$VENV"
    # Environments of this mode made for an older lock, pyproject.toml, script or day.
    for old in "$(dirname "$VENV")/$MODE"-* "$(dirname "$VENV")/.$MODE"-*.lock; do
        case "$old" in "$VENV" | */".$(basename "$VENV").lock") ;; *) rm -rf "$old" ;; esac
    done
    "$PY" -m venv "$VENV"
    # The lock first (torch's CPU build included), exactly, nothing resolved here; then the
    # runtime ranges: the newest releases of redis, aiohttp and anyio the registry serves, or
    # the oldest pyproject.toml admits, with what they need resolved against the lock.
    runtime=""
    case "$MODE" in
    newest) runtime="redis aiohttp anyio" ;;
    oldest)
        runtime=$(sed -n 's/^dependencies = \["anyio>=\([^"]*\)"\]/anyio==\1/p;
            s/^redis = \["redis>=\([^"]*\)"\]/redis==\1/p;
            s/^http = \["aiohttp>=\([^"]*\)"\]/aiohttp==\1/p' pyproject.toml)
        [ "$(echo "$runtime" | wc -l)" -eq 3 ] || {
            echo "tests/run.sh: cannot read the lower bounds of anyio, redis, aiohttp" >&2
            exit 1
        }
        ;;
    esac
    "${pip[@]}" install --no-deps -r "$LOCK"
    # shellcheck disable=SC2086
    [ -z "$runtime" ] || "${pip[@]}" install --upgrade $runtime
    "${pip[@]}" install --no-deps --no-build-isolation -e . 2>/dev/null \
        || "${pip[@]}" install --no-deps -e .
    # The lock holds together; a range run may not (the frameworks' own requirements, which
    # the range's tests do not import: said, not fatal).
    "${pip[@]}" check || [ "$MODE" != locked ]
    touch "$VENV/.ready"
fi
exec 9>&-
if [ "$MODE" = locked ] && ! same_freeze; then
    echo "tests/run.sh: $VENV differs from $LOCK (above: < the lock, > installed);" \
        "remove it to make it again" >&2
    exit 1
fi
PYV="$VENV/bin/python"
echo "tests/run.sh: $MODE toolchain: $("$PYV" -m pip freeze 2>/dev/null \
    | grep -i -E '^(redis|aiohttp|anyio|torch)==' | tr '\n' ' ')" >&2

# pytest exits 5 when it collects nothing; set -e turns that into a failure too. Every real
# part is installed above, so a skipped test fails the run (tests/conftest.py). The tests
# mostly wait on subprocesses and servers, so four pytest workers share the machine's two
# cores (AELASTIC_TEST_WORKERS=0 runs them in one process); pytest-benchmark, where installed,
# is kept out (it refuses to run under xdist; the benchmarks are scripts of their own).
pytest=("$PYV" -m pytest -p no:benchmark -n "${AELASTIC_TEST_WORKERS:-4}" --dist worksteal)
export AELASTIC_TESTS_NO_SKIP=1
if [ "$MODE" = locked ]; then
    "$PYV" -m ruff check aelastic tests benchmarks examples
    "$PYV" -m ruff format --check aelastic tests benchmarks examples
    "$PYV" -m mypy
    exec "${pytest[@]}" "$@"
fi
# The runtime ranges: what talks to redis-py, aiohttp and anyio.
exec "${pytest[@]}" tests/backends tests/conformance tests/rendezvous tests/agent \
    tests/launcher tests/test_sync.py "$@"
