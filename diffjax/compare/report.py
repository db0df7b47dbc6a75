"""The comparison report: ``report.md`` (per metric the mean +/- standard deviation over seeds,
the paired difference DIFF - twin with its 95% t-interval, the side-by-side throughput, with
model TFLOP/s per device and MFU from :mod:`diffjax.infra.flops`, DIFF − twin over training with its
crossover from :mod:`diffjax.compare.curves`) and ``loss.png`` (validation and training curves
against tokens: every seed thin, the mean over seeds thick; with DIFF and its twin, a third panel
of the paired difference and its band) in the run directory.

The rows are the losses, the validation metrics the run's data declared
(:func:`diffjax.data.validation_metrics`; whatever ``TrainResult.metrics`` holds, named by
:data:`METRIC_DISPLAY`) and the timing. ``report.md`` is one short function per section,
each returning its lines; :func:`write_report` joins them.

The plot is drawn on an explicit :class:`matplotlib.figure.Figure` with the Agg canvas: the
library never calls ``matplotlib.use`` or pyplot, so a notebook's backend is left alone.
"""

from __future__ import annotations

import math
import platform
import re
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from diffjax.infra import flops as flops_lib
from diffjax.infra import machine as machine_lib
from diffjax.infra import storage
from diffjax.config import ModelConfig
from diffjax.data.mixture import stage_words
from diffjax.data.synthetic import query_chance
from diffjax.evaluate.results import kind_entry, model_name
from diffjax.evaluate.stats import (
    clopper_pearson,
    describe_difference,
    difference_cell,
    fmt_mean_std,
    group_by_label,
    minus,
    paired_by_seed,
    paired_difference,
    twin_name,
    twins_of,
)
from diffjax.nn.param_count import count_params
from diffjax.train.recorder import TrainResult
from diffjax.train.metrics import read_metrics

from diffjax.compare import signals
from diffjax.compare.config import Comparison
from diffjax.compare.curves import (
    DifferenceCurve,
    crossover,
    describe_crossover,
    describe_final,
    difference_table,
    eval_curve,
    paired_curve,
)
from diffjax.compare.plots import draw_difference, draw_seed_curves, token_axis
from diffjax.compare.throughput import SideBySide

# How a validation metric of TrainResult.metrics (its metrics.jsonl key) is shown: row name and
# number format. A metric not listed here is shown under its key with DEFAULT_METRIC_FORMAT.
METRIC_DISPLAY: dict[str, tuple[str, str]] = {
    "val_answer_accuracy": ("answer accuracy (validation, examples)", "{:.3f}"),
    "val_query_accuracy": ("answer accuracy (validation, queries)", "{:.3f}"),
    "val_first_query_accuracy": ("first query (needs retrieval)", "{:.3f}"),
    "val_repeat_query_accuracy": ("repeated queries (copyable)", "{:.3f}"),
}
DEFAULT_METRIC_FORMAT = "{:.3f}"
COMPONENT_LOSS = "val_loss/"  # a mixture's validation loss of one component: val_loss/<name>

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


