"""PNG plots with an explicit Figure and the Agg canvas (the caller's matplotlib backend and
pyplot state are never touched)."""

from __future__ import annotations

import numpy as np


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def retrieval_heatmaps(
    grids: dict[str, tuple[list[int], list[float], np.ndarray]], title: str, path: str
) -> str:
    """One heatmap per model: accuracy over (context length, depth)."""
    fig, axes = _figure(4.2 * len(grids), 3.2, len(grids))
    im = None
    for ax, (label, (lengths, depths, acc)) in zip(axes, grids.items()):
        im = ax.imshow(
            np.asarray(acc, float), vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower"
        )
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context length")
        ax.set_title(label)
        for i in range(len(lengths)):
            for j in range(len(depths)):
                v = np.asarray(acc, float)[i, j]
                ax.text(
                    j,
                    i,
                    "-" if np.isnan(v) else f"{v:.2f}",
                    ha="center",
                    va="center",
                    color="w" if np.isnan(v) or v < 0.6 else "k",
                    fontsize=8,
                )
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
    fig.suptitle(title)
    return _save(fig, path)


def lines(
    series: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    path: str,
    logx: bool = False,
    logy: bool = False,
    symlog_threshold: float | None = None,
    styles: dict[str, str] | None = None,
) -> str:
    """Line plots; ``symlog_threshold``: a symmetric log y axis, linear within +/- it (shows
    negative values, e.g. a differential map's signed weights)."""
    fig, (ax,) = _figure(6, 4)
    for label, (x, y) in series.items():
        ax.plot(x, y, (styles or {}).get(label, "-o"), ms=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if symlog_threshold is not None:
        ax.set_yscale("symlog", linthresh=symlog_threshold)
    elif logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def allocation_bars(
    alloc: dict[str, tuple[list[float], np.ndarray]], categories, path: str, title: str
) -> str:
    """Per model: stacked shares of each category by depth."""
    fig, axes = _figure(4.2 * len(alloc), 3.4, len(alloc))
    for ax, (label, (depths, shares)) in zip(axes, alloc.items()):
        shares = np.nan_to_num(np.asarray(shares, float))
        x = np.arange(len(depths))
        pos = np.zeros(len(depths))
        neg = np.zeros(len(depths))
        for c, name in enumerate(categories):
            v = shares[:, c]
            base = np.where(v >= 0, pos, neg)
            ax.bar(x, v, bottom=base, label=name)
            pos, neg = pos + np.maximum(v, 0), neg + np.minimum(v, 0)
        ax.set_xticks(x, [f"{d:.0%}" for d in depths])
        ax.set_xlabel("depth of the asked needle")
        ax.set_ylabel("share of attention")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(label)
    axes[-1].legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)
