"""The comparison report: ``report.md`` (per metric the mean +/- standard deviation over seeds,
the paired difference DIFF - twin with its 95% t-interval, the side-by-side throughput) and
``loss.png`` (validation and training curves against tokens: every seed thin, the mean over
seeds thick) in the run directory.

The rows are the losses, the validation metrics the run's data declared
(:func:`diffjax.data.validation_metrics`; whatever ``TrainResult.metrics`` holds, named by
:data:`METRIC_DISPLAY`) and the timing. ``report.md`` is one short function per section,
each returning its lines; :func:`write_report` joins them.

The plot is drawn on an explicit :class:`matplotlib.figure.Figure` with the Agg canvas: the
library never calls ``matplotlib.use`` or pyplot, so a notebook's backend is left alone.
"""

from __future__ import annotations

import math
import os
import platform
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from diffjax.data.synthetic import query_chance
from diffjax.evaluate.stats import (
    clopper_pearson,
    describe_difference,
    fmt_mean_std,
    group_by_label,
    paired_difference,
)
from diffjax.train.config import ExperimentConfig
from diffjax.train.loop import TrainResult
from diffjax.train.metrics import read_metrics

from .throughput import SideBySide

# How a validation metric of TrainResult.metrics (its metrics.jsonl key) is shown: row name and
# number format. A metric not listed here is shown under its key with DEFAULT_METRIC_FORMAT.
METRIC_DISPLAY: dict[str, tuple[str, str]] = {
    "val_answer_accuracy": ("answer accuracy (validation, examples)", "{:.3f}"),
    "val_query_accuracy": ("answer accuracy (validation, queries)", "{:.3f}"),
    "val_first_query_accuracy": ("first query (needs retrieval)", "{:.3f}"),
    "val_repeat_query_accuracy": ("repeated queries (copyable)", "{:.3f}"),
}
DEFAULT_METRIC_FORMAT = "{:.3f}"

# The per-seed table's columns after the validation loss: of each group, the first metric some
# result has, under its column name. A query task's example accuracy would read near 0 for
# every model (an example of 16 queries is rarely right as a whole), so its query accuracy
# comes first.
PER_SEED_COLUMNS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("val_query_accuracy", "query accuracy"), ("val_answer_accuracy", "accuracy")),
    (("val_first_query_accuracy", "first query"),),
)

# The seed count of a retrieval task (learned_counts): the query accuracy, and the first
# query's where the run has it (only the needles or pairs hold its answer).
QUERY_ACCURACY, FIRST_QUERY_ACCURACY = "val_query_accuracy", "val_first_query_accuracy"


class Row(NamedTuple):
    """One row of the results table: its name, a result's value and the number format; a
    ``timing`` row is measured during each model's own training (see the side-by-side figure)."""

    name: str
    get: Callable[[TrainResult], float | None]
    spec: str
    timing: bool = False


def _fmt(x, spec="{:.4f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return spec.format(x)


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:,.1f} MiB"


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


LOSS_ROWS = (
    Row("final validation loss", lambda r: r.final_val_loss, "{:.4f}"),
    Row("final train loss", lambda r: r.final_train_loss, "{:.4f}"),
)
TIMING_ROWS = (
    Row("tokens/s (during training)", lambda r: _nan_to_none(r.tokens_per_s), "{:,.0f}", True),
    Row(
        "step time (ms, during training)",
        lambda r: _nan_to_none(r.step_time_s * 1e3 if r.step_time_s is not None else None),
        "{:.1f}",
        True,
    ),
)


def metric_keys(results: Sequence[TrainResult]) -> list[str]:
    """The validation metrics some result has (keys of ``TrainResult.metrics``), in the order
    they first appear."""
    keys: dict[str, None] = {}
    for r in results:
        keys.update(dict.fromkeys(k for k, v in r.metrics.items() if v is not None))
    return list(keys)


