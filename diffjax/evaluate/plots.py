"""PNG plots with an explicit Figure and the Agg canvas (the caller's matplotlib backend and
pyplot state are never touched): three kinds of chart (:func:`retrieval_heatmaps`,
:func:`lines`, :func:`allocation_bars`), and one figure per section of ``eval.md``, drawn from
the run's results grouped by label (each returns the PNG's file name in ``run_dir``)."""

from __future__ import annotations

import os

import numpy as np

from .outliers import KS
from .results import diff_shares, get, model_name, seed_mean
from .retrieval import RetrievalGrid


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
                os.path.join(run_dir, out[s]),
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
        os.path.join(run_dir, name),
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
        path=os.path.join(run_dir, name),
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
        xlabel="logit bits (32 = float32)",
        ylabel="validation loss",
        title="quantized attention logits",
        path=os.path.join(run_dir, name),
        logx=True,
    )
    return name


def noise_floor_figure(run_dir: str, groups: dict, noise: dict, margin: float, lam: float) -> str:
    """The closed-form shares against the number of distractors, and the shares measured on
    the models' maps against their number of distractor positions."""
    ns = noise["num_distractors"]
    diff_signal, diff_distractors = diff_shares(noise)
    series = {
        "softmax: signal": (ns, noise["softmax_signal"]),
        "softmax: distractors": (ns, noise["softmax_distractors"]),
        "diff (normalised): signal": (ns, diff_signal),
        "diff (normalised): distractors": (ns, diff_distractors),
    }
    for lab, rs in groups.items():
        pts = [m for r in rs for m in r.get("noise_measured", [])]
        if pts:
            x = np.asarray([m["num_distractors"] for m in pts])
            series[f"{lab} measured: signal"] = (x, np.asarray([m["signal_share"] for m in pts]))
            series[f"{lab} measured: distractors"] = (
                x,
                np.asarray([m["distractor_share"] for m in pts]),
            )
    styles = {
        k: ("x" if k.endswith("measured: signal") else "+" if "measured" in k else "-")
        for k in series
    }
    name = "eval_noise_floor.png"
    lines(
        series,
        xlabel="distractors N (measured: distractor positions)",
        ylabel="share of the row's absolute attention",
        title=f"noise floor (margin {margin:g}, λ={lam})",
        path=os.path.join(run_dir, name),
        logx=True,
        symlog_threshold=1e-4,
        styles=styles,
    )
    return name


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
        path=os.path.join(run_dir, name),
    )
    return name
