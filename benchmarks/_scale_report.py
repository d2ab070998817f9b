"""Tables, saved results and the plot of ``rdzv_scale.py``.

Results are one JSON document per run: ``label`` (the design measured, e.g. ``before``),
``isolation``, ``cases`` (one per backend and N: ``formation``, ``idle``, ``kill``),
``torch`` (torch's c10d handler, formation only) and ``spurious`` (one node per process,
idle only). :func:`plot` draws per-node formation bytes against N from any number of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["format_report", "plot", "save"]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _kb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024:,.1f}"


def _case_row(case: dict[str, Any]) -> str:
    formation = case.get("formation", {})
    idle = case.get("idle", {})
    kill = case.get("kill", {})
    status = case["status"]
    seconds = formation.get("seconds")
    form = _num(seconds, ".3f") if status == "ok" else status
    if status == "did not finish":
        form = f"DNF>{formation.get('timeout_s', 0):g}s"
    detect_max = _num(kill.get("max_s"), ".2f")
    if kill and kill.get("detected") != kill.get("survivors"):
        detect_max = f"{kill.get('detected')}/{kill.get('survivors')}"
    cells = [
        f"{case['n']:>5}",
        f"{form:>11}",
        f"{_num(formation.get('commands_per_node'), ',.1f'):>10}",
        f"{_kb(formation.get('bytes_per_node')):>10}",
        f"{_num(idle.get('commands_per_node'), ',.2f'):>9}",
        f"{_kb(idle.get('bytes_per_node')):>9}",
        f"{_num(idle.get('wakeups_per_node_s'), ',.2f'):>8}",
        f"{detect_max:>9}",
        f"{_num(kill.get('median_s'), '.2f'):>9}",
        f"{case.get('spurious_watch_returns', '-'):>8}",
        f"{_num(formation.get('connections_per_node'), '.1f'):>6}",
    ]
    return " | ".join(cells)


_HEADER = " | ".join(
    [
        f"{'N':>5}",
        f"{'formation s':>11}",
        f"{'cmds/node':>10}",
        f"{'KB/node':>10}",
        f"{'idle cmd':>9}",
        f"{'idle KB':>9}",
        f"{'wakeups':>8}",
        f"{'kill max':>9}",
        f"{'kill med':>9}",
        f"{'spurious':>8}",
        f"{'conns':>6}",
    ]
)
_UNITS = (
    "idle cmd / idle KB / wakeups: per node per second; kill max/med: s from SIGKILL until "
    "the survivors' watch() showed the node lost; spurious: watch() returns before the kill; "
    "conns: connections opened per node during formation"
)


def _ratio_line(cases: list[dict[str, Any]]) -> str | None:
    done = [
        c
        for c in cases
        if c["status"] == "ok" and c.get("formation", {}).get("bytes_per_node") is not None
    ]
    if len(done) < 2:
        return None
    small, large = done[0], done[-1]
    ratio = large["formation"]["bytes_per_node"] / small["formation"]["bytes_per_node"]
    growth = large["n"] / small["n"]
    return (
        f"  per-node formation bytes, N={large['n']} / N={small['n']}: {ratio:,.1f}x "
        f"(flat: 1x, linear in N: {growth:g}x, quadratic: {growth**2:g}x)"
    )


def format_report(results: dict[str, Any]) -> str:
    """The tables of one run, as text."""
    out: list[str] = []
    label, isolation = results["label"], results["isolation"]
    backends = list(dict.fromkeys(c["backend"] for c in results["cases"]))
    for backend in backends:
        cases = [c for c in results["cases"] if c["backend"] == backend]
        out.append(f"{backend} ({label}; nodes per process on one {isolation} each)")
        out.append(_HEADER)
        out.append("-" * len(_HEADER))
        out += [_case_row(c) for c in cases]
        ratio = _ratio_line(cases)
        if ratio:
            out.append(ratio)
        out.append("")
    if results["cases"]:
        out.append(_UNITS)
        out.append("")
    if results["torch"]:
        out.append("torch c10d (DynamicRendezvousHandler + C10dRendezvousBackend, TCPStore)")
        out.append(f"{'N':>5} | {'formation s':>11} | {'KB/node':>10} | {'conns':>6}")
        for case in results["torch"]:
            formation = case.get("formation", {})
            status = case["status"]
            form = _num(formation.get("seconds"), ".3f") if status == "ok" else status
            if status == "did not finish":
                form = f"DNF>{formation.get('timeout_s', 0):g}s"
            out.append(
                f"{case['n']:>5} | {form:>11} | {_kb(formation.get('bytes_per_node')):>10} | "
                f"{_num(formation.get('connections_per_node'), '.1f'):>6}"
            )
        ratio = _ratio_line(results["torch"])
        if ratio:
            out.append(ratio)
        out.append("")
    for case in results["spurious"]:
        idle = case.get("idle", {})
        out.append(
            f"spurious-change check, {case['backend']}: {case['n']} processes x 1 node, "
            f"{_num(idle.get('seconds'), '.0f')} s idle: status {case['status']}, "
            f"watch() returns {case.get('spurious_watch_returns', '-')} (must be 0), "
            f"wake-ups/node/s {_num(idle.get('wakeups_per_node_s'), '.2f')}, "
            f"idle KB/node/s {_kb(idle.get('bytes_per_node'))}, "
            f"formation {_num(case.get('formation', {}).get('seconds'), '.3f')} s"
        )
    return "\n".join(out)


def save(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def _series(results: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    label = results["label"]
    series: dict[str, list[tuple[int, float]]] = {}
    for group, prefix in ((results["cases"], ""), (results["torch"], "torch c10d")):
        for case in group:
            per_node = case.get("formation", {}).get("bytes_per_node")
            if case["status"] != "ok" or not per_node:
                continue
            name = prefix or case["backend"]
            series.setdefault(f"{name} ({label})", []).append((case["n"], per_node))
    return series


def plot(documents: list[dict[str, Any]], path: Path) -> None:
    """Per-node formation bytes against N (log-log), one line per (label, backend).

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'aelastic[bench]' (or pip install matplotlib)"
        ) from None
    from matplotlib.ticker import ScalarFormatter

    figure, axes = plt.subplots(figsize=(7, 4.5))
    sizes: set[int] = set()
    for results in documents:
        for name, points in _series(results).items():
            points.sort()
            xs, ys = [p[0] for p in points], [p[1] / 1024 for p in points]
            sizes.update(xs)
            style = "s--" if name.startswith("torch") else "o-"
            axes.plot(xs, ys, style, label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(sizes))
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.set_yscale("log")
    axes.set_xlabel("nodes (N)")
    axes.set_ylabel("server bytes out per node during formation (KiB)")
    axes.set_title("Rendezvous formation: server traffic per node")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
