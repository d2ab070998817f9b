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

from benchmarks._plots import pyplot

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
    elif status.startswith("skipped"):
        form = "skipped"
    detect_max = _num(kill.get("max_s"), ".2f")
    if kill and kill.get("detected") != kill.get("survivors"):
        detect_max = f"{kill.get('detected')}/{kill.get('survivors')}"
    cells = [
        f"{case['n']:>5}",
        f"{form:>11}",
        f"{_num(formation.get('commands_per_node'), ',.1f'):>10}",
        f"{_num(formation.get('operations_per_node'), ',.0f'):>8}",
        f"{_kb(formation.get('bytes_per_node')):>10}",
        f"{_num(idle.get('commands_per_node'), ',.2f'):>9}",
        f"{_kb(idle.get('bytes_per_node')):>9}",
        f"{_num(idle.get('wakeups_per_node_s'), ',.2f'):>8}",
        f"{detect_max:>9}",
        f"{_num(kill.get('median_s'), '.2f'):>9}",
        f"{case.get('spurious_watch_returns', '-'):>8}",
        f"{_num(formation.get('connections_per_node'), '.1f'):>6}",
        f"{_ms_per_node(formation.get('nodes_cpu_s'), case['n']):>9}",
        f"{_ms_per_node(formation.get('server_cpu_s'), case['n']):>10}",
    ]
    return " | ".join(cells)


def _ms_per_node(seconds: float | None, n: int) -> str:
    return "-" if seconds is None else f"{seconds / n * 1000:.2f}"


_HEADER = " | ".join(
    [
        f"{'N':>5}",
        f"{'formation s':>11}",
        f"{'cmds/node':>10}",
        f"{'ops/node':>8}",
        f"{'KB/node':>10}",
        f"{'idle cmd':>9}",
        f"{'idle KB':>9}",
        f"{'wakeups':>8}",
        f"{'kill max':>9}",
        f"{'kill med':>9}",
        f"{'spurious':>8}",
        f"{'conns':>6}",
        f"{'node CPU':>9}",
        f"{'server CPU':>10}",
    ]
)
_UNITS = (
    "cmds: requests a node sent (Redis: commands from clients; HTTP: requests); ops: every "
    "command Redis ran, inside scripts too; "
    "idle cmd / idle KB / wakeups: per node per second; kill max/med: s from SIGKILL until "
    "the survivors' watch() showed the node lost; spurious: watch() returns before the kill; "
    "conns: connections opened per node during formation; node CPU / server CPU: ms of CPU "
    "per node during formation, of the node processes (user + system) and of the server"
)


_COST_HEADER = " | ".join(
    [
        f"{'N':>5}",
        f"{'procs':>5}",
        f"{'server busy':>11}",
        f"{'CPU us/beat':>11}",
        f"{'script us':>9}",
        f"{'B/beat':>7}",
        f"{'mem B/node':>10}",
        f"{'load':>5}",
    ]
)
_COST_UNITS = (
    "while idle (every request a heartbeat): server busy: the server process's CPU per "
    "second (1.0: one core); CPU us/beat: its CPU per request; script us: Redis' own time "
    "per script call (commandstats usec_per_call); B/beat: bytes the server sent per request; "
    "mem B/node: the server's memory (Redis used_memory, HTTP RSS) beyond its empty start, "
    "per node, at the idle window's end; load: the machine's 1-min load average before"
)


def _cost_row(case: dict[str, Any]) -> str:
    idle = case.get("idle", {})
    busy = idle.get("server_busy")
    load = case.get("load_average_before")
    cells = [
        f"{case['n']:>5}",
        f"{case.get('processes', '-'):>5}",
        f"{'-' if busy is None else f'{busy:.0%}':>11}",
        f"{_num(idle.get('server_cpu_us_per_request'), ',.1f'):>11}",
        f"{_num(idle.get('script_us_per_call'), ',.1f'):>9}",
        f"{_num(idle.get('bytes_per_request'), ',.0f'):>7}",
        f"{_num(idle.get('memory_per_node'), ',.0f'):>10}",
        f"{'-' if not load else f'{load[0]:.1f}':>5}",
    ]
    return " | ".join(cells)


def _ratio_line(cases: list[dict[str, Any]]) -> str | None:
    measured = [
        c
        for c in cases
        if c["status"] in ("ok", "did not finish")
        and c.get("formation", {}).get("bytes_per_node") is not None
    ]
    if len(measured) < 2 or measured[0]["status"] != "ok":
        return None
    small, large = measured[0], measured[-1]
    ratio = large["formation"]["bytes_per_node"] / small["formation"]["bytes_per_node"]
    growth = large["n"] / small["n"]
    bound = ""
    if large["status"] != "ok":
        bound = ">= "  # the traffic until the timeout: a lower bound
    return (
        f"  per-node formation bytes, N={large['n']} / N={small['n']}: {bound}{ratio:,.1f}x "
        f"(flat: 1x, linear in N: {growth:g}x, quadratic: {growth**2:g}x)"
        + (" (did not finish: traffic until the timeout)" if bound else "")
    )


