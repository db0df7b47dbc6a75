"""The comparison report: ``report.md`` (per metric the mean +/- standard deviation over seeds,
the paired difference DIFF - twin with its 95% t-interval, the side-by-side throughput) and
``loss.png`` (validation and training curves against tokens: every seed thin, the mean over
seeds thick) in the run directory.

The plot is drawn on an explicit :class:`matplotlib.figure.Figure` with the Agg canvas: the
library never calls ``matplotlib.use`` or pyplot, so a notebook's backend is left alone.
"""

from __future__ import annotations

import math
import os
import platform
from typing import Callable, Sequence

import jax
import numpy as np

from .config import ExperimentConfig
from .loop import TrainResult
from .metrics import read_metrics
from .stats import clopper_pearson, describe_difference, mean_std, paired_difference


def _fmt(x, spec="{:.4f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return spec.format(x)


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:,.1f} MiB"


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


# (row name, value of a result, number format, shown only when some result has it)
METRICS: tuple[tuple[str, Callable[[TrainResult], float | None], str, bool], ...] = (
    ("final validation loss", lambda r: r.final_val_loss, "{:.4f}", False),
    ("final train loss", lambda r: r.final_train_loss, "{:.4f}", False),
    ("answer accuracy (validation, examples)", lambda r: r.val_accuracy, "{:.3f}", True),
    ("answer accuracy (validation, queries)", lambda r: r.val_query_accuracy, "{:.3f}", True),
    ("first query (needs retrieval)", lambda r: r.val_first_query_accuracy, "{:.3f}", True),
    ("repeated queries (copyable)", lambda r: r.val_repeat_query_accuracy, "{:.3f}", True),
    ("tokens/s (during training)", lambda r: _nan_to_none(r.tokens_per_s), "{:,.0f}", False),
    (
        "step time (ms, during training)",
        lambda r: _nan_to_none(r.step_time_s * 1e3 if r.step_time_s is not None else None),
        "{:.1f}",
        False,
    ),
)


def by_label(results: Sequence[TrainResult]) -> dict[str, list[TrainResult]]:
    """``{label: [result of each seed, in seed order]}`` in the order the labels first appear."""
    out: dict[str, list[TrainResult]] = {}
    for r in results:
        out.setdefault(r.label, []).append(r)
    return {k: sorted(v, key=lambda r: r.seed) for k, v in out.items()}


def _paired(groups, get):
    """The DIFF and twin values of the seeds both have, in seed order."""
    d = {r.seed: get(r) for r in groups["diff"]}
    s = {r.seed: get(r) for r in groups["standard"]}
    seeds = sorted(set(d) & set(s))
    return [d[x] for x in seeds], [s[x] for x in seeds]


def _mean_std_text(values, spec) -> str:
    mean, std, n = mean_std(values)
    if n == 0:
        return "n/a"
    return spec.format(mean) + (f" ± {spec.format(std)}" if std is not None else "")


def _metric_rows(results):
    return [
        (name, get, spec)
        for name, get, spec, optional in METRICS
        if not optional or any(get(r) is not None for r in results)
    ]