def _metric_row(key: str) -> Row:
    name, spec = METRIC_DISPLAY.get(key, (key, DEFAULT_METRIC_FORMAT))
    return Row(name, lambda r: r.metrics.get(key), spec)


def metric_rows(results: Sequence[TrainResult]) -> list[Row]:
    """The losses, the validation metrics the results have and the timing."""
    return [*LOSS_ROWS, *(_metric_row(k) for k in metric_keys(results)), *TIMING_ROWS]


def _paired(groups, get):
    """The DIFF and twin values of the seeds both have, in seed order."""
    d = {r.seed: get(r) for r in groups["diff"]}
    s = {r.seed: get(r) for r in groups["standard"]}
    seeds = sorted(set(d) & set(s))
    return [d[x] for x in seeds], [s[x] for x in seeds]


def _difference_cell(groups, row: Row) -> str:
    if row.timing:
        return "one after the other: see the side-by-side throughput"
    d = paired_difference(*_paired(groups, row.get))
    sd = row.spec.replace("{:", "{:+")
    if d.n == 0:
        return "n/a"
    if d.no_spread:
        return f"{sd.format(d.mean)} (equal in all {d.n} seeds: no interval)"
    if d.low is None:
        return f"{sd.format(d.mean)} (one seed: no interval)"
    return f"{sd.format(d.mean)} [{sd.format(d.low)}, {sd.format(d.high)}]"


