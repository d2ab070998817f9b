"""torchrun flags about how torch's own agent logs and binds its workers: checked and applied.

How it works: :func:`torchrun_only_flags` validates ``--logs-specs``, ``--numa-binding`` and
``--duplicate-std{out,err}-filters`` as torchrun does (an unknown value is a usage error) and
returns what the agent applies, with the warnings that say where aelastic differs.
``--logs-specs`` names an entry point of torch's ``torchrun.logs_specs`` group: aelastic keeps
its own log layout (``--log-dir``, torch's default one), so a custom one is accepted with a
warning. ``--numa-binding`` is applied by the agent (:mod:`aelastic.agent.processes.numa`).
The filters follow torchrun's list syntax (``a,b``; ``,,`` is a literal comma; an empty value
means no filter) and, as under torchrun, only look at teed streams. torch is never imported here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..agent.api import Std
from ..agent.processes.numa import NUMA_MODES

__all__ = ["NUMA_MODES", "TorchrunOptions", "parse_filters", "torchrun_only_flags"]


@dataclass(frozen=True)
class TorchrunOptions:
    """What the torchrun-only flags ask of the agent."""

    numa_binding: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()


def parse_filters(text: str) -> tuple[str, ...]:
    """torchrun's list syntax: ``"a,b"`` -> ``("a", "b")``, ``"a,,b"`` -> ``("a,b",)``;
    empty -> no filter (torchrun's help: "an empty filters list won't duplicate any lines")."""
    if not text:
        return ()
    marker = "\0"
    return tuple(item.replace(marker, ",") for item in text.replace(",,", marker).split(","))


def torchrun_only_flags(args: argparse.Namespace) -> tuple[TorchrunOptions, list[str]]:
    """The options of the torchrun-only flags in ``args``, and warnings about them.

    Raises:
        UsageError: An unknown ``--numa-binding`` mode or ``--logs-specs`` name.
    """
    from .rules import UsageError

    warnings: list[str] = []
    spec = getattr(args, "logs_specs", None)
    if spec and spec != "default":
        known = _logs_specs()
        if spec not in known:
            listed = ", ".join(sorted(known)) or "none installed"
            raise UsageError(
                f"--logs-specs {spec!r} is not an entry point of the torchrun.logs_specs group "
                f"({listed})"
            )
        warnings.append(
            f"--logs-specs {spec}: aelastic writes worker logs its own way (see --log-dir)"
        )
    numa = getattr(args, "numa_binding", None) or None
    if numa is not None and numa not in NUMA_MODES:
        raise UsageError(f"--numa-binding must be one of {', '.join(NUMA_MODES)}, not {numa!r}")
    filters = []
    for stream, std in (("stdout", Std.OUT), ("stderr", Std.ERR)):
        found = parse_filters(getattr(args, f"duplicate_{stream}_filters", "") or "")
        filters.append(found)
        if found and not _teed(getattr(args, "tee", "0"), std):
            warnings.append(
                f"--duplicate-{stream}-filters: only teed lines are duplicated (as torchrun "
                f"does) and --tee does not tee {stream}: filtered_{stream}.log stays empty"
            )
    return TorchrunOptions(numa, filters[0], filters[1]), warnings


def _teed(tee: str, std: Std) -> bool:
    try:
        value = Std.from_str(str(tee))
    except ValueError:
        return True  # reported elsewhere
    values = value.values() if isinstance(value, dict) else [value]
    return any(v & std for v in values)


def _logs_specs() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="torchrun.logs_specs")}
