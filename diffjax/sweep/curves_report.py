"""The report of arms trained side by side (``Ladder(arms=...)`` with neither sizes nor a
field: one rung, the base config, a comparison per arm in ``RUN_DIR/<arm>/``): ``sweep.md`` and
``curves.png`` in the run directory, rebuilt at any time from what the arms wrote (each
comparison's ``config.json``, ``<label>/seed_<s>/result.json`` and ``metrics.jsonl``).

Each DIFF model is paired with its twin (its arm's, or another arm's of the same config: DIFF
V1 and DIFF V2 can share one twin; :func:`diffjax.sweep.field_report.pairs`), seed by seed (the
same init seed, the same batches in the same order). Per pair: the final validation loss of
both (mean ± sd over the paired seeds), DIFF − twin at the last evaluation with its 95%
t-interval, the crossover (:mod:`diffjax.compare.curves`: the first evaluation after which the
pointwise band's upper bound stays below 0), the training time of each model, and DIFF − twin
at a handful of evaluations. ``curves.png``: per DIFF model a panel of DIFF − twin against
tokens with its band, and a panel of every model's validation curve.

The training time of a seed is the sum of its steps' times in ``metrics.jsonl``
(``result.json`` records the median step time, not the total): the steps alone, without the
compilation (done ahead of the first step), the evaluations and the checkpoints.

Drawn on explicit :class:`matplotlib.figure.Figure` objects with the Agg canvas (no pyplot).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from diffjax.infra import storage
from diffjax.compare.curves import (
    Crossover,
    DifferenceCurve,
    EvalCurve,
    crossover,
    crossover_cell,
    describe_crossover,
    describe_final,
    difference_table,
    eval_curve,
    paired_curve,
)
from diffjax.compare.plots import draw_difference, draw_seed_curves, token_axis
from diffjax.evaluate.stats import difference_cell, fmt_mean_std
from diffjax.train.metrics import read_metrics

from diffjax.sweep.field_report import Family, families, pairs

FIGURE = "curves.png"


@dataclasses.dataclass(frozen=True)
class Model:
    """One model's finished seeds: the validation curve, the final validation loss and the
    training time (s; None where the records have no step times) of each."""

    family: Family
    curves: dict[int, EvalCurve]
    final: dict[int, float]
    time_s: dict[int, float | None]
    # per seed its result.json (tokens/s, MFU, parameters, the attention implementation)
    results: dict[int, dict] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def seeds(self) -> list[int]:
        return sorted(self.curves)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A DIFF model and its twin over the seeds both finished: DIFF − twin over training and
    its crossover (None: no seed in common, or no evaluation common to every seed)."""

    diff: Model
    twin: Model
    seeds: list[int]
    curve: DifferenceCurve | None
    cross: Crossover | None


def training_time(records: Sequence[Mapping[str, Any]]) -> float | None:
    """The sum of the records' ``step_time`` (s); None when none has one."""
    times = [r["step_time"] for r in records if isinstance(r.get("step_time"), (int, float))]
    return float(sum(times)) if times else None


def read_model(family: Family, value: Any = None) -> Model:
    """The finished seeds of ``family`` at rung ``value`` (arms only: None), read from each
    seed's ``metrics.jsonl``."""
    curves, times, results = {}, {}, {}
    final = dict(family.final.get(value, {}))
    for seed in sorted(final):
        folder = storage.join(family.folders[value], f"seed_{seed}")
        records = read_metrics(storage.join(folder, "metrics.jsonl"))
        curves[seed] = eval_curve(records)
        times[seed] = training_time(records)
        result = storage.join(folder, "result.json")
        results[seed] = storage.read_json(result) if storage.exists(result) else {}
    return Model(family, curves, final, times, results)


def pair_models(diff: Model, twin: Model) -> Pair:
    """The :class:`Pair` of ``diff`` and ``twin`` over the seeds both finished."""
    seeds, curve = paired_curve(diff.curves, twin.curves)
    return Pair(diff, twin, seeds, curve, None if curve is None else crossover(curve))