def results_table(results: Sequence[TrainResult]) -> str:
    """A markdown table, one column per model (mean ± standard deviation over its seeds), and
    with a DIFF model and its twin a column of the paired difference and its 95% interval."""
    groups = group_by_label(results)
    paired = "diff" in groups and "standard" in groups
    heads = [f"{label} ({rs[0].attention})" for label, rs in groups.items()]
    lines = [
        "| | " + " | ".join(heads) + (" | DIFF − twin [95% CI] |" if paired else " |"),
        "|---|" + "---:|" * (len(groups) + paired),
    ]
    fixed = [
        ("parameters", lambda rs: f"{rs[0].params:,}"),
        ("seeds", lambda rs: ", ".join(str(r.seed) for r in rs)),
        ("tokens seen (each)", lambda rs: f"{rs[0].tokens_seen:,}"),
        ("peak memory (XLA estimate)", lambda rs: _mib(rs[0].peak_memory_bytes)),
    ]
    for name, get in fixed:
        lines.append(
            f"| {name} | "
            + " | ".join(get(rs) for rs in groups.values())
            + (" | |" if paired else " |")
        )
    for row in metric_rows(results):
        cells = [fmt_mean_std([row.get(r) for r in rs], row.spec) for rs in groups.values()]
        if paired:
            cells.append(_difference_cell(groups, row))
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed_table(results: Sequence[TrainResult]) -> str:
    """Final validation loss of every model and seed, then the columns of
    :data:`PER_SEED_COLUMNS` the results have (e.g. the query accuracy where the task has
    queries, else the example accuracy, and the first query's)."""
    groups = group_by_label(results)
    seeds = sorted({r.seed for r in results})
    have = set(metric_keys(results))
    shown = [next((c for c in group if c[0] in have), None) for group in PER_SEED_COLUMNS]
    shown = [c for c in shown if c is not None]
    cols = [f"{label} val loss" for label in groups]
    for _, title in shown:
        cols += [f"{label} {title}" for label in groups]
    lines = ["| seed | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
    for s in seeds:
        get = {label: next((r for r in rs if r.seed == s), None) for label, rs in groups.items()}
        cells = [_fmt(get[x].final_val_loss if get[x] else None) for x in groups]
        for key, _ in shown:
            cells += [_fmt(get[x].metrics.get(key) if get[x] else None, "{:.3f}") for x in groups]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _common_mean(curves: list[tuple[np.ndarray, np.ndarray]]):
    """The mean over seeds at the x values every seed has."""
    common = set(curves[0][0].tolist())
    for x, _ in curves[1:]:
        common &= set(x.tolist())
    xs = np.array(sorted(common), float)
    if xs.size == 0:
        return xs, xs
    ys = [np.interp(xs, x, y) for x, y in curves]  # exact at shared x values
    return xs, np.mean(ys, axis=0)


def compact_count(x: float, _pos=None) -> str:
    """A token count as a short tick label: ``0``, ``950``, ``100k``, ``1.5M``, ``2B``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def loss_figure(run_dir: str, results: Sequence[TrainResult]) -> Figure:
    """The figure of ``loss.png`` (see :func:`plot_losses`), with the Agg canvas attached."""
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_val, ax_train = fig.subplots(1, 2)
    for i, (label, rs) in enumerate(group_by_label(results).items()):
        color = f"C{i}"
        val_curves, train_curves = [], []
        for r in rs:
            records = read_metrics(os.path.join(r.directory, "metrics.jsonl"))
            evals = [x for x in records if "val_loss" in x]
            if evals:
                val_curves.append(
                    (
                        np.array([x["tokens"] for x in evals], float),
                        np.array([x["val_loss"] for x in evals], float),
                    )
                )
            tokens = np.array([x["tokens"] for x in records], float)
            loss = np.array([x["loss"] for x in records], float)
            if loss.size:
                k = max(1, len(loss) // 50)
                smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
                train_curves.append((tokens[k - 1 :], smooth))
        for ax, curves in ((ax_val, val_curves), (ax_train, train_curves)):
            name = f"{label} ({rs[0].attention})"
            if len(curves) == 1:
                ax.plot(
                    *curves[0],
                    color=color,
                    lw=1.8,
                    label=name,
                    marker="o" if ax is ax_val else None,
                    ms=3,
                )
                continue
            for x, y in curves:
                ax.plot(x, y, color=color, lw=0.7, alpha=0.45)
            if curves:
                xs, mean = _common_mean(curves)
                ax.plot(
                    xs,
                    mean,
                    color=color,
                    lw=2.4,
                    label=f"{name}: mean of {len(curves)} seeds (thin: each seed)",
                )
    for ax, title in ((ax_val, "validation loss"), (ax_train, "training loss (smoothed)")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        # few ticks with short labels (120k, 1.5M): long token counts otherwise run together
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.xaxis.set_major_formatter(FuncFormatter(compact_count))
        ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    return fig


def plot_losses(run_dir: str, results: Sequence[TrainResult], path: str) -> None:
    """``loss.png``: validation loss and smoothed training loss against tokens; every seed thin,
    the mean over seeds thick, one colour per model."""
    loss_figure(run_dir, results).savefig(path, dpi=110)


def comparison_sentences(results: Sequence[TrainResult]) -> list[str]:
    """Per metric, DIFF minus the twin in words: the mean, the 95% t-interval over the paired
    seeds and whether it excludes zero (or that one seed gives no interval)."""
    groups = group_by_label(results)
    if not ("diff" in groups and "standard" in groups):
        return []
    out = []
    for row in metric_rows(results):
        if row.timing:
            continue  # timing: see the side-by-side measurement
        d = paired_difference(*_paired(groups, row.get))
        what = row.name[0].upper() + row.name[1:]
        out.append(
            "- " + describe_difference(d, what, "DIFF", "the twin", row.spec.replace("{:", "{:+"))
        )
    return out


def learned_counts(
    results: Sequence[TrainResult], no_retrieval: float, no_retrieval_first: float | None = None
) -> list[str]:
    """For a retrieval task: per model, the seeds whose final validation accuracy is above
    halfway from the no-retrieval level to 1 (a model either learns the key-value lookup or sits
    near that level, so this count says more than a mean), with a 95% Clopper-Pearson interval
    for the rate. The accuracy is the first query's where the results have it (with
    ``no_retrieval_first``): only the needles hold its answer, while a repeated query can be
    copied from the earlier one (:func:`diffjax.data.query_kinds`), so the all-query accuracy
    passes the bar without any retrieval from the needles. Empty when no result has a query
    accuracy."""
    first = no_retrieval_first is not None and FIRST_QUERY_ACCURACY in metric_keys(results)
    level = no_retrieval_first if first else no_retrieval
    key = FIRST_QUERY_ACCURACY if first else QUERY_ACCURACY
    bar = (level + 1.0) / 2.0
    out = []
    for label, rs in group_by_label(results).items():
        accs = [a for a in (r.metrics.get(key) for r in rs) if a is not None]
        if not accs:
            continue
        k, n = sum(a > bar for a in accs), len(accs)
        low, high = clopper_pearson(k, n)
        out.append(
            f"{label} {k} of {n} seed{'s' * (n != 1)} (95% Clopper-Pearson interval for "
            f"the rate: {low:.0%}-{high:.0%})"
        )
    if not out:
        return []
    what = (
        "final first-query accuracy (the query only the needles or pairs can answer; "
        "repeated queries can be copied from earlier ones)"
        if first
        else "final query accuracy"
    )
    return [
        f"**Seeds that learned the lookup** ({what} above {bar:.3f}, halfway from the "
        f"no-retrieval level {level:.3f} to 1): " + "; ".join(out) + ".",
        "",
    ]


# ---------------------------------------------------------------------------- report.md sections
def _title(exp: ExperimentConfig, groups: dict[str, list[TrainResult]]) -> list[str]:
    return [
        f"# {exp.run.name}: "
        + " vs ".join(f"{label} ({rs[0].attention})" for label, rs in groups.items()),
        "",
    ]


def _results(results: Sequence[TrainResult], groups, n_seeds: int) -> list[str]:
    paired = (
        "; the last column is the paired difference DIFF − twin (seed by seed: the same init "
        "seed and the same batches) and its 95% Student-t interval."
    )
    return [
        f"{n_seeds} seed{'s' * (n_seeds != 1)} per model; each cell is the mean ± the standard "
        f"deviation over seeds (a single value with one seed)"
        + (paired if len(groups) > 1 else "."),
        "",
        results_table(results),
        "",
    ]


def _comparison(results: Sequence[TrainResult]) -> list[str]:
    sentences = comparison_sentences(results)
    return ["**DIFF against its twin:**", "", *sentences, ""] if sentences else []


def _retrieval(exp: ExperimentConfig, results: Sequence[TrainResult]) -> list[str]:
    """The seed count of a run whose data declared a query accuracy (a retrieval task)."""
    if QUERY_ACCURACY not in metric_keys(results):
        return []
    chance = query_chance(exp.data)
    return learned_counts(results, chance["no_retrieval"], chance["no_retrieval_first"])


def _throughput(throughput: SideBySide | None) -> list[str]:
    if throughput is None:
        return []
    return [
        f"**Throughput, measured side by side:** {throughput.describe()}. The "
        f"tokens/s rows above are medians during each model's own training, one model "
        f"after the other, so whatever else ran on the machine then lands on one model "
        f"only; compare throughput by this side-by-side figure.",
        "",
    ]


def _lambdas(groups: dict[str, list[TrainResult]]) -> list[str]:
    lams = [r.lambdas for r in groups.get("diff", []) if r.lambdas]
    if not lams:
        return []
    mean = np.mean(np.array(lams, float), axis=0)
    return [
        f"DIFF lambda per layer at the end (mean over seeds): "
        f"{', '.join(f'{x:.3f}' for x in mean)}.",
        "",
    ]


def _per_seed(results: Sequence[TrainResult], n_seeds: int) -> list[str]:
    return ["Per seed:", "", per_seed_table(results), ""] if n_seeds > 1 else []


def _plot() -> list[str]:
    return ["![validation and training loss](loss.png)", ""]


def _setup_model(exp: ExperimentConfig) -> str:
    m = exp.model
    init = (
        f"{m.init_std:g} (both models)"
        if exp.twin_init_std is None
        else f"{m.init_std:g} (DIFF) and {exp.twin_init_std:g} (twin): **not one init scale** "
        f"(`twin_init_std`)"
    )
    return (
        f"- model: `{m.attention}`, d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} "
        f"heads ({m.kv_heads} kv), head dim {m.resolved_head_dim}, dtype {m.dtype}, init std "
        f"{init}; the twin: standard attention with the matching heads (`diffjax.twin`)."
    )


def _setup_training(exp: ExperimentConfig, data_description: str) -> list[str]:
    t, d = exp.train, exp.data
    return [
        f"- data: {data_description or d.source}; sequence length {d.seq_len}; the same batches "
        f"in the same order for every model and seed (data seed {d.seed}).",
        f"- training: {t.steps} steps x {t.batch_size} sequences, AdamW lr {t.lr:g} "
        f"({t.schedule} decay, {t.warmup_steps} warmup, betas ({t.b1}, {t.b2}), weight decay "
        f"{t.weight_decay}, clip {t.grad_clip}); init seeds {', '.join(map(str, exp.seeds))} "
        f"(DIFF and its twin share each); runs in `<label>/seed_<seed>/`.",
    ]


def _setup_measures(exp: ExperimentConfig, results: Sequence[TrainResult]) -> str:
    answers = "val_answer_accuracy" in metric_keys(results)
    return (
        f"- final validation loss: over {exp.train.eval_batches} fixed validation batches; final "
        f"train loss: mean of the last 5% of steps; "
        + (
            "answer accuracy: an example counts when all its answers are predicted exactly, a "
            "query when its answer is; "
            if answers
            else ""
        )
        + "tokens/s and step time during training: median over steps, excluding the first step "
        "after a (re)start and evaluation/checkpoint time."
    )


def _setup_machine(results: Sequence[TrainResult]) -> list[str]:
    peaks = "".join(
        f" Device allocator peak after {r.label} seed {r.seed}: "
        f"{_mib(r.device_peak_bytes)} (cumulative over the process)."
        for r in results
        if r.device_peak_bytes
    )
    machine = (
        f"- machine: {platform.node() or 'unknown'}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}."
    )
    if results and results[0].mesh:
        machine += (
            f"\n- mesh: {results[0].mesh}; parameters and optimizer state placed by the logical "
            f"axis rules of diffjax.sharding."
        )
    return [f"- peak memory: {results[0].memory_source if results else ''}." + peaks, machine]


def _setup(exp: ExperimentConfig, results: Sequence[TrainResult], description: str) -> list[str]:
    return [
        "## Setup",
        "",
        _setup_model(exp),
        *_setup_training(exp, description),
        _setup_measures(exp, results),
        *_setup_machine(results),
        "",
    ]


def write_report(
    run_dir: str,
    exp: ExperimentConfig,
    results: Sequence[TrainResult],
    data_description: str = "",
    throughput: SideBySide | None = None,
) -> str:
    """Write ``report.md`` and ``loss.png``; return the markdown. ``throughput``: the
    side-by-side measurement (:func:`diffjax.compare.side_by_side_throughput`) or None."""
    plot_losses(run_dir, results, os.path.join(run_dir, "loss.png"))
    groups = group_by_label(results)
    n_seeds = max((len(rs) for rs in groups.values()), default=0)
    sections: list[list[str]] = [
        _title(exp, groups),
        _results(results, groups, n_seeds),
        _comparison(results),
        _retrieval(exp, results),
        _throughput(throughput),
        _lambdas(groups),
        _per_seed(results, n_seeds),
        _plot(),
        _setup(exp, results, data_description),
    ]
    text = "\n".join(line for section in sections for line in section)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(text)
    return text