def _notes(cases: list[dict[str, Any]]) -> list[str]:
    """What went wrong or looked odd in ``cases``, one line each."""
    notes: list[str] = []
    for case in cases:
        at = f"  N={case['n']}:"
        if case.get("errors"):
            notes.append(f"{at} {len(case['errors'])} distinct errors, e.g. {case['errors'][0]}")
        if case.get("died"):
            notes.append(f"{at} worker processes {case['died']} exited on their own")
        if case.get("spurious_watch_returns"):
            sample = case["spurious_samples"][0]
            lost = ", ".join(sample["lost"][:3])
            notes.append(
                f"{at} {case['spurious_watch_returns']} watch() returns before the kill, "
                f"e.g. round {sample['round']}, lost [{lost}], waiting {sample['waiting']}, "
                f"removed {sample['removed']}"
            )
        others = case.get("kill", {}).get("other_members_lost")
        if others:
            notes.append(f"{at} after the kill, {others} other live members were seen lost")
        if case.get("watch_errors"):
            notes.append(f"{at} {case['watch_errors']} watch() calls raised")
        issues = case.get("log_issues", {})
        if issues.get("lines"):
            notes.append(
                f"{at} {issues['lines']} error/warning lines in the workers' stderr, e.g. "
                f"{issues['samples'][0][:160]}"
            )
    return notes


def format_report(results: dict[str, Any]) -> str:
    """The tables of one run, as text."""
    out: list[str] = []
    label, isolation = results["label"], results["isolation"]
    backends = list(dict.fromkeys(c["backend"] for c in results["cases"]))
    for backend in backends:
        cases = [c for c in results["cases"] if c["backend"] == backend]
        where = (
            "each node on its own event loop and thread"
            if isolation == "thread"
            else "the nodes of a process as tasks of one event loop"
        )
        out.append(f"{backend} ({label}; {where})")
        out.append(_HEADER)
        out.append("-" * len(_HEADER))
        out += [_case_row(c) for c in cases]
        ratio = _ratio_line(cases)
        if ratio:
            out.append(ratio)
        out += _notes(cases)
        if any(c.get("idle") for c in cases):
            out.append(_COST_HEADER)
            out.append("-" * len(_COST_HEADER))
            out += [_cost_row(c) for c in cases if c.get("idle")]
        out.append("")
    if results["cases"]:
        out.append(_UNITS)
        out.append(_COST_UNITS)
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
            elif status.startswith("skipped"):
                form = "skipped"
            out.append(
                f"{case['n']:>5} | {form:>11} | {_kb(formation.get('bytes_per_node')):>10} | "
                f"{_num(formation.get('connections_per_node'), '.1f'):>6}"
            )
        ratio = _ratio_line(results["torch"])
        if ratio:
            out.append(ratio)
        out += _notes(results["torch"])
        out.append("")
    for case in results["spurious"]:
        idle = case.get("idle", {})
        formation = case.get("formation", {})
        head = f"spurious-change check, {case['backend']}: {case['n']} processes x 1 node:"
        if case["status"] != "ok":
            out.append(
                f"{head} {case['status']} (formation limit {formation.get('timeout_s', '-')} s, "
                f"{formation.get('formed', 0)} formed, {_kb(formation.get('bytes_per_node'))} "
                "KB/node sent meanwhile)"
            )
        else:
            out.append(
                f"{head} formed in {_num(formation.get('seconds'), '.3f')} s, then "
                f"{_num(idle.get('seconds'), '.0f')} s idle: watch() returns "
                f"{case.get('spurious_watch_returns', '-')} (must be 0), wake-ups/node/s "
                f"{_num(idle.get('wakeups_per_node_s'), '.2f')}, idle KB/node/s "
                f"{_kb(idle.get('bytes_per_node'))}"
            )
        out += _notes([case])
    return "\n".join(out)


def save(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def _series(results: dict[str, Any]) -> dict[str, list[tuple[int, float, bool]]]:
    """(N, per-node formation bytes, finished) by line name."""
    label = results["label"]
    series: dict[str, list[tuple[int, float, bool]]] = {}
    for group, prefix in ((results["cases"], ""), (results["torch"], "torch c10d")):
        for case in group:
            per_node = case.get("formation", {}).get("bytes_per_node")
            if case["status"] not in ("ok", "did not finish") or not per_node:
                continue
            name = prefix or case["backend"]
            point = (case["n"], per_node, case["status"] == "ok")
            series.setdefault(f"{name} ({label})", []).append(point)
    return series


def plot(documents: list[dict[str, Any]], path: Path) -> None:
    """Per-node formation bytes against N (log-log), one line per (label, backend).

    A formation that did not finish is drawn with an open triangle: its traffic until the
    timeout, a lower bound.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    figure, axes = plt.subplots(figsize=(7, 4.5))
    sizes: set[int] = set()
    unfinished = False
    for results in documents:
        for name, points in _series(results).items():
            points.sort()
            sizes.update(p[0] for p in points)
            style = "s--" if name.startswith("torch") else "o-"
            finished = [i for i, p in enumerate(points) if p[2]]
            (line,) = axes.plot(
                [p[0] for p in points],
                [p[1] / 1024 for p in points],
                style,
                markevery=finished,
                label=name,
            )
            open_points = [p for p in points if not p[2]]
            if open_points:
                unfinished = True
                axes.plot(
                    [p[0] for p in open_points],
                    [p[1] / 1024 for p in open_points],
                    "^",
                    markersize=11,
                    markerfacecolor="none",
                    color=line.get_color(),
                )
    if unfinished:
        axes.plot([], [], "^", markerfacecolor="none", color="gray", label="did not finish")
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