def _hours(seconds: float) -> str:
    """``0.25 s``, ``42 s``, ``12.5 min``, ``3.20 h``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def time_cell(model: Model, seeds: Sequence[int] | None = None) -> str:
    """The training time over ``seeds`` (all of the model's by default): mean ± sd (one seed:
    its time), in s, min or h; ``n/a`` without step times."""
    return fmt_mean_std(
        [model.time_s[s] for s in (model.seeds if seeds is None else seeds)], _hours
    )


def _config_line(plan: dict) -> str:
    ladder, runs = plan["ladder"], plan["sizes"]
    steps = sorted({r["steps"] for r in runs})
    tokens = sorted({r["tokens"] for r in runs})
    arms = "; ".join(f"{k}: `{' '.join(v)}`" for k, v in (ladder.get("arms") or {}).items())
    return (
        f"Config `{plan['config']}`, arms side by side ({arms}); "
        f"{', '.join(map(str, steps))} steps and {', '.join(f'{t:,}' for t in tokens)} tokens "
        f"per run, {ladder['evals']} evaluations each."
    )


def summary_lines(models: Sequence[Model], pairs_: Sequence[Pair]) -> list[str]:
    """Per pair one line: the crossover and the final difference with its interval; a line
    for each DIFF model whose twin has no run yet."""
    paired = {p.diff.family.key for p in pairs_}
    out = [
        f"- **{m.name}**: its twin has no finished seed yet."
        for m in models
        if m.family.is_diff and m.family.key not in paired
    ]
    for p in pairs_:
        head = f"- **{p.diff.name} against {p.twin.name}**"
        if p.cross is None:
            out.append(f"{head}: no seed finished by both with a common evaluation yet.")
            continue
        out.append(f"{head}: {describe_crossover(p.cross)} {describe_final(p.cross)}")
    return out


def pairs_table(pairs_: Sequence[Pair]) -> str:
    """Per pair: the final validation losses (mean ± sd over the paired seeds), DIFF − twin at
    the last evaluation with its 95% interval, the crossover and each model's training time."""
    lines = [
        "| DIFF model | twin | paired seeds | DIFF final val loss | twin final val loss | "
        "DIFF − twin, last evaluation [95% CI] | crossover | DIFF training time | "
        "twin training time |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for p in pairs_:
        diff = fmt_mean_std([p.diff.final[s] for s in p.seeds], "{:.4f}")
        twin = fmt_mean_std([p.twin.final[s] for s in p.seeds], "{:.4f}")
        if p.cross is None:
            final, cross = "n/a", "n/a"
        else:
            final, cross = difference_cell(p.cross.final), crossover_cell(p.cross)
        lines.append(
            f"| {p.diff.name} | {p.twin.name} | {len(p.seeds)} | {diff} | {twin} | {final} | "
            f"{cross} | {time_cell(p.diff, p.seeds)} | {time_cell(p.twin, p.seeds)} |"
        )
    return "\n".join(lines)


def _result_cell(m: Model, key: str, spec: str, scale: float = 1.0) -> str:
    """The mean over seeds of a ``result.json`` number (``-`` where none has it)."""
    xs = [r[key] * scale for r in m.results.values() if isinstance(r.get(key), (int, float))]
    xs = [x for x in xs if math.isfinite(x)]
    return spec.format(float(np.mean(xs))) if xs else "-"


def models_table(models: Sequence[Model]) -> str:
    """Every model once: its parameters, finished seeds, final validation loss, training time,
    tokens/s and MFU (medians of its timed steps, mean over seeds) and the attention that ran."""
    lines = [
        "| model | parameters | seeds finished | final val loss | training time per seed | "
        "tokens/s | MFU | attention |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for m in models:
        impls = sorted({r["attention_impl"] for r in m.results.values() if r.get("attention_impl")})
        lines.append(
            f"| {m.name} | {_result_cell(m, 'params', '{:,.0f}')} | "
            f"{', '.join(map(str, m.seeds))} | "
            f"{fmt_mean_std(list(m.final.values()), '{:.4f}')} | {time_cell(m)} | "
            f"{_result_cell(m, 'tokens_per_s', '{:,.0f}')} | "
            f"{_result_cell(m, 'mfu', '{:.1f}%', 100.0)} | {', '.join(impls) or '-'} |"
        )
    return "\n".join(lines)


def curves_markdown(plan: dict, models: Sequence[Model], pairs_: Sequence[Pair]) -> str:
    """The text of ``sweep.md``."""
    lines = ["# DIFF and its twin over training, arms side by side", "", _config_line(plan), ""]
    if not any(m.final for m in models):
        return "\n".join(lines + ["## Summary", "", "Nothing has finished yet."]) + "\n"
    lines += ["## Summary", "", *summary_lines(models, pairs_), ""]
    lines += [
        "## Final losses, crossovers and time",
        "",
        pairs_table(pairs_),
        "",
        "Final validation loss: each seed's last evaluation (`result.json`), mean ± sd over the "
        "paired seeds. DIFF − twin: seed by seed (the same init seed, the same batches in the "
        "same order) at the last evaluation every seed of both models has, with its 95% "
        "Student-t interval. Crossover: the first evaluation from which the upper bound of the "
        "pointwise 95% band of DIFF − twin stays below 0 to the last evaluation (a seed with a "
        "non-finite loss leaves the band undefined there). Training time: per seed the sum of "
        "the step times in `metrics.jsonl` (the steps alone: compilation, evaluations and "
        "checkpoints not counted), mean ± sd over seeds; the models trained one after the "
        "other on the same machine.",
        "",
        models_table(models),
        "",
        f"![DIFF − twin over training, and the validation curves]({FIGURE})",
        "",
    ]
    for p in pairs_:
        if p.curve is None:
            continue
        lines += [
            f"## {p.diff.name} − {p.twin.name} over training",
            "",
            f"{len(p.seeds)} paired seed{'s' * (len(p.seeds) != 1)} "
            f"({', '.join(map(str, p.seeds))}), {p.curve.tokens.size} evaluations common to "
            f"every seed of both.",
            "",
            difference_table(p.curve),
            "",
        ]
    return "\n".join(lines)


def curves_figure(models: Sequence[Model], pairs_: Sequence[Pair]) -> Figure:
    """Per DIFF model a panel of DIFF − twin against tokens (every seed thin, the mean thick,
    the pointwise 95% band, zero, the crossover), then one panel of every model's validation
    loss (every seed thin, the mean over seeds thick)."""
    drawn = [p for p in pairs_ if p.curve is not None]
    diffs = [m.family.key for m in models if m.family.is_diff]
    colors = {m.family.key: "black" for m in models} | {k: f"C{i}" for i, k in enumerate(diffs)}
    fig = Figure(figsize=(5.5 * (len(drawn) + 1), 4.2))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(drawn) + 1))
    for ax, p in zip(axes, drawn):
        color = colors.get(p.diff.family.key, "C3")
        draw_difference(ax, p.curve, p.cross, color, what=f"{p.diff.name} − {p.twin.name}")
        token_axis(ax)
    ax = axes[-1]
    for m in models:
        curves = [m.curves[s][:2] for s in m.seeds if m.curves[s].tokens.size]
        draw_seed_curves(ax, curves, colors[m.family.key], m.name)
    ax.set_title("validation loss (thin: each seed)", fontsize=10)
    ax.set_ylabel("loss (nats/token)")
    token_axis(ax)
    fig.tight_layout()
    return fig


def write_curves_report(run_dir: str, plan: dict) -> str:
    """Write ``sweep.md`` and ``curves.png`` into ``run_dir`` (local or ``gs://``) for a ladder
    of arms only; return the markdown."""
    fams = families(run_dir, plan)
    models = [read_model(f) for f in fams]
    by_key = {m.family.key: m for m in models}
    twins = plan["ladder"].get("twins")
    pairs_ = [pair_models(by_key[d.key], by_key[t.key]) for d, t in pairs(fams, twins)]
    text = curves_markdown(plan, models, pairs_)
    if any(m.final for m in models):
        storage.save_figure(curves_figure(models, pairs_), storage.join(run_dir, FIGURE), dpi=100)
    storage.write_text(storage.join(run_dir, "sweep.md"), text)
    return text
