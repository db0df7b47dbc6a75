"""The report's section on what happened inside the runs: DIFF's signals during training
(``train.diagnostics``: ``signals.png``, one panel per signal, both models, every seed) and
the steps skipped as spikes or rolled back after a NaN (``train.skip_spikes``,
``train.on_nan``). Read from each run's ``metrics.jsonl``; a run without them adds nothing."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from diffjax.infra import storage
from diffjax.evaluate.results import model_name
from diffjax.evaluate.stats import fmt_mean_std, group_by_label
from diffjax.train.recorder import TrainResult
from diffjax.train.metrics import read_metrics


def _largest(x) -> float:
    """The largest of a per-layer (or per-layer, per-map) value."""
    return float(np.max(np.asarray(x, float)))


def _mean(x) -> float:
    return float(np.mean(np.asarray(x, float)))


class Signal(NamedTuple):
    """One panel: the record key, how a step's value is read from it, its title, log scale."""

    key: str
    read: Callable[[object], float]
    title: str
    log: bool = False


SIGNALS = (
    Signal("logit_max", _largest, "largest attention logit (any layer, any map)"),
    Signal("activation_max", _largest, "largest hidden activation |x| (any layer)"),
    Signal("output_logit_max", float, "largest output logit |z|"),
    Signal("grad_norm", float, "gradient norm (global)", log=True),
    Signal("update_ratio", float, "update RMS / parameter RMS", log=True),
    Signal("lambda", _mean, "lambda (mean over layers)"),
    Signal("lambda_std", _mean, "spread of sigmoid(lambda) (V2, mean over layers)"),
)
FIGURE = "signals.png"


def _curves(results: Sequence[TrainResult]) -> dict[str, dict[str, list]]:
    """``{signal key: {label: [(steps, values) per seed]}}`` for the signals the records hold
    (a skipped step's values are left out: its loss may be NaN)."""
    out: dict[str, dict[str, list]] = {}
    for label, rs in group_by_label(results).items():
        for r in rs:
            records = read_metrics(storage.join(r.directory, "metrics.jsonl"))
            records = [x for x in records if not x.get("skipped")]
            for s in SIGNALS:
                have = [x for x in records if x.get(s.key) not in (None, [])]
                if have and any("logit_max" in x for x in records):  # a diagnostics run
                    steps = np.array([x["step"] for x in have], float)
                    values = np.array([s.read(x[s.key]) for x in have], float)
                    out.setdefault(s.key, {}).setdefault(label, []).append((steps, values))
    return out


def signals_figure(results: Sequence[TrainResult]) -> Figure | None:
    """One panel per signal the runs logged, one colour per model, one line per seed; None
    when no run logged diagnostics."""
    curves = _curves(results)
    if not curves:
        return None
    shown = [s for s in SIGNALS if s.key in curves]
    cols = 3
    rows = -(-len(shown) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    labels = list(group_by_label(results))
    for ax, s in zip(axes, shown):
        for label, seeds in curves[s.key].items():
            color = f"C{labels.index(label)}"
            attention = next(r.attention for r in results if r.label == label)
            for i, (x, y) in enumerate(seeds):
                if s.log:  # e.g. no update at a step of learning rate 0
                    x, y = x[y > 0], y[y > 0]
                ax.plot(
                    x,
                    y,
                    color=color,
                    lw=1.0,
                    alpha=0.8,
                    label=f"{label} ({attention})" if i == 0 else None,
                )
        ax.set_title(s.title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if s.log:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.legend(fontsize=7)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def signals_table(results: Sequence[TrainResult]) -> str | None:
    """Per signal and model: the largest value over the run and the last one (mean ± standard
    deviation over seeds); None when no run logged diagnostics."""
    curves = _curves(results)
    if not curves:
        return None
    labels = list(group_by_label(results))
    head = " | ".join(f"{label}: largest | {label}: last" for label in labels)
    lines = [f"| signal | {head} |", "|---|" + "---:|" * (2 * len(labels))]
    for s in SIGNALS:
        if s.key not in curves:
            continue
        cells = []
        for label in labels:
            seeds = curves[s.key].get(label, [])
            cells.append(fmt_mean_std([float(np.max(y)) for _, y in seeds], "{:.4g}"))
            cells.append(fmt_mean_std([float(y[-1]) for _, y in seeds], "{:.4g}"))
        lines.append(f"| {s.title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stability_table(results: Sequence[TrainResult]) -> str | None:
    """Per model and seed: the updates skipped as spikes and the rollbacks after a NaN; None
    when no run skipped spikes or rolled back."""
    watched = [r for r in results if r.spikes_skipped is not None or r.rollbacks]
    if not watched:
        return None
    lines = ["| model | seed | updates skipped (spikes) | rollbacks (non-finite loss) |"]
    lines.append("|---|---:|---:|---:|")
    for r in watched:
        skipped = "off" if r.spikes_skipped is None else f"{r.spikes_skipped}"
        lines.append(f"| {model_name(r.label, [r])} | {r.seed} | {skipped} | {r.rollbacks} |")
    return "\n".join(lines)


def section(run_dir: str, results: Sequence[TrainResult]) -> list[str]:
    """The report's lines on the runs' signals and stability (writing ``signals.png`` into
    ``run_dir`` when there are signals); ``[]`` when the runs logged neither."""
    lines: list[str] = []
    fig = signals_figure(results)
    if fig is not None:
        storage.save_figure(fig, storage.join(run_dir, FIGURE), dpi=100)
        lines += [
            "Signals during training (`train.diagnostics`; each layer's values in "
            "`metrics.jsonl` and TensorBoard), largest over the run and last, mean ± sd over "
            "seeds:",
            "",
            signals_table(results),
            "",
            f"![signals during training]({FIGURE})",
            "",
        ]
    table = stability_table(results)
    if table is not None:
        lines += ["Spikes and rollbacks:", "", table, ""]
    return lines
