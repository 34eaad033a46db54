"""PNG plots beside a benchmark's JSON result: latency CDFs and per-stage stacked bars.

One call per benchmark, after its JSON is written::

    plot_result(json_path, {"1 client": {"kalos-shm": ns, "kalos-uds": ns}})

writes ``<json_path minus .json>.png``:

* top row: one panel per group (a concurrency level, a data size: the dict's keys), the
  latency CDF of every system in it (x: µs, log scale; y: fraction of requests), dotted
  lines at p50 and p99;
* bottom (when ``stages`` is given): per-stage stacked bars, one bar per label (e.g.
  "kalos-shm, 8 threads"): the mean µs of each stage, which sum to the mean round trip.

matplotlib (``pip install 'kalos[bench]'``) draws with its Agg backend (no display). A plot
is an extra: any failure is reported on stderr and ``None`` returned, never raised, so the
JSON written before it is never lost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

# Quantiles drawn per CDF line: even steps, then a log-spaced tail up to p99.99.
_QUANTILES = np.unique(np.concatenate([np.linspace(0, 0.99, 199), 1 - np.logspace(-2, -4, 60)]))


def png_path(json_path: str) -> str:
    """``bench/results/x.json`` → ``bench/results/x.png``."""
    root, ext = os.path.splitext(json_path)
    return (root if ext == ".json" else json_path) + ".png"


def plot_result(
    json_path: str,
    samples_ns: Mapping[str, Mapping[str, np.ndarray]],
    stages_us: Mapping[str, Mapping[str, float]] | None = None,
    *,
    title: str | None = None,
) -> str | None:
    """Writes the PNG beside ``json_path``; returns its path, or None when it could not.

    ``samples_ns``: group → system → every request's latency in ns (empty groups and
    systems are skipped). ``stages_us``: bar label → stage → mean µs (e.g. a row's
    ``stages["mean_us"]``); stages are stacked in the order given.
    """
    path = png_path(json_path)
    try:
        _draw(path, samples_ns, stages_us, title or os.path.basename(json_path))
    except Exception as exc:  # a plot must never cost the result: report and go on
        print(f"kalos bench: no plot ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return path


def plot_recall(
    json_path: str,
    panels: Sequence[tuple[str, Mapping[str, Sequence[tuple[float, float, int]]]]],
) -> str | None:
    """Writes the PNG of an approximate search's trade-off beside ``json_path``, a panel per
    parameter set: recall (y) against p99 latency (x, µs, log scale), one line per system,
    each point labelled with its setting (``nprobe``; 0: an exact index, drawn as a lone
    marker). ``panels``: [(title, system -> [(p99 µs, recall, setting), ...]), ...]. Returns
    the path, or None (reported)."""
    path = png_path(json_path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        fig, axes = plt.subplots(
            len(panels), 1, figsize=(7.5, 5.0 * len(panels)), layout="constrained", squeeze=False
        )
        for ax, (title, curves) in zip(axes[:, 0], panels, strict=True):
            for system, points in curves.items():
                pts = sorted(points, key=lambda p: p[2])  # in order of the setting
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                exact = all(p[2] == 0 for p in pts)
                ax.plot(xs, ys, marker="*" if exact else "o", markersize=10 if exact else 4,
                        linestyle="none" if exact else "-", label=system)  # fmt: skip
                if not exact:
                    for x, y, setting in pts:
                        ax.annotate(str(setting), (x, y), textcoords="offset points",
                                    xytext=(3, -10), fontsize="x-small")  # fmt: skip
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("p99 latency (µs, log scale)")
            ax.set_ylabel("recall@10 against exact")
            ax.set_ylim(min(0.5, ax.get_ylim()[0]), 1.005)
            for level in (0.95, 0.99):
                ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small", loc="lower right")
            ax.set_title(title, fontsize="medium")
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
    except Exception as exc:  # a plot must never cost the result: report and go on
        print(f"kalos bench: no plot ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return path


def _draw(
    path: str,
    samples_ns: Mapping[str, Mapping[str, np.ndarray]],
    stages_us: Mapping[str, Mapping[str, float]] | None,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    groups = {
        g: {s: np.asarray(v) for s, v in systems.items() if len(v)}
        for g, systems in samples_ns.items()
    }
    groups = {g: systems for g, systems in groups.items() if systems}
    bars = {k: v for k, v in (stages_us or {}).items() if v}
    if not groups and not bars:
        raise ValueError("nothing to plot")
    names = list(dict.fromkeys(s for systems in groups.values() for s in systems))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {s: cycle[i % len(cycle)] for i, s in enumerate(names)}
    ncols = max(len(groups), 1)
    nrows = (1 if groups else 0) + (1 if bars else 0)
    fig = plt.figure(figsize=(max(6.0, 4.5 * ncols), 4.2 * nrows), layout="constrained")
    grid = fig.add_gridspec(nrows, ncols)
    row = 0
    if groups:
        for col, (group, systems) in enumerate(groups.items()):
            ax = fig.add_subplot(grid[0, col])
            lo, hi = np.inf, 0.0
            for system, ns in systems.items():
                us = np.maximum(np.quantile(ns.astype(np.float64) / 1e3, _QUANTILES), 1e-3)
                ax.plot(us, _QUANTILES, label=system, color=color[system])
                lo, hi = min(lo, us[0]), max(hi, us[-1])
            ax.set_xscale("log")
            # Plain numbers; at 1, 2 and 5 per decade when the panel spans only a few decades.
            subs = (1.0, 2.0, 5.0) if hi / lo < 300 else (1.0,)
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0, 1.0)
            for q in (0.5, 0.99):
                ax.axhline(q, color="grey", linestyle=":", linewidth=0.8)
            ax.set_xlabel("latency (µs, log scale)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(str(group))
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        row = 1
    if bars:
        ax = fig.add_subplot(grid[row, :])
        stage_names = list(dict.fromkeys(s for st in bars.values() for s in st))
        labels = list(bars)
        x = np.arange(len(labels))
        bottom = np.zeros(len(labels))
        for stage in stage_names:
            h = np.array([max(float(bars[label].get(stage, 0.0)), 0.0) for label in labels])
            ax.bar(x, h, bottom=bottom, label=stage)
            bottom += h
        ax.set_xticks(x, labels, rotation=20, ha="right", fontsize="small")
        ax.set_ylabel("mean µs per stage (sums to the mean round trip)")
        ax.set_title("kalos per-stage breakdown")
        ax.legend(fontsize="small")
    fig.suptitle(title)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
