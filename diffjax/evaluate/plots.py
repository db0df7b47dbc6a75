"""PNG plots with an explicit Figure and the Agg canvas (the caller's matplotlib backend and
pyplot state are never touched): three kinds of chart (:func:`retrieval_heatmaps`,
:func:`lines`, :func:`allocation_bars`) and the helpers the analyses' own figures use (each
analysis draws its figure of ``eval.md`` beside its section). The ``draw_*`` functions return the unsaved figure (what the tests inspect: shared axes, tick
labels, the notes under a figure)."""

from __future__ import annotations

import textwrap

import numpy as np

from diffjax.infra import storage


def figure(width: float, height: float, ncols: int = 1, sharey: bool = False):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False, sharey=sharey)[0]
    return fig, list(axes)


def _note(fig, lines_: list[str]) -> None:
    """Notes under the figure (what a reader would otherwise misread: empty cells, signed
    shares), as the figure's bottom label."""
    if lines_:
        width = max(40, int(fig.get_figwidth() * 15))  # characters per line at fontsize 8
        text = "\n".join(textwrap.fill(x, width) for x in lines_)
        fig.supxlabel(text, fontsize=8, ha="center")


def save(fig, path: str) -> str:
    """``fig`` as a PNG at ``path`` (local or ``gs://``), written whole."""
    storage.save_figure(fig, path, dpi=100)
    return path


def draw_retrieval_heatmaps(
    grids: dict[str, tuple[list[int], list[float], np.ndarray]], title: str
):
    """The figure (not saved) of :func:`retrieval_heatmaps`. A depth with no query in any panel (every
    cell NaN: no needle was placed in that bin) is not drawn, and a note under the figure
    names it; an empty cell among drawn ones reads "–" and the note says what that means."""
    accs = {k: np.asarray(acc, float) for k, (_, _, acc) in grids.items()}
    depths0 = next(iter(grids.values()))[1] if grids else []
    empty_everywhere = [
        j
        for j in range(len(depths0))
        if all(a.shape[1] > j and np.isnan(a[:, j]).all() for a in accs.values())
    ]
    keep = [j for j in range(len(depths0)) if j not in empty_everywhere]
    fig, axes = figure(4.2 * len(grids), 3.4, len(grids))
    im = None
    empty_cell = False
    for ax, (label, (lengths, depths, _)) in zip(axes, grids.items()):
        acc = accs[label][:, keep]
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(keep)), [f"{depths[j]:.0%}" for j in keep])
        ax.set_yticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context length")
        ax.set_title(label)
        for i in range(len(lengths)):
            for j in range(len(keep)):
                v = acc[i, j]
                empty_cell |= bool(np.isnan(v))
                ax.text(
                    j,
                    i,
                    "–" if np.isnan(v) else f"{v:.2f}",
                    ha="center",
                    va="center",
                    color="k" if np.isnan(v) or v >= 0.6 else "w",
                    fontsize=8,
                )
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
    notes = []
    if empty_everywhere:
        notes.append(
            "not drawn: depth "
            + ", ".join(f"{depths0[j]:.0%}" for j in empty_everywhere)
            + " (no query's needle fell in that depth bin at these lengths)"
        )
    if empty_cell:
        notes.append("–: no query's needle fell in that depth bin at that length")
    _note(fig, notes)
    fig.suptitle(title)
    return fig


def retrieval_heatmaps(
    grids: dict[str, tuple[list[int], list[float], np.ndarray]], title: str, path: str
) -> str:
    """One heatmap per model: accuracy over (context length, depth)."""
    return save(draw_retrieval_heatmaps(grids, title), path)


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
    xticks: tuple[list[float], list[str]] | None = None,
) -> str:
    """Line plots; ``symlog_threshold``: a symmetric log y axis, linear within +/- it (shows
    negative values, e.g. a differential map's signed weights; the axis stops at the data, so
    no empty negative half is drawn); ``xticks``: ``(positions, labels)``."""
    return save(
        draw_lines(
            series,
            xlabel=xlabel,
            ylabel=ylabel,
            title=title,
            logx=logx,
            logy=logy,
            symlog_threshold=symlog_threshold,
            styles=styles,
            xticks=xticks,
        ),
        path,
    )