class Flops(NamedTuple):
    """What the TFLOP/s and MFU figures need: each model's config (by label), the sequence
    length, the device kind and its peak dense bf16 TFLOP/s (None: unknown, no MFU)."""

    models: dict[str, ModelConfig]
    seq_len: int
    device_kind: str
    peak: float | None

    @classmethod
    def of(cls, exp: Comparison, device_kind: str | None = None) -> "Flops":
        """For ``exp`` on this machine's devices (or ``device_kind``); the peak from
        ``train.peak_tflops`` or :data:`diffjax.infra.flops.PEAK_TFLOPS`."""
        kind = jax.devices()[0].device_kind if device_kind is None else device_kind
        peak = flops_lib.peak_tflops(kind, exp.train.peak_tflops)
        return cls(dict(exp.models), exp.data.seq_len, kind, peak)

    def per_token(self, label: str) -> float | None:
        """Model FLOPs per trained token of the model ``label`` (the formula)."""
        cfg = self.models.get(label)
        return None if cfg is None else flops_lib.train_flops_per_token(cfg, self.seq_len)

    def tflops(self, label: str, tokens_per_s: float | None, devices: int) -> float | None:
        """Model TFLOP/s per device at ``tokens_per_s`` (over ``devices`` devices)."""
        cfg = self.models.get(label)
        if cfg is None:
            return None
        return flops_lib.tflops_per_device(cfg, self.seq_len, tokens_per_s, devices)

    def mfu(self, label: str, tokens_per_s: float | None, devices: int) -> float | None:
        return flops_lib.mfu(self.tflops(label, tokens_per_s, devices), self.peak)

    def note(self) -> str:
        """One sentence: what the TFLOP/s are, and the peak of the MFU or why there is none."""
        text = (
            "TFLOP/s per device: model FLOPs (`diffjax.infra.flops.train_flops_per_token`: the "
            "forward's matmuls x3 for forward and backward, causal attention maps halved, "
            "rematerialization not counted) x tokens/s / devices; "
        )
        if self.peak is None:
            return text + f"MFU: no peak for {self.device_kind}; set train.peak_tflops."
        return (
            text + f"MFU against {self.peak:g} TFLOP/s per device (dense bf16, {self.device_kind})."
        )


def _flop_count(x: float | None) -> str:
    """``5.704 MFLOP``, ``1.25 GFLOP``: four significant digits."""
    if x is None:
        return "n/a"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.4g} {prefix}FLOP"
    return f"{x:.4g} FLOP"


def _devices(result: TrainResult) -> int:
    """The devices a result trained on: its mesh's count, else this process's."""
    found = re.search(r"\((\d+) devices?", result.mesh or "")
    return int(found.group(1)) if found else jax.device_count()


def flops_rows(f: Flops) -> tuple[Row, ...]:
    """The timing rows of TFLOP/s per device and (with a peak) MFU during training."""
    rows = [
        Row(
            "TFLOP/s per device (during training)",
            lambda r: f.tflops(r.label, _nan_to_none(r.tokens_per_s), _devices(r)),
            "{:.3g}",
            True,
        )
    ]
    if f.peak is not None:
        rows.append(
            Row(
                "MFU (during training)",
                lambda r: f.mfu(r.label, _nan_to_none(r.tokens_per_s), _devices(r)),
                "{:.1%}",
                True,
            )
        )
    return tuple(rows)


def metric_keys(results: Sequence[TrainResult]) -> list[str]:
    """The validation metrics some result has (keys of ``TrainResult.metrics``), in the order
    they first appear."""
    keys: dict[str, None] = {}
    for r in results:
        keys.update(dict.fromkeys(k for k, v in r.metrics.items() if v is not None))
    return list(keys)


def _metric_row(key: str) -> Row:
    name, spec = METRIC_DISPLAY.get(key, (key, DEFAULT_METRIC_FORMAT))
    if key.startswith(COMPONENT_LOSS):  # a mixture's component
        name, spec = f"validation loss: {key[len(COMPONENT_LOSS) :]}", "{:.4f}"
    return Row(name, lambda r: r.metrics.get(key), spec)


def metric_rows(results: Sequence[TrainResult], flops: Flops | None = None) -> list[Row]:
    """The losses, the validation metrics the results have and the timing (with ``flops``,
    TFLOP/s per device and MFU too)."""
    timing = (*TIMING_ROWS, *(flops_rows(flops) if flops is not None else ()))
    return [*LOSS_ROWS, *(_metric_row(k) for k in metric_keys(results)), *timing]


def _difference_cell(groups, row: Row, twin: str = "standard") -> str:
    if row.timing:
        return "one after the other: see the side-by-side throughput"
    d = paired_difference(*paired_by_seed(groups, row.get, b=twin))
    return difference_cell(d, row.spec.replace("{:", "{:+"))


