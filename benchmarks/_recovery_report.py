"""Tables and saved results of ``rdzv_recovery.py``.

Results are one JSON document per run: ``label``, ``settings`` and ``cases`` (one per
backend, N, case and repetition: ``formation``, ``idle``, ``recovery``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["format_report", "save"]

_COLUMNS = (
    ("backend", 7),
    ("N", 5),
    ("case", 10),
    ("new round max", 13),
    ("median", 7),
    ("loss seen", 9),
    ("broke", 5),
    ("checks", 14),
    ("req/surv", 8),
    ("KB/surv", 7),
    ("CPU ms/surv", 11),
    ("nodes CPU s", 11),
    ("load", 5),
)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _checks(recovery: dict[str, Any]) -> str:
    if not recovery:
        return "-"
    bad = [
        what
        for what, ok in (
            ("ranks", recovery["ranks_ok"]),
            ("master", recovery["master_ok"]),
            ("rounds", recovery["rounds_taken"] == 1),
        )
        if not ok
    ]
    return "ok" if not bad else "BAD " + ",".join(bad)


def _row(case: dict[str, Any]) -> str:
    recovery = case.get("recovery", {})
    took = _num(recovery.get("max_s"), ".3f") if case["status"] == "ok" else case["status"]
    load = case.get("load_average_at_loss", case["load_average_before"])[0]
    kb = recovery.get("bytes_per_survivor")
    cells = [
        case["backend"],
        str(case["n"]),
        case["case"] + ("/" + str(case.get("victim_rank")) if "victim_rank" in case else ""),
        took,
        _num(recovery.get("median_s"), ".3f"),
        _num(recovery.get("reaction", {}).get("max_s"), ".3f"),
        str(recovery.get("collective_broke", {}).get("count", "-")),
        _checks(recovery),
        _num(recovery.get("requests_per_survivor"), ".1f"),
        _num(None if kb is None else kb / 1024, ".2f"),
        _num(recovery.get("server_cpu_ms_per_survivor"), ".2f"),
        _num(recovery.get("nodes_cpu_s"), ".2f"),
        f"{load:.1f}",
    ]
    return " | ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))


def _ratios(cases: list[dict[str, Any]]) -> list[str]:
    """Per backend and case: the largest N's store work per survivor against the smallest's."""
    lines = []
    keys = sorted({(c["backend"], c["case"]) for c in cases if c.get("recovery")})
    for backend, name in keys:
        done = [c for c in cases if (c["backend"], c["case"]) == (backend, name)]
        done = [c for c in done if c.get("recovery")]
        small = min(done, key=lambda c: c["n"])
        large = max(done, key=lambda c: c["n"])
        if small["n"] == large["n"]:
            continue
        parts = []
        for field, what in (
            ("requests_per_survivor", "requests"),
            ("bytes_per_survivor", "bytes"),
            ("server_cpu_ms_per_survivor", "CPU"),
        ):
            a, b = small["recovery"].get(field), large["recovery"].get(field)
            if a and b is not None and a > 0:
                parts.append(f"{what} {b / a:.2f}x")
        if parts:
            lines.append(
                f"{backend} {name}: per survivor at N={large['n']} against N={small['n']}: "
                + ", ".join(parts)
            )
    return lines


def format_report(results: dict[str, Any]) -> str:
    config = results["settings"]["config"]
    window = config["keep_alive_interval"] * config["keep_alive_max_attempt"]
    lines = [
        f"Recovery at scale ({results['label']}, {results['created']}, "
        f"{results['cpus']} CPUs, load at start {results['load_average_at_start'][0]:.1f})",
        f"job --nnodes (N-1):N, last call {config['last_call_timeout']:g} s, heartbeat "
        f"{config['keep_alive_interval']:g} s, window {window:g} s; collectives broken at the "
        f"loss: {results['settings']['breaks']}",
        "new round: seconds from the signal until every survivor's next_rendezvous() returned "
        "(median too); loss seen: until the last survivor acted on it; broke: survivors whose "
        "collective broke; store work (requests, KB out, CPU) per survivor from the signal to "
        "the last new round; nodes CPU: the simulated nodes' processes meanwhile (all survivors)",
        " | ".join(f"{name:>{w}}" for name, w in _COLUMNS),
    ]
    lines += [_row(case) for case in results["cases"]]
    lines += _ratios(results["cases"])
    for case in results["cases"]:
        issues = case.get("log_issues", {})
        if issues.get("lines"):
            lines.append(
                f"{case['backend']} N={case['n']} {case['case']}: {issues['lines']} "
                f"warning lines, e.g. {issues['samples'][:2]}"
            )
        recovery = case.get("recovery", {})
        if recovery and recovery["rounds_taken"] != 1:
            lines.append(f"{case['backend']} N={case['n']} {case['case']}, after the loss:")
            lines += [f"  {line}" for line in recovery["timeline"][:12]]
        if case.get("errors"):
            lines.append(f"{case['backend']} N={case['n']} {case['case']}: {case['errors']}")
    return "\n".join(lines)


def save(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