def draw_lines(
    series: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    symlog_threshold: float | None = None,
    styles: dict[str, str] | None = None,
    xticks: tuple[list[float], list[str]] | None = None,
):
    """The figure (not saved) of :func:`lines` (legend outside the axes, so it hides no line)."""
    fig, (ax,) = figure(7.5, 4)
    for label, (x, y) in series.items():
        ax.plot(x, y, (styles or {}).get(label, "-o"), ms=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if symlog_threshold is not None:
        ax.set_yscale("symlog", linthresh=symlog_threshold)
        symlog_limits(ax, [y for _, y in series.values()], symlog_threshold)
    elif logy:
        ax.set_yscale("log")
        plain_log_y(ax)
    if xticks is not None:
        from matplotlib.ticker import NullLocator

        ax.set_xticks(xticks[0], xticks[1])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(fontsize=8, loc="outside right upper")
    return fig


def plain_log_y(ax) -> None:
    """Plain labels at 1, 2, 5 x 10^k on a log y axis (not "4 x 10^0" on a few minor ticks)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def symlog_limits(ax, ys, linthresh: float) -> None:
    """y limits of a symlog axis from the data: no negative range without negative values, a
    little headroom above the largest."""
    y = np.concatenate([np.ravel(np.asarray(v, float)) for v in ys]) if ys else np.zeros(0)
    y = y[np.isfinite(y)]
    if y.size == 0:
        return
    lo, hi = float(y.min()), float(y.max())
    bottom = 0.0 if lo >= 0 else lo * 2.0 if lo < -linthresh else -linthresh
    top = hi * 2.0 if hi > linthresh else linthresh
    ax.set_ylim(bottom, top)


def draw_allocation_bars(alloc: dict[str, tuple[list[float], np.ndarray]], categories, title: str):
    """The figure (not saved) of :func:`allocation_bars`: the panels share one y axis (a model's bars are
    compared with the other's at the same scale), one legend for all panels outside them, "no
    queries" on a depth bin without any (its shares are NaN), and a note under the figure
    where a panel's shares do not sum to 1 (signed shares of a differential map)."""
    fig, axes = figure(4.2 * len(alloc) + 1.6, 3.8, len(alloc), sharey=True)
    lows, highs, notes = [0.0], [1.0], []
    for ax, (label, (depths, shares)) in zip(axes, alloc.items()):
        raw = np.asarray(shares, float)
        empty = np.isnan(raw).all(axis=1)
        shares = np.nan_to_num(raw)
        x = np.arange(len(depths))
        pos = np.zeros(len(depths))
        neg = np.zeros(len(depths))
        for c, name in enumerate(categories):
            v = shares[:, c]
            base = np.where(v >= 0, pos, neg)
            ax.bar(x, v, bottom=base, label=name, color=f"C{c}")
            pos, neg = pos + np.maximum(v, 0), neg + np.minimum(v, 0)
        lows.append(float(neg.min(initial=0.0)))
        highs.append(float(pos.max(initial=0.0)))
        for j in np.flatnonzero(empty):
            ax.text(
                j, 0.5, "no queries", rotation=90, ha="center", va="center", color="0.4", fontsize=8
            )
        ax.set_xticks(x, [f"{d:.0%}" for d in depths])
        ax.set_xlabel("depth of the asked needle")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(label)
        totals = shares[~empty].sum(axis=1)
        if totals.size and (np.any(np.abs(totals - 1.0) > 0.01) or np.any(shares < 0)):
            notes.append(
                f"{label}: the bars sum to {totals.mean():.2f}, not 1: the differential map "
                f"A1 − λA2 has negative entries and its shares are signed (a category's net "
                f"weight over the row's absolute mass), so negative weight cancels part of each "
                f"bar"
                + (" and a net negative category is drawn below 0." if neg.min() < 0 else ".")
            )
    axes[0].set_ylabel("share of attention")
    axes[0].set_ylim(min(lows) * 1.1 - 0.02, max(highs) * 1.05)
    if any(np.isnan(np.asarray(sh, float)).all(axis=1).any() for _, sh in alloc.values()):
        notes.append("no queries: no asked needle fell in that depth bin.")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside right upper", title="keys")
    _note(fig, notes)
    fig.suptitle(title)
    return fig


def allocation_bars(
    alloc: dict[str, tuple[list[float], np.ndarray]], categories, path: str, title: str
) -> str:
    """Per model: stacked shares of each category by depth (see
    :func:`draw_allocation_bars`)."""
    return save(draw_allocation_bars(alloc, categories, title), path)