def results_table(results: Sequence[TrainResult], flops: Flops | None = None) -> str:
    """A markdown table, one column per model (mean ± standard deviation over its seeds), and
    with a DIFF model a column per twin of the paired difference and its 95% interval.
    With ``flops`` (:meth:`Flops.of`), the model FLOPs per token and the TFLOP/s per device
    and MFU during training too."""
    groups = group_by_label(results)
    twins = twins_of(groups)
    heads = [model_name(label, rs) for label, rs in groups.items()]
    heads += [f"{minus(t)} [95% CI]" for t in twins]
    lines = ["| | " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(groups) + len(twins))]
    fixed = [
        ("parameters", lambda rs: f"{rs[0].params:,}"),
        ("seeds", lambda rs: ", ".join(str(r.seed) for r in rs)),
        ("tokens seen (each)", lambda rs: f"{rs[0].tokens_seen:,}"),
        ("peak memory (XLA estimate)", lambda rs: _mib(rs[0].peak_memory_bytes)),
    ]
    if flops is not None:
        fixed.append(
            (
                "model FLOPs per trained token",
                lambda rs: _flop_count(flops.per_token(rs[0].label)),
            )
        )
    for name, get in fixed:
        lines.append(
            f"| {name} | "
            + " | ".join(get(rs) for rs in groups.values())
            + " |" * len(twins)
            + " |"
        )
    for row in metric_rows(results, flops):
        cells = [fmt_mean_std([row.get(r) for r in rs], row.spec) for rs in groups.values()]
        cells += [_difference_cell(groups, row, t) for t in twins]
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


def difference_curve(
    results: Sequence[TrainResult], twin: str = "standard"
) -> DifferenceCurve | None:
    """DIFF − ``twin`` over training (:func:`diffjax.compare.curves.paired_difference_curve`)
    from the runs' ``metrics.jsonl``, over the seeds both models have; None without both models
    or without an evaluation common to every seed."""
    groups = group_by_label(results)
    if "diff" not in groups or twin not in groups:
        return None
    curves = {
        label: {
            r.seed: eval_curve(read_metrics(storage.join(r.directory, "metrics.jsonl")))
            for r in groups[label]
        }
        for label in ("diff", twin)
    }
    return paired_curve(curves["diff"], curves[twin])[1]


