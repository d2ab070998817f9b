"""torchrun flags that change how torch's own agent logs or binds: checked, then explained.

How it works: :func:`torchrun_only_flags` validates ``--logs-specs``, ``--numa-binding`` and
``--duplicate-std{out,err}-filters`` as torchrun does (an unknown value is a usage error) and
returns the warnings that say what aelastic does instead. ``--logs-specs`` names an entry
point of torch's ``torchrun.logs_specs`` group: aelastic keeps its own log layout
(``--log-dir``), so a custom one is accepted with a warning. torch is never imported here.
"""

from __future__ import annotations

import argparse

__all__ = ["NUMA_MODES", "torchrun_only_flags"]

#: ``--numa-binding`` values (torch.numa.binding).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def torchrun_only_flags(args: argparse.Namespace) -> list[str]:
    """Warnings for the torchrun-only flags given in ``args``.

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
    numa = getattr(args, "numa_binding", None)
    if numa:
        if numa not in NUMA_MODES:
            raise UsageError(f"--numa-binding must be one of {', '.join(NUMA_MODES)}, not {numa!r}")
        warnings.append(f"--numa-binding {numa}: not applied by aelastic (workers are not bound)")
    for stream in ("stdout", "stderr"):
        filters = getattr(args, f"duplicate_{stream}_filters", "") or ""
        if filters.strip():
            warnings.append(
                f"--duplicate-{stream}-filters: not applied by aelastic; every worker's "
                f"{stream} is kept under --log-dir"
            )
    return warnings


def _logs_specs() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="torchrun.logs_specs")}
