"""PNG plots with an explicit Figure and the Agg canvas (the caller's matplotlib backend and
pyplot state are never touched): three kinds of chart (:func:`retrieval_heatmaps`,
:func:`lines`, :func:`allocation_bars`), and one figure per section of ``eval.md``, drawn from
the run's results grouped by label (each returns the PNG's file name in ``run_dir``). The
``draw_*`` functions return the unsaved figure (what the tests inspect: shared axes, tick
labels, the notes under a figure)."""

from __future__ import annotations

import textwrap

import numpy as np

from diffjax import storage

from .outliers import KS
from .results import diff_shares, get, model_name, seed_mean
from .retrieval import RetrievalGrid


def _figure(width: float, height: float, ncols: int = 1, sharey: bool = False):
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


def _save(fig, path: str) -> str:
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
    fig, axes = _figure(4.2 * len(grids), 3.4, len(grids))
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
    return _save(draw_retrieval_heatmaps(grids, title), path)


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
    return _save(
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
    fig, (ax,) = _figure(7.5, 4)
    for label, (x, y) in series.items():
        ax.plot(x, y, (styles or {}).get(label, "-o"), ms=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if symlog_threshold is not None:
        ax.set_yscale("symlog", linthresh=symlog_threshold)
        _symlog_limits(ax, [y for _, y in series.values()], symlog_threshold)
    elif logy:
        ax.set_yscale("log")
        _plain_log_y(ax)
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


def _plain_log_y(ax) -> None:
    """Plain labels at 1, 2, 5 x 10^k on a log y axis (not "4 x 10^0" on a few minor ticks)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _symlog_limits(ax, ys, linthresh: float) -> None:
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
    fig, axes = _figure(4.2 * len(alloc) + 1.6, 3.8, len(alloc), sharey=True)
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
    return _save(draw_allocation_bars(alloc, categories, title), path)


# ---------------------------------------------------------------------------- eval.md's figures
def retrieval_figures(run_dir: str, groups: dict, settings_nr: list[str]) -> dict[str, str]:
    """Per needle setting ``"N,R"``: accuracy heatmaps by context length and depth, mean over
    seeds, one panel per model. Returns ``{setting: file name}`` for the settings drawn."""
    out = {}
    for s in settings_nr:
        grids = {}
        for lab, rs in groups.items():
            gs = [r["retrieval"][s] for r in rs if s in r.get("retrieval", {})]
            if gs:
                acc = seed_mean(
                    [
                        RetrievalGrid(
                            g["lengths"],
                            g["depths"],
                            0,
                            0,
                            np.asarray(g["correct"]),
                            np.asarray(g["total"]),
                        ).accuracy
                        for g in gs
                    ]
                )
                grids[model_name(lab, rs)] = (gs[0]["lengths"], gs[0]["depths"], acc)
        if grids:
            n, r = s.split(",")
            out[s] = f"eval_retrieval_N{n}_R{r}.png"
            retrieval_heatmaps(
                grids,
                f"retrieval accuracy, N={n} needles, R={r} queried",
                storage.join(run_dir, out[s]),
            )
    return out


def allocation_figure(run_dir: str, groups: dict, depths, categories) -> str:
    """Stacked shares of each category by depth, mean over seeds, one panel per model."""
    bars = {}
    for lab, rs in groups.items():
        sh = [np.asarray(r["allocation"]["shares"], float) for r in rs if "allocation" in r]
        if sh:
            bars[model_name(lab, rs)] = (depths, seed_mean(sh))
    name = "eval_allocation.png"
    allocation_bars(
        bars,
        categories,
        storage.join(run_dir, name),
        "attention allocation of the answer-producing positions",
    )
    return name


def outliers_figure(run_dir: str, groups: dict) -> str:
    """Top-k magnitudes against k, mean over seeds."""
    ks = np.array(KS, float)
    series = {
        f"{lab}: {kind}": (
            ks,
            np.array([np.mean([get(r, "outliers", kind, f"top-{k}") for r in rs]) for k in KS]),
        )
        for kind in ("attention logits", "hidden states")
        for lab, rs in groups.items()
    }
    name = "eval_outliers.png"
    lines(
        series,
        xlabel="k (top-k magnitude)",
        ylabel="magnitude",
        logx=True,
        logy=True,
        title="activation outliers (mean over seeds)",
        path=storage.join(run_dir, name),
        xticks=(list(ks), [str(k) for k in KS]),
    )
    return name


def quantization_figure(run_dir: str, groups: dict, widths: list) -> str:
    """Validation loss against the logit bit width (32 = float32), mean over seeds."""
    xs = np.asarray([b or 32 for b in widths])
    series = {
        model_name(lab, rs): (
            xs,
            np.asarray(
                [
                    seed_mean([get(r, "quantization", i, "val_loss") for r in rs])
                    for i in range(len(widths))
                ]
            ),
        )
        for lab, rs in groups.items()
    }
    name = "eval_quantization.png"
    lines(
        series,
        xlabel="logit bits",
        ylabel="validation loss",
        title="quantized attention logits",
        path=storage.join(run_dir, name),
        logx=True,
        xticks=(list(xs), ["float32" if b is None else str(b) for b in widths]),
    )
    return name


def noise_floor_figure(run_dir: str, groups: dict, noise: dict, margin: float, lam: float) -> str:
    """The closed-form shares against the number of distractors, and the shares measured on
    the models' maps against their number of distractor positions (see
    :func:`draw_noise_floor`)."""
    name = "eval_noise_floor.png"
    _save(draw_noise_floor(groups, noise, margin, lam), storage.join(run_dir, name))
    return name


def draw_noise_floor(groups: dict, noise: dict, margin: float, lam: float):
    """Left: the closed form (softmax solid, differential dashed; signal and distractors in
    two colours) on a log axis with headroom above 1, so the distractor lines near 1 stay in
    view. Right, when the models were measured: each seed's signal and distractor shares (and
    their mean over seeds, joined across contexts) against the distractor positions, on their
    own axes; a log axis, or a symmetric log one bounded by the data when a share is negative."""
    measured = {
        lab: [m for r in rs for m in r.get("noise_measured", [])] for lab, rs in groups.items()
    }
    measured = {k: v for k, v in measured.items() if v}
    fig, axes = _figure(11.5 if measured else 6.5, 4.2, 2 if measured else 1)
    ax = axes[0]
    ns = np.asarray(noise["num_distractors"], float)
    diff_signal, diff_distractors = diff_shares(noise)
    for y, style, color, label in (
        (noise["softmax_signal"], "-", "C0", "softmax: signal"),
        (noise["softmax_distractors"], "-", "C1", "softmax: distractors"),
        (diff_signal, "--", "C0", "differential: signal"),
        (diff_distractors, "--", "C1", "differential: distractors"),
    ):
        ax.plot(ns, np.asarray(y, float), style, color=color, lw=1.8, label=label)
    ax.set_xscale("log", base=2)
    curves = np.concatenate([noise["softmax_signal"], diff_signal, diff_distractors])
    if np.all(np.asarray(curves) > 0):
        ax.set_yscale("log")
        ax.set_ylim(float(np.min(curves)) / 2, 2.0)
    else:
        ax.set_yscale("symlog", linthresh=1e-3)
        _symlog_limits(ax, [curves, noise["softmax_distractors"]], 1e-3)
    ax.set_xlabel("distractors N")
    ax.set_ylabel("share of the row's absolute attention")
    ax.set_title(f"closed form: margin {margin:g}, λ = {lam}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    if measured:
        _measured_noise_panel(axes[1], measured)
    return fig


def _measured_noise_panel(ax, measured: dict[str, list[dict]]) -> None:
    from matplotlib.ticker import NullLocator

    values, counts = [], set()
    for i, (lab, pts) in enumerate(measured.items()):
        x = np.asarray([m["num_distractors"] for m in pts], float)
        counts |= set(x.tolist())
        shift = 1.06**i  # the models side by side at each context, not on top of each other
        for key, marker, what in (
            ("signal_share", "x", "signal"),
            ("distractor_share", "+", "distractors"),
        ):
            y = np.asarray([m[key] for m in pts], float)
            values.append(y)
            ax.plot(x * shift, y, marker, color=f"C{i + 2}", ms=6, alpha=0.6)
            xs = np.array(sorted(set(x.tolist())))
            mean = np.array([np.nanmean(y[x == v]) for v in xs])
            ax.plot(
                xs * shift,
                mean,
                "-" if what == "signal" else ":",
                marker=marker,
                color=f"C{i + 2}",
                label=f"{lab}: {what} (line: mean over seeds)",
            )
    ax.set_xscale("log", base=2)
    ticks = sorted(counts)
    ax.set_xticks(ticks, [f"{v:.0f}" for v in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    lo, hi = min(ticks), max(ticks) * 1.06 ** (len(measured) - 1)
    ax.set_xlim(lo / 1.5, hi * 1.5)
    y = np.concatenate(values)
    y = y[np.isfinite(y)]
    if y.size and np.all(y > 0):
        ax.set_yscale("log")
        _plain_log_y(ax)
        ax.set_ylim(float(y.min()) / 2, min(2.0, float(y.max()) * 2))
    elif y.size:
        small = np.abs(y[y != 0])
        thresh = float(10 ** np.floor(np.log10(small.min()))) if small.size else 1e-3
        ax.set_yscale("symlog", linthresh=thresh)
        _symlog_limits(ax, [y], thresh)
        ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("distractor positions (other needles + haystack; models side by side)")
    ax.set_ylabel("share of the row's absolute attention")
    ax.set_title("measured on the models' maps (each seed; x: signal, +: distractors)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def loss_by_position_figure(run_dir: str, groups: dict, positions: dict) -> str:
    """Loss by position bucket, mean over seeds; ``positions``: one model's ``positions``
    result (the bucket ends and the lengths)."""
    series = {}
    for lab, rs in groups.items():
        ps = [np.asarray(r["positions"]["loss"]) for r in rs if "positions" in r]
        if ps:
            series[model_name(lab, rs)] = (np.asarray(positions["ends"]), seed_mean(ps))
    name = "eval_loss_by_position.png"
    lines(
        series,
        xlabel="position (bucket end)",
        ylabel="loss (nats/token)",
        title=f"loss by position at context {positions['length']} "
        f"(trained at {positions['trained_length']})",
        path=storage.join(run_dir, name),
    )
    return name