def loss_figure(run_dir: str, results: Sequence[TrainResult]) -> Figure:
    """The figure of ``loss.png`` (see :func:`plot_losses`), with the Agg canvas attached."""
    twins = twins_of(group_by_label(results))
    differences = {t: difference_curve(results, t) for t in twins}
    differences = {t: c for t, c in differences.items() if c is not None}
    fig = Figure(figsize=(11 + 5.5 * len(differences), 4))
    FigureCanvasAgg(fig)
    ax_val, ax_train, *ax_diff = fig.subplots(1, 2 + len(differences))
    for i, (label, rs) in enumerate(group_by_label(results).items()):
        color = f"C{i}"
        val_curves, train_curves = [], []
        for r in rs:
            records = read_metrics(storage.join(r.directory, "metrics.jsonl"))
            val = eval_curve(records)
            if val.tokens.size:
                val_curves.append(val[:2])
            tokens = np.array([x["tokens"] for x in records], float)
            loss = np.array([x["loss"] for x in records], float)
            if loss.size:
                k = max(1, len(loss) // 50)
                smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
                train_curves.append((tokens[k - 1 :], smooth))
        name = model_name(label, rs)
        draw_seed_curves(ax_val, val_curves, color, name, marker="o")
        draw_seed_curves(ax_train, train_curves, color, name)
    for ax, title in ((ax_val, "validation loss"), (ax_train, "training loss (smoothed)")):
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
    for ax, (t, curve) in zip(ax_diff, differences.items()):
        draw_difference(ax, curve, crossover(curve), what=minus(t))
    for ax in (ax_val, ax_train, *ax_diff):
        token_axis(ax)
    fig.suptitle(storage.absolute(run_dir).name)
    fig.tight_layout()
    return fig


def plot_losses(run_dir: str, results: Sequence[TrainResult], path: str) -> None:
    """``loss.png``: validation loss and smoothed training loss against tokens; every seed thin,
    the mean over seeds thick, one colour per model; with DIFF and its twin, a third panel of
    DIFF − twin against tokens (:func:`draw_difference`). ``path``: local or ``gs://``."""
    storage.save_figure(loss_figure(run_dir, results), path, dpi=110)


def comparison_sentences(results: Sequence[TrainResult], twin: str = "standard") -> list[str]:
    """Per metric, DIFF minus ``twin`` in words: the mean, the 95% t-interval over the paired
    seeds and whether it excludes zero (or that one seed gives no interval)."""
    groups = group_by_label(results)
    if not ("diff" in groups and twin in groups):
        return []
    out = []
    for row in metric_rows(results):
        if row.timing:
            continue  # timing: see the side-by-side measurement
        d = paired_difference(*paired_by_seed(groups, row.get, b=twin))
        what = row.name[0].upper() + row.name[1:]
        name, spec = twin_name(twin), row.spec.replace("{:", "{:+")
        out.append("- " + describe_difference(d, what, "DIFF", name, spec))
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
def _title(exp: Comparison, groups: dict[str, list[TrainResult]]) -> list[str]:
    return [
        f"# {exp.run.name}: " + " vs ".join(model_name(label, rs) for label, rs in groups.items()),
        "",
    ]


def _results(
    results: Sequence[TrainResult], groups, n_seeds: int, flops: Flops | None = None
) -> list[str]:
    n = len(twins_of(groups))
    same = "seed by seed: the same init seed and the same batches"
    paired = (
        f"; the last column is the paired difference DIFF − twin ({same}) and its 95% "
        f"Student-t interval."
        if n == 1
        else f"; the last {n} columns are the paired differences of DIFF and each twin ({same}) "
        f"and their 95% Student-t intervals."
    )
    return [
        f"{n_seeds} seed{'s' * (n_seeds != 1)} per model; each cell is the mean ± the standard "
        f"deviation over seeds (a single value with one seed)" + (paired if n else "."),
        "",
        results_table(results, flops),
        "",
        *([flops.note(), ""] if flops is not None else []),
    ]


def _comparison(results: Sequence[TrainResult], twin: str = "standard") -> list[str]:
    sentences = comparison_sentences(results, twin)
    against = "its twin" if twin == "standard" else twin_name(twin)
    return [f"**DIFF against {against}:**", "", *sentences, ""] if sentences else []


def over_training(curve: DifferenceCurve | None, twin: str = "standard") -> list[str]:
    """The lines of DIFF − ``twin`` over training: the crossover, the difference at the last
    evaluation with its interval, and the difference at a handful of evaluations."""
    if curve is None:
        return []
    n = curve.n_seeds
    how = (
        f"the band: the pointwise {curve.confidence:.0%} Student-t interval over the {n} paired "
        f"seeds at each evaluation"
        if n > 1
        else "one seed: no band"
    )
    cross = crossover(curve)
    return [
        f"**{minus(twin)} over training** (validation loss, seed by seed, at the "
        f"{curve.tokens.size} evaluations every seed of both models has; {how}; its "
        f"panel of loss.png):"
        if twin != "standard"
        else f"**DIFF − twin over training** (validation loss, seed by seed, at the "
        f"{curve.tokens.size} evaluations every seed of both models has; {how}; the right "
        f"panel of loss.png):",
        "",
        f"- {describe_crossover(cross, b=twin_name(twin))}",
        f"- {describe_final(cross, b=twin_name(twin))}",
        "",
        difference_table(curve, what=minus(twin)),
        "",
    ]


def _retrieval(exp: Comparison, results: Sequence[TrainResult]) -> list[str]:
    """The seed count of a run whose data declared a query accuracy (a retrieval task)."""
    if QUERY_ACCURACY not in metric_keys(results):
        return []
    chance = query_chance(exp.data)
    return learned_counts(results, chance["no_retrieval"], chance["no_retrieval_first"])


def mixture_lines(exp: Comparison, results: Sequence[TrainResult]) -> list[str]:
    """A mixture run's section: per component its weight, its share of the examples trained
    on and the passes over it (``TrainResult.mixture``), and DIFF − twin in its validation loss
    with the 95% interval over paired seeds (where DIFF helps, if anywhere); the weights over
    the run when they changed at a resume."""
    mixed = next((r.mixture for r in results if r.mixture), None)
    if exp.data.source != "mixture" or mixed is None:
        return []
    groups = group_by_label(results)
    paired = "diff" in groups and "standard" in groups
    lines = [
        f"**The mixture** ({len(mixed['components'])} components; the validation loss above is "
        f"their blend by the training shares; when a component runs out: "
        f"{exp.data.mixture.exhausted}):",
        "",
        "| component | weight | share of trained examples | passes over it | validation loss"
        + (" DIFF − twin [95% CI] |" if paired else " |"),
        "|---|---:|---:|---:|---:|",
    ]
    for name, c in mixed["components"].items():
        row = _metric_row(COMPONENT_LOSS + name)
        if paired:
            cell = _difference_cell(groups, row)
        else:
            cell = fmt_mean_std([row.get(r) for r in results], row.spec)
        lines.append(
            f"| {name} | {c['weight']:g} | {c['share']:.1%} | {c['passes']:.3g} | {cell} |"
        )
    lines.append("")
    if len(mixed["stages"]) > 1:
        lines += ["Weights over the run: " + "; ".join(stage_words(mixed["stages"])) + ".", ""]
    return lines


def throughput_table(throughput: SideBySide, flops: Flops) -> str:
    """The side-by-side throughput per model: median tokens/s, model TFLOP/s per device and
    MFU (``n/a`` without a peak: :meth:`Flops.note`, under the results table, says why)."""
    devices = throughput.devices or jax.device_count()
    lines = [
        "| model | tokens/s (side by side, median) | TFLOP/s per device | MFU |",
        "|---|---:|---:|---:|",
    ]
    for label in throughput.labels:
        tps = throughput.median_tokens_per_s(label)
        cfg = flops.models.get(label)
        name = label if cfg is None else model_name(label, [kind_entry(cfg)])
        lines.append(
            f"| {name} | {tps:,.0f} | {_fmt(flops.tflops(label, tps, devices), '{:.3g}')} | "
            f"{_fmt(flops.mfu(label, tps, devices), '{:.1%}')} |"
        )
    return "\n".join(lines)


def _throughput(throughputs: Sequence[SideBySide], flops: Flops | None = None) -> list[str]:
    """The side-by-side measurement of DIFF against each twin (one pair at a time)."""
    out = []
    for throughput in throughputs:
        table = [throughput_table(throughput, flops), ""] if flops else []
        out += [
            f"**Throughput, measured side by side:** {throughput.describe()}. The "
            f"tokens/s rows above are medians during each model's own training, one model "
            f"after the other, so whatever else ran on the machine then lands on one model "
            f"only; compare throughput by this side-by-side figure.",
            "",
            *table,
        ]
    return out


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


def _setup_model(exp: Comparison) -> str:
    m = exp.model
    twin_std = exp.compare.twin_init_std
    init = (
        f"{m.init_std:g} (both models)"
        if twin_std is None
        else f"{m.init_std:g} (DIFF) and {twin_std:g} (twin): **not one init scale** "
        f"(`compare.twin_init_std`)"
    )
    gate = f", gated attention's output gate `{m.gate}` (both)" if m.gate != "none" else ""
    line = (
        f"- model: `{m.attention}`, d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} "
        f"heads ({m.kv_heads} kv), head dim {m.resolved_head_dim}, dtype {m.dtype}{gate}, init "
        f"std {init}; the twin: standard attention with the matching heads (`diffjax.twin`)."
    )
    if "gated" in exp.compare.twins:
        models = exp.models
        extra = count_params(models["gated"]).total - count_params(models["standard"]).total
        line += (
            f"\n- the gated twin: the twin with gated attention's output gate "
            f"(`compare.twin_gate={exp.compare.twin_gate}`: sigmoid(x W_gate) times each "
            f"head's output before out_proj, Qiu et al. 2025), {extra:,} parameters more than "
            f"the twin: matched to it in everything but the gate, not in parameters."
        )
    return line


def _setup_training(exp: Comparison, data_description: str) -> list[str]:
    t, d = exp.train, exp.data
    return [
        f"- data: {data_description or d.source}; sequence length {d.seq_len}; the same batches "
        f"in the same order for every model and seed (data seed {d.seed}).",
        f"- training: {t.steps} steps x {t.batch_size} sequences, AdamW lr {t.lr:g} "
        f"({t.schedule} decay, {t.warmup_steps} warmup, betas ({t.b1}, {t.b2}), weight decay "
        f"{t.weight_decay}, clip {t.grad_clip}); init seeds {', '.join(map(str, exp.seeds))} "
        f"(DIFF and its twin share each); runs in `<label>/seed_<seed>/`.",
    ]


def _setup_measures(exp: Comparison, results: Sequence[TrainResult]) -> str:
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
    # the CPU and its vector extensions too: runs repeat on one machine, not across CPU types
    machine = f"- machine: {platform.node() or 'unknown'}, {machine_lib.summary()}."
    if results and results[0].mesh:
        machine += (
            f"\n- mesh: {results[0].mesh}; parameters and optimizer state placed by the logical "
            f"axis rules of diffjax.infra.sharding."
        )
    return [f"- peak memory: {results[0].memory_source if results else ''}." + peaks, machine]


def attention_lines(results: Sequence[TrainResult]) -> list[str]:
    """Which implementation computed each model's attention in training, and why (one line per
    model; a result saved before this was recorded says nothing)."""
    seen: dict[str, TrainResult] = {}
    for r in results:
        if r.attention_impl is not None:
            seen.setdefault(r.label, r)
    if not seen:
        return []
    same = len({r.attention_impl for r in seen.values()}) == 1
    lines = [
        f"- attention: {label} ran {r.attention_impl} ({r.attention_impl_why})"
        for label, r in seen.items()
    ]
    if not same:
        lines.append(
            "  (each model ran its own fastest implementation: the throughput compares them as "
            "a user would run them; model.attention_impl=pallas makes both run one make)"
        )
    return lines


def _setup(exp: Comparison, results: Sequence[TrainResult], description: str) -> list[str]:
    return [
        "## Setup",
        "",
        _setup_model(exp),
        *_setup_training(exp, description),
        _setup_measures(exp, results),
        *attention_lines(results),
        *_setup_machine(results),
        "",
    ]


def write_report(
    run_dir: str,
    exp: Comparison,
    results: Sequence[TrainResult],
    data_description: str = "",
    throughput: Sequence[SideBySide] = (),
) -> str:
    """Write ``report.md`` and ``loss.png`` into ``run_dir`` (local or ``gs://``); return the
    markdown. ``throughput``: the side-by-side measurements of DIFF against each twin
    (:func:`diffjax.compare.side_by_side_throughput`), none when not measured."""
    plot_losses(run_dir, results, storage.join(run_dir, "loss.png"))
    groups = group_by_label(results)
    n_seeds = max((len(rs) for rs in groups.values()), default=0)
    flops = Flops.of(exp)
    sections: list[list[str]] = [
        _title(exp, groups),
        _results(results, groups, n_seeds, flops),
        *(
            section
            for t in twins_of(groups)
            for section in (_comparison(results, t), over_training(difference_curve(results, t), t))
        ),
        mixture_lines(exp, results),
        _retrieval(exp, results),
        _throughput(throughput, flops),
        _lambdas(groups),
        _per_seed(results, n_seeds),
        _plot(),
        signals.section(run_dir, results),
        _setup(exp, results, data_description),
    ]
    text = "\n".join(line for section in sections for line in section)
    storage.write_text(storage.join(run_dir, "report.md"), text)
    return text
