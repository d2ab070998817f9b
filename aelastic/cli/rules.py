"""torchrun's rules for ``aelastic run``'s values: node counts, ``--rdzv-conf``, signals,
streams, and which rendezvous a command line means.

How it works: pure functions of parsed flags. :func:`rendezvous_of` applies torchrun's
defaulting: ``static`` on one node is ``--standalone`` (the in-process ``memory`` backend);
``static`` with a fixed ``--nnodes N > 1`` is torch's static rendezvous at
``master_addr:master_port``, hosted by node rank 0 (:mod:`aelastic.backends.hosted`); ``c10d``
is hosted by the agent on the endpoint's host; the others are the rows of the backend registry
(``memory``, ``redis``, ``http``, ``etcd``...), also spelled with their torchrun names
(``aelastic-redis``...) and their other names (torch's ``etcd-v2``). Every mistake is a
:class:`UsageError` (one line, exit code 2).
"""

from __future__ import annotations

import argparse
import signal
import uuid
from typing import NoReturn

from ..backends.registry import BUILTINS, backend_info, external_names

__all__ = [
    "BACKEND_ALIASES",
    "UsageError",
    "UsageParser",
    "parse_local_ranks",
    "parse_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
    "parse_std",
    "rendezvous_of",
]

BACKEND_ALIASES = {
    **{info.name: info.name for info in BUILTINS},
    **{info.torchrun_alias: info.name for info in BUILTINS},
    **{alias: info.name for info in BUILTINS for alias in info.aliases},
}


class UsageError(RuntimeError):
    """A bad flag or value: reported on one line, exit code 2 (a ``RuntimeError``, as
    torch's ``parse_min_max_nnodes`` raises for a bad ``--nnodes``)."""


class UsageParser(argparse.ArgumentParser):
    """An argument parser of the commands: a mistake raises :class:`UsageError`."""

    def error(self, message: str) -> NoReturn:
        if "required: training_script" in message:
            message = f"no training script given (usage: {self.prog} [options] script [args])"
        raise UsageError(message)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4).

    Raises:
        UsageError: Not N or MIN:MAX with 0 < MIN <= MAX.
    """
    parts = text.strip().split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise UsageError(f"--nnodes {text!r} is not N or MIN:MAX") from None
    if not 0 < low <= high:
        raise UsageError(f"--nnodes {text!r}: need 0 < MIN <= MAX")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}`` (torch's rules: every key needs a value).

    Raises:
        UsageError: A key or a value is missing.
    """
    config: dict[str, str] = {}
    if not text.strip():
        return config
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not key.strip():
            raise UsageError(f"--rdzv-conf {text!r} is not key1=value1,key2=value2,...")
        if not sep or not value.strip():
            raise UsageError(f"--rdzv-conf: option '{key.strip()}' must have a value")
        config[key.strip()] = value.strip()
    return config


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGINT"`` -> the signals (names with or without ``SIG``).

    Raises:
        UsageError: An unknown signal name, or SIGKILL/SIGSTOP (they cannot be handled).
    """
    found: list[signal.Signals] = []
    for raw in text.split(","):
        name = raw.strip().upper()
        if not name:
            continue
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(f"--signals-to-handle: unknown signal {raw.strip()!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"--signals-to-handle: {name} cannot be handled")
        found.append(sig)
    return tuple(dict.fromkeys(found))


def parse_std(value: str, flag: str) -> str:
    from ..agent.api import Std

    try:
        Std.from_str(value)
    except ValueError:
        raise UsageError(f"{flag} {value!r} is not 0-3 or a map like 0:1,1:2") from None
    return value.strip()


def parse_local_ranks(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None
    try:
        ranks = frozenset(int(item) for item in text.split(","))
    except ValueError:
        raise UsageError(
            f"--local-ranks-filter {text!r} is not a comma-separated list of integers"
        ) from None
    return ranks


def rendezvous_of(
    args: argparse.Namespace, min_nodes: int, max_nodes: int
) -> tuple[str, str, str, bool, list[str]]:
    """(backend, endpoint, run_id, standalone, warnings) after torchrun's defaulting rules."""
    name = args.rdzv_backend.strip()
    warnings: list[str] = []
    standalone = bool(args.standalone)
    if not standalone and name == "static":
        if max_nodes > 1:
            return _static(args, min_nodes, max_nodes)
        standalone = True
    if standalone:
        if min_nodes > 1:
            raise UsageError(
                f"--standalone runs the rendezvous inside this launcher: it cannot wait for "
                f"--nnodes {args.nnodes} (use --rdzv-backend {external_names()} for several "
                "nodes)"
            )
        if name not in ("static", "memory", "aelastic-memory") or args.rdzv_endpoint:
            warnings.append("--standalone ignores --rdzv-backend, --rdzv-endpoint and --rdzv-id")
        return "memory", "", f"standalone-{uuid.uuid4().hex[:12]}", True, warnings
    backend = BACKEND_ALIASES.get(name)
    if backend is None:
        from ..backends.registry import backend_names

        if name not in backend_names():
            known = ", ".join(sorted(BACKEND_ALIASES))
            raise UsageError(f"--rdzv-backend {name!r} is unknown (known: {known})")
        backend = name
    info = backend_info(backend)
    if info is not None and info.multi_node and not args.rdzv_endpoint:
        raise UsageError(f"--rdzv-backend {name} needs --rdzv-endpoint ({info.endpoint_form})")
    single = info is not None and not info.multi_node
    if single and min_nodes > 1:
        raise UsageError(
            f"the {backend} backend lives in this process: it cannot wait for other nodes "
            f"(use --rdzv-backend {external_names()})"
        )
    if single and max_nodes > 1:
        warnings.append(f"the {backend} backend only joins nodes of this one process")
    if args.node_rank != 0:
        warnings.append("--node-rank is only used by a static rendezvous; ignored")
    return backend, args.rdzv_endpoint, args.rdzv_id, False, warnings


def _static(
    args: argparse.Namespace, min_nodes: int, max_nodes: int
) -> tuple[str, str, str, bool, list[str]]:
    """torchrun's multi-node static rendezvous: node rank 0 hosts it at the master address."""
    if min_nodes != max_nodes:
        raise UsageError(
            f"--nnodes {args.nnodes}: a static rendezvous needs a fixed number of nodes "
            f"(use --rdzv-backend c10d, {external_names()} for an elastic job)"
        )
    if not 0 <= args.node_rank < max_nodes:
        raise UsageError(f"--node-rank {args.node_rank} is not in [0, {max_nodes})")
    endpoint = args.rdzv_endpoint
    if not endpoint:
        port = 29500 if args.master_port is None else args.master_port
        endpoint = f"{args.master_addr or '127.0.0.1'}:{port}"
    return "static", endpoint, args.rdzv_id, False, []
