"""``aelastic run``'s flags: torchrun's names, spellings, defaults and ``PET_*`` fallbacks.

How it works: :func:`build_parser` declares torchrun's flags (both the ``--dash-case`` and the
``--snake_case`` spelling); an option not given on the command line takes its value from the
environment variable ``PET_<DEST>`` (``PET_NPROC_PER_NODE``, ``PET_STANDALONE=1``...) before its
default, and an environment value is checked like a command-line one. What the values mean is
decided in :mod:`.options`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from .heal_flags import add_heal_flags
from .rules import UsageError, UsageParser

__all__ = ["build_parser"]


def _env_default(dest: str, default: Any, kind: Callable[[str], Any]) -> Any:
    name = f"PET_{dest.upper()}"
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        kind(raw)
    except ValueError:
        what = getattr(kind, "__name__", "value")
        raise UsageError(f"{name}={raw!r} is not a valid {what}") from None
    return raw


def _env_flag(dest: str) -> bool:
    raw = os.environ.get(f"PET_{dest.upper()}", "0").strip() or "0"
    try:
        return bool(int(raw))
    except ValueError:
        raise UsageError(f"PET_{dest.upper()}={raw!r} must be 0 or 1") from None


def _add(
    parser: argparse.ArgumentParser,
    names: Sequence[str],
    *,
    default: Any = None,
    kind: Callable[[str], Any] = str,
    help: str,
    metavar: str | None = None,
) -> None:
    """An option whose default comes from ``PET_<DEST>`` first (checked by ``kind``)."""
    longest = max(names, key=len).lstrip("-")
    dest = longest.replace("-", "_")
    spellings = list(names)
    snake = "--" + dest
    if snake not in spellings and "-" in longest:
        spellings.append(snake)
    parser.add_argument(
        *spellings,
        dest=dest,
        type=kind,
        default=_env_default(dest, default, kind),
        help=help,
        metavar=metavar,
    )


def _flag(parser: argparse.ArgumentParser, names: Sequence[str], *, help: str) -> None:
    """A boolean flag, also set by ``PET_<DEST>=1``."""
    longest = max(names, key=len).lstrip("-")
    dest = longest.replace("-", "_")
    spellings = list(names)
    if "-" in longest:
        spellings.append("--" + dest)
    parser.add_argument(
        *spellings, dest=dest, action="store_true", default=_env_flag(dest), help=help
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


_positive_float.__name__ = "positive number"


def _backends_help() -> str:
    from ..backends.registry import BUILTINS

    names = ", ".join(name for info in BUILTINS for name in (info.name, *info.aliases))
    return f"static (torchrun's default), c10d, or one of: {names}."


def build_parser(
    prog: str = "aelastic run", parser_class: type[argparse.ArgumentParser] = UsageParser
) -> argparse.ArgumentParser:
    """The parser of ``aelastic run`` (torchrun's flags plus a few of aelastic's).

    Args:
        prog: The program's name in messages.
        parser_class: :class:`UsageParser` (a bad flag raises :class:`UsageError`), or a
            parser of argparse's own behaviour.

    Raises:
        UsageError: A ``PET_*`` flag variable is not 0 or 1.
    """
    p = parser_class(
        prog=prog,
        description="Launch an elastic distributed job (torchrun's flags and defaults).",
        allow_abbrev=True,  # torchrun's argparse allows abbreviations of long flags
    )
    _add(p, ["--nnodes"], default="1:1", help="Number of nodes, or MIN:MAX (default 1:1).")
    _add(p, ["--nproc-per-node"], default="1", help="Workers per node: N, auto, cpu or gpu.")
    _add(p, ["--rdzv-backend"], default="static", help=_backends_help())
    _add(p, ["--rdzv-endpoint"], default="", help="Where the backend is (see `--rdzv-backend`).")
    _add(p, ["--rdzv-id"], default="none", help="Id of the job (same on every node).")
    _add(p, ["--rdzv-conf"], default="", help="Rendezvous settings: key=value,...")
    _flag(p, ["--standalone"], help="Single node, in-process rendezvous, nothing else to start.")
    _add(p, ["--max-restarts"], default=0, kind=int, help="Restarts before failing (0).")
    _add(
        p,
        ["--monitor-interval"],
        default=0.1,
        kind=_positive_float,
        help="Accepted for torchrun compatibility (aelastic awaits worker exits).",
    )
    _add(p, ["--start-method"], default="spawn", help="spawn, fork or forkserver (functions).")
    _add(p, ["--role"], default="default", help="Role of the workers (default).")
    _flag(p, ["-m", "--module"], help="Run the script as a module (python -m).")
    _flag(p, ["--no-python"], help="Run the script as a command, without python.")
    _flag(p, ["--run-path"], help="Run the script with runpy.run_path (an absolute path).")
    _add(p, ["--log-dir"], help="Base directory of the worker log files.")
    _add(p, ["-r", "--redirects"], default="0", help="Std streams to files: 0-3 or 0:1,1:2.")
    _add(p, ["-t", "--tee"], default="0", help="Std streams to files and console (as -r).")
    _add(p, ["--local-ranks-filter"], default="", help="Local ranks shown on the console: 0,1.")
    _add(p, ["--node-rank"], default=0, kind=int, help="Node rank (static rendezvous only).")
    _add(p, ["--master-addr"], help="Fixed MASTER_ADDR for the workers.")
    _add(p, ["--master-port"], kind=int, help="Fixed MASTER_PORT for the workers.")
    _add(p, ["--local-addr"], help="Address of this node (default: its FQDN).")
    _add(
        p,
        ["--signals-to-handle"],
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="Signals that stop the job cleanly.",
    )
    _add(
        p,
        ["--shutdown-timeout"],
        kind=int,
        help="Seconds between SIGTERM and SIGKILL when stopping workers (30).",
    )
    _flag(p, ["--virtual-local-rank"], help="LOCAL_RANK 0 and one GPU per worker.")
    _add(
        p,
        ["--exit-barrier-timeout"],
        default=300.0,
        kind=float,
        help="Seconds a finished node waits for the others (aelastic; torch: 300).",
    )
    _flag(
        p,
        ["--no-warm-standby"],
        help="Start restarted workers cold instead of from pre-started interpreters (aelastic).",
    )
    _flag(p, ["-q", "--quiet"], help="No progress lines from the launcher (aelastic).")
    _add(
        p, ["--event-log"], help="Write the events as JSON lines to PATH, - for stderr (aelastic)."
    )
    _add(
        p,
        ["--event-log-handler"],
        default="null",
        help="torchrun's: console (--event-log -), null.",
    )
    _add(p, ["--logs-specs"], help="torchrun's LogsSpecs entry point (torchrun.logs_specs).")
    _add(
        p,
        ["--numa-binding"],
        help="torchrun's: node, socket, exclusive or core-complex (CPUs near the GPUs).",
    )
    _add(p, ["--duplicate-stdout-filters"], default="", help="Teed lines with a,b: a file too.")
    _add(p, ["--duplicate-stderr-filters"], default="", help="The same for stderr.")
    _add(
        p,
        ["--metrics-port"],
        default=0,
        kind=int,
        help="Serve GET /metrics on PORT, 0: off (aelastic).",
    )
    add_heal_flags(p, _add)
    _flag(p, ["-v", "--verbose"], help="Also show aelastic's info logs (or set LOGLEVEL).")
    p.add_argument("training_script", help="The script (or module, or command) to run.")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p