def results_table(results: Sequence[TrainResult]) -> str:
    """A markdown table, one column per model (mean ± standard deviation over its seeds), and
    with a DIFF model and its twin a column of the paired difference and its 95% interval."""
    groups = by_label(results)
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
    for name, get, spec in _metric_rows(results):
        cells = [_mean_std_text([get(r) for r in rs], spec) for rs in groups.values()]
        if paired and "during training" in name:
            cells.append("one after the other: see the side-by-side throughput")
        elif paired:
            d = paired_difference(*_paired(groups, get))
            sd = spec.replace("{:", "{:+")
            if d.n == 0:
                cells.append("n/a")
            elif d.low is None:
                cells.append(f"{sd.format(d.mean)} (one seed: no interval)")
            else:
                cells.append(f"{sd.format(d.mean)} [{sd.format(d.low)}, {sd.format(d.high)}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed_table(results: Sequence[TrainResult]) -> str:
    """Final validation loss and answer accuracy of every model and seed: the query accuracy
    where the task has queries (an example of 16 queries is rarely right as a whole, so the
    example accuracy would read near 0 for every model), else the example accuracy."""
    groups = by_label(results)
    seeds = sorted({r.seed for r in results})
    queries = any(r.val_query_accuracy is not None for r in results)
    acc = queries or any(r.val_accuracy is not None for r in results)
    name = "query accuracy" if queries else "accuracy"

    def accuracy(r: TrainResult | None):
        return None if r is None else (r.val_query_accuracy if queries else r.val_accuracy)

    first = any(r.val_first_query_accuracy is not None for r in results)
    cols = [f"{label} val loss" for label in groups] + (
        [f"{label} {name}" for label in groups] if acc else []
    )
    cols += [f"{label} first query" for label in groups] if first else []
    lines = ["| seed | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
    for s in seeds:
        get = {label: next((r for r in rs if r.seed == s), None) for label, rs in groups.items()}
        cells = [_fmt(get[x].final_val_loss if get[x] else None) for x in groups]
        if acc:
            cells += [_fmt(accuracy(get[x]), "{:.3f}") for x in groups]
        if first:
            cells += [
                _fmt(get[x].val_first_query_accuracy if get[x] else None, "{:.3f}") for x in groups
            ]
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


def plot_losses(run_dir: str, results: Sequence[TrainResult], path: str) -> None:
    """``loss.png``: validation loss and smoothed training loss against tokens; every seed thin,
    the mean over seeds thick, one colour per model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_val, ax_train = fig.subplots(1, 2)
    for i, (label, rs) in enumerate(by_label(results).items()):
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
        ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def comparison_sentences(results: Sequence[TrainResult]) -> list[str]:
    """Per metric, DIFF minus the twin in words: the mean, the 95% t-interval over the paired
    seeds and whether it excludes zero (or that one seed gives no interval)."""
    groups = by_label(results)
    if not ("diff" in groups and "standard" in groups):
        return []
    out = []
    for name, get, spec in _metric_rows(results):
        if "during training" in name:
            continue  # timing: see the side-by-side measurement
        d = paired_difference(*_paired(groups, get))
        out.append(
            "- "
            + describe_difference(
                d, name[0].upper() + name[1:], "DIFF", "the twin", spec.replace("{:", "{:+")
            )
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
    first = no_retrieval_first is not None and any(
        r.val_first_query_accuracy is not None for r in results
    )
    level = no_retrieval_first if first else no_retrieval
    bar = (level + 1.0) / 2.0
    out = []
    for label, rs in by_label(results).items():
        accs = [r.val_first_query_accuracy if first else r.val_query_accuracy for r in rs]
        accs = [a for a in accs if a is not None]
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


def write_report(
    run_dir: str,
    exp: ExperimentConfig,
    results: Sequence[TrainResult],
    data_description: str = "",
    throughput=None,
) -> str:
    """Write ``report.md`` and ``loss.png``; return the markdown. ``throughput`` is a
    :class:`diffjax.train.throughput.SideBySide` (or None)."""
    plot_losses(run_dir, results, os.path.join(run_dir, "loss.png"))
    m, t, d = exp.model, exp.train, exp.data
    groups = by_label(results)
    n_seeds = max((len(rs) for rs in groups.values()), default=0)
    lines = [
        f"# {exp.run.name}: "
        + " vs ".join(f"{label} ({rs[0].attention})" for label, rs in groups.items()),
        "",
        f"{n_seeds} seed{'s' * (n_seeds != 1)} per model; each cell is the mean ± the standard "
        f"deviation over seeds (a single value with one seed)"
        + (
            "; the last column is the paired difference DIFF − twin (seed by seed: the same init "
            "seed and the same batches) and its 95% Student-t interval."
            if len(groups) > 1
            else "."
        ),
        "",
        results_table(results),
        "",
    ]
    sentences = comparison_sentences(results)
    if sentences:
        lines += ["**DIFF against its twin:**", "", *sentences, ""]
    if d.source in ("needle", "mqar"):
        from diffjax.data.synthetic import query_chance

        chance = query_chance(d)
        lines += learned_counts(results, chance["no_retrieval"], chance["no_retrieval_first"])
    if throughput is not None:
        lines += [
            f"**Throughput, measured side by side:** {throughput.describe()}. The "
            f"tokens/s rows above are medians during each model's own training, one model "
            f"after the other, so whatever else ran on the machine then lands on one model "
            f"only; compare throughput by this side-by-side figure.",
            "",
        ]
    if "diff" in groups:
        lams = [r.lambdas for r in groups["diff"] if r.lambdas]
        if lams:
            mean = np.mean(np.array(lams, float), axis=0)
            lines += [
                f"DIFF lambda per layer at the end (mean over seeds): "
                f"{', '.join(f'{x:.3f}' for x in mean)}.",
                "",
            ]
    if n_seeds > 1:
        lines += ["Per seed:", "", per_seed_table(results), ""]
    lines += [
        "![validation and training loss](loss.png)",
        "",
        "## Setup",
        "",
        f"- model: `{m.attention}`, d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} "
        f"heads ({m.kv_heads} kv), head dim {m.resolved_head_dim}, dtype {m.dtype}, init std "
        + (
            f"{m.init_std:g} (both models)"
            if exp.twin_init_std is None
            else f"{m.init_std:g} (DIFF) and {exp.twin_init_std:g} (twin): **not one init scale** "
            f"(`twin_init_std`)"
        )
        + "; the twin: standard attention with the matching heads (`diffjax.twin`).",
        f"- data: {data_description or d.source}; sequence length {d.seq_len}; the same batches "
        f"in the same order for every model and seed (data seed {d.seed}).",
        f"- training: {t.steps} steps x {t.batch_size} sequences, AdamW lr {t.lr:g} "
        f"({t.schedule} decay, {t.warmup_steps} warmup, betas ({t.b1}, {t.b2}), weight decay "
        f"{t.weight_decay}, clip {t.grad_clip}); init seeds {', '.join(map(str, exp.seeds))} "
        f"(DIFF and its twin share each); runs in `<label>/seed_<seed>/`.",
        f"- final validation loss: over {t.eval_batches} fixed validation batches; final train "
        f"loss: mean of the last 5% of steps; "
        + (
            "answer accuracy: an example counts when all its answers are predicted exactly, a "
            "query when its answer is; "
            if any(r.val_accuracy is not None for r in results)
            else ""
        )
        + "tokens/s and step time "
        "during training: median over steps, excluding the first step after a (re)start and "
        "evaluation/checkpoint time.",
        f"- peak memory: {results[0].memory_source if results else ''}."
        + (
            "".join(
                f" Device allocator peak after {r.label} seed {r.seed}: "
                f"{_mib(r.device_peak_bytes)} (cumulative over the process)."
                for r in results
                if r.device_peak_bytes
            )
        ),
        f"- machine: {platform.node() or 'unknown'}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}."
        + (
            f"\n- mesh: {results[0].mesh}; parameters and optimizer state placed by the logical "
            f"axis rules of diffjax.sharding."
            if results and results[0].mesh
            else ""
        ),
        "",
    ]
    text = "\n".join(lines)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(text)
    return text
