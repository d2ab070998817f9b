"""PNG plots of the benchmarks (``--plot PATH``), with matplotlib (the ``bench`` extra).

Each figure says where it was measured (the machine's CPUs and load) in a footnote: the
numbers come from one run on a shared machine, torch and aelastic measured in that run.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bars", "footnote", "lines", "pyplot"]

#: torch first, in grey; aelastic's variants in blues and greens.
COLORS = ["#7f7f7f", "#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (Agg).

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
    return plt


def footnote(extra: str = "") -> str:
    """Where the figures were measured: CPUs, load, Python; plus ``extra``."""
    load = os.getloadavg()[0]
    cpus = len(os.sched_getaffinity(0))
    text = f"{cpus} CPUs, load {load:.1f} (shared machine), Python {platform.python_version()}"
    return f"{text}; {extra}" if extra else text


def _save(plt: Any, figure: Any, path: Path, note: str) -> None:
    figure.text(0.01, 0.01, note, fontsize=7, color="#555555")
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def lines(
    series: Mapping[str, Mapping[int, float]],
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    note: str,
) -> None:
    """One line per series (x: int, y: seconds), log-log; a series named ``torch...`` is
    dashed."""
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    figure, axes = plt.subplots(figsize=(7.5, 4.6))
    xs: set[int] = set()
    for index, (name, points) in enumerate(series.items()):
        if not points:
            continue
        ordered = sorted(points.items())
        xs.update(x for x, _ in ordered)
        torch = name.startswith("torch")
        axes.plot(
            [x for x, _ in ordered],
            [y for _, y in ordered],
            "s--" if torch else "o-",
            color=COLORS[index % len(COLORS)],
            label=name,
            linewidth=2 if torch else 1.6,
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(xs))
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.set_yscale("log")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    _save(plt, figure, path, note)


def bars(
    panels: Sequence[tuple[str, str, Sequence[str], Mapping[str, Sequence[float | None]]]],
    path: Path,
    *,
    title: str,
    note: str,
    log: bool = False,
) -> None:
    """Grouped bars, one panel per ``(panel title, y label, groups, {series: values})``;
    each bar is labelled with its value; ``log``: logarithmic y axes."""
    plt = pyplot()
    figure, axes_list = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4))
    if len(panels) == 1:
        axes_list = [axes_list]
    for axes, (panel_title, ylabel, groups, series) in zip(axes_list, panels, strict=True):
        width = 0.8 / max(len(series), 1)
        for index, (name, values) in enumerate(series.items()):
            offsets = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
            shown = [(o, v) for o, v in zip(offsets, values, strict=True) if v is not None]
            rects = axes.bar(
                [o for o, _ in shown],
                [v for _, v in shown],
                width,
                label=name,
                color=COLORS[index % len(COLORS)],
            )
            axes.bar_label(rects, labels=[_short(v) for _, v in shown], fontsize=7, padding=2)
        axes.set_xticks(range(len(groups)))
        axes.set_xticklabels(groups, fontsize=8)
        axes.set_ylabel(ylabel)
        axes.set_title(panel_title, fontsize=10)
        if log:
            axes.set_yscale("log")
        axes.margins(y=0.15)
        axes.grid(True, axis="y", alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(title)
    _save(plt, figure, path, note)


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"
